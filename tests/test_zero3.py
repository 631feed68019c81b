"ZeRO stage 3 on real gloo ranks: equality with a single-process torch reference, memory, communication volume, evaluation, close."
import copy, gc, math
import pytest, torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import run_distributed
from flexrt import comm as dist
from flexrt.config import ZeroConfig
from flexrt.precision import Precision
from flexrt.memory.tracker import TensorMemoryTracker
from flexrt.zero.stage3 import Stage3Optimizer
from flexrt.zero.stage3.gathered import GatheredParameters

VOCAB, DIM, BATCH, SEQ = 11, 6, 8, 5

class Net(nn.Module):
    "Tied embedding/head, a 3-element parameter (fewer elements than 4 ranks), an unused module, sizes not divisible by N"
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.body = nn.Sequential(nn.Linear(DIM, 10), nn.Tanh(), nn.Linear(10, DIM))
        self.norm = nn.LayerNorm(DIM)
        self.scale = nn.Parameter(torch.tensor([0.5, 0.3, 0.4]))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.unused = nn.Linear(5, 5)
    def forward(self, ids):
        h = self.emb(ids)
        h = h + self.body(h)
        return self.head(self.norm(h) * self.scale.sum())

def make_model(seed=0):
    torch.manual_seed(seed)
    return Net()

def data(steps, gas, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (steps, gas, BATCH, SEQ + 1), generator=g)

def loss_fn(model, ids): 
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

def make_optimizer(model): return torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)

def reference(steps, gas, clip=0.):
    "The single-process run on the full batch: plain torch model and optimizer"
    model, batches = make_model(), data(steps, gas)
    opt = make_optimizer(model)
    for s in range(steps):
        for m in range(gas): (loss_fn(model, batches[s, m]) / gas).backward()
        for p in model.parameters():   # flat ZeRO buffers (and stage 0's reducer) give unused parameters zero gradients,
            if p.grad is None: p.grad = torch.zeros_like(p)   # so weight decay still applies to them, as in DeepSpeed
        if clip: torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step(); opt.zero_grad()
    with torch.no_grad(): eval_loss = loss_fn(model, batches[0, 0]).item()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, eval_loss

def train_rank(rank, ws, steps, gas, dtype='fp32', clip=0., threshold=0, prefetch=50_000_000, reuse=1_000_000_000):
    model, batches = make_model(), data(steps, gas)
    precision = {'bf16': Precision.bf16, 'fp16': lambda: Precision.fp16(initial_scale_power=8), 'fp32': Precision.fp32}[dtype]()
    cfg = ZeroConfig(stage=3, stage3_param_persistence_threshold=threshold, stage3_prefetch_bucket_size=prefetch,
                     stage3_max_reuse_distance=reuse)
    opt = Stage3Optimizer(model, make_optimizer(model), precision, cfg)
    b = BATCH // ws
    for s in range(steps):
        for m in range(gas):
            opt.set_boundary(m == gas - 1)
            precision.backward(loss_fn(model, batches[s, m, rank * b:(rank + 1) * b]) / gas)
        grads = opt.reduced_gradients()
        assert not precision.unscale_and_check(grads)
        pre, post = opt.clip_grad_norm(clip)
        opt.step(); opt.zero_grad()
    placeholders = [p.numel() for p in model.parameters() if not opt.partitioner.records[p].persistent]
    with torch.no_grad(): eval_loss = loss_fn(model, batches[0, 0]).item()   # evaluation through the module's hooks
    with GatheredParameters(model.parameters()):
        params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    opt.close()
    return params, eval_loss, placeholders, pre

@pytest.mark.parametrize('ws,gas,threshold,prefetch,reuse', [(1, 1, 0, 50_000_000, 0), (2, 1, 0, 50_000_000, 10**9),
    (2, 2, 20, 0, 0), (4, 2, 0, 50_000_000, 0), (4, 1, 20, 100, 10**9), (4, 2, 0, 50_000_000, 150)])
def test_fp32_matches_single_process(ws, gas, threshold, prefetch, reuse):
    ref, ref_eval = reference(3, gas)
    for params, eval_loss, placeholders, _ in run_distributed(train_rank, ws, args=(3, gas, 'fp32', 0., threshold, prefetch, reuse)):
        assert set(params) == set(ref)
        for n in ref: torch.testing.assert_close(params[n], ref[n], atol=1e-5, rtol=1e-5, msg=n)
        assert abs(eval_loss - ref_eval) < 1e-5
        assert all(n == 0 for n in placeholders)   # partitioned parameters are placeholders between forwards

def test_clipping_matches_torch():
    ref, _ = reference(3, 1, clip=0.05)
    for params, _, _, pre in run_distributed(train_rank, 2, args=(3, 1, 'fp32', 0.05)):
        assert pre > 0.05   # the clip really acted
        for n in ref: torch.testing.assert_close(params[n], ref[n], atol=1e-5, rtol=1e-5, msg=n)

def low_reference(_rank, _world, ws, dtype, steps=3, gas=2, drop_step=None):
    "tests/reference.py's 16-bit run: reduce-scattered (16-bit) at every micro-batch, summed into fp32 shards"
    from reference import reference16
    batches, b = data(steps, gas), BATCH // ws
    micro = [[[batches[s, m, r * b:(r + 1) * b] for m in range(gas)] for r in range(ws)] for s in range(steps)]
    half = torch.bfloat16 if dtype == 'bf16' else torch.float16
    ref = reference16(make_model, micro, loss_fn, lambda ps: torch.optim.AdamW(ps, lr=0.02, weight_decay=0.01), half,
                      gas=gas, scale=1. if dtype == 'bf16' else 2. ** 8, dynamic=dtype == 'fp16', reduce='micro', drop_step=drop_step)
    with torch.no_grad(): ref['eval_loss'] = loss_fn(ref.pop('model'), batches[0, 0]).item()
    return ref

@pytest.mark.parametrize('dtype', ['bf16', 'fp16'])
def test_low_precision_matches_the_16bit_reference(dtype):
    "Weights within one 16-bit ulp of the torch run with the same casts in the same order; the evaluation loss to fp32 ulps"
    from reference import assert_ulps, assert_close16
    (ref,) = run_distributed(low_reference, 1, args=(2, dtype), init=False)
    half = torch.bfloat16 if dtype == 'bf16' else torch.float16
    for params, eval_loss, _, _ in run_distributed(train_rank, 2, args=(3, 2, dtype)):
        assert_close16(list(params.values()), ref['params'], half, msg=dtype)
        assert_ulps(eval_loss, ref['eval_loss'], msg='eval loss')
    (dropped,) = run_distributed(low_reference, 1, args=(2, dtype, 3, 2, 2), init=False)   # the same check sees a lost last step
    with pytest.raises(AssertionError): assert_close16(list(params.values()), dropped['params'], half)

class MLP(nn.Sequential):
    def __init__(self): super().__init__(nn.Linear(7, 13), nn.ReLU(), nn.Linear(13, 9), nn.ReLU(), nn.Linear(9, 3, bias=False))

def comm_rank(rank, ws, gas, reuse):
    torch.manual_seed(0)
    model = MLP()
    padded = sum(-(-p.numel() // ws) * ws for p in model.parameters())
    opt = Stage3Optimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), Precision.fp32(),
                          ZeroConfig(stage=3, stage3_param_persistence_threshold=0, stage3_max_reuse_distance=reuse))
    def step():
        for m in range(gas): model(torch.randn(4, 7)).square().mean().backward()
        opt.reduced_gradients(); opt.step(); opt.zero_grad()
    step()   # the first forward learns the order of the modules
    dist.configure(enabled=True, prof_all=True); dist.reset_log()
    before = opt.comm_bytes
    step()
    stats = dist.get_comm_stats(); dist.configure(enabled=False)
    moved = {op: sum(s['count'] * size for size, s in stats.get(op + '_p2p', {}).items()) // 4   # gloo: the direct-message forms
             for op in ('all_gather_into_tensor', 'reduce_scatter_tensor')}
    comm_bytes = opt.comm_bytes - before
    opt.close()
    return moved, padded, sum(p.numel() for p in model.parameters()), comm_bytes

@pytest.mark.parametrize('ws,gas', [(2, 1), (4, 2)])
def test_comm_volume_is_three_psi(ws, gas):
    "Released after every forward (stage3_max_reuse_distance=0): gather in forward and backward, reduce-scatter: 3Ψ"
    for moved, padded, psi, comm_bytes in run_distributed(comm_rank, ws, args=(gas, 0)):
        assert psi % ws != 0 and padded - psi < ws * 6   # uneven sizes, padding at most one element per parameter and rank
        assert moved == {'all_gather_into_tensor': 2 * padded * gas, 'reduce_scatter_tensor': padded * gas}
        assert comm_bytes == 4 * 3 * padded * gas   # what the engine reports as comm bytes
        assert 3 * psi * gas <= sum(moved.values()) <= 3 * (psi + ws * 6) * gas

def test_comm_volume_with_reuse_is_two_psi():
    "DeepSpeed's default reuse distance keeps a small model gathered from forward to backward: no backward gather"
    for moved, padded, psi, comm_bytes in run_distributed(comm_rank, 2, args=(2, 1_000_000_000)):
        assert moved == {'all_gather_into_tensor': padded * 2, 'reduce_scatter_tensor': padded * 2}

def memory_rank(rank, ws, threshold):
    gc.collect()
    with TensorMemoryTracker(count_existing=True) as tracker: before = tracker.allocated_bytes   # what other test modules left
    torch.manual_seed(0)
    model = MLP()
    numels = [p.numel() for p in model.parameters()]
    opt = Stage3Optimizer(model, torch.optim.Adam(model.parameters(), lr=0.01), Precision.fp32(),
                          ZeroConfig(stage=3, stage3_param_persistence_threshold=threshold))
    for _ in range(2):
        model(torch.randn(4, 7)).square().mean().backward()
        opt.reduced_gradients(); opt.step(); opt.zero_grad()
    gc.collect()
    with TensorMemoryTracker(count_existing=True) as tracker: alive = tracker.allocated_bytes - before
    steps = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim() == 0)
    return opt.memory_breakdown(), alive - steps, numels

@pytest.mark.parametrize('ws,threshold', [(2, 0), (4, 10)])
def test_memory_breakdown_matches_model_and_live_tensors(ws, threshold):
    for mb, alive, numels in run_distributed(memory_rank, ws, args=(threshold,)):
        shard = sum(-(-n // ws) for n in numels)          # Ψ/N within padding
        persistent = sum(n for n in numels if n < threshold)
        assert shard - sum(numels) / ws < len(numels)
        # fp32 Adam: params 4 + grads 4 + K = 8 (exp_avg, exp_avg_sq; the fp32 master is the working shard)
        assert (mb['grads'], mb['optimizer_state']) == (4 * shard, 8 * shard)
        # persistent parameters are whole on every rank (their gather buffer's padding: < N elements each)
        assert 4 * (shard + persistent) <= mb['params'] <= 4 * (shard + persistent + ws * (persistent > 0))
        assert mb['total'] == mb['params'] + 12 * shard
        assert alive == mb['total']   # every live tensor byte of the process is accounted for

def frozen_rank(rank, ws):
    model, batches = make_model(), data(2, 1)
    model.body[2].bias.requires_grad_(False)
    precision = Precision.fp32()
    opt = Stage3Optimizer(model, make_optimizer(model), precision, ZeroConfig(stage=3, stage3_param_persistence_threshold=0))
    b = BATCH // ws
    for s in range(2):
        loss_fn(model, batches[s, 0, rank * b:(rank + 1) * b]).backward()
        opt.reduced_gradients(); opt.step(); opt.zero_grad()
    assert dict(model.named_parameters())['body.2.bias'].numel() == 0   # frozen parameters are partitioned too
    opt.close()
    return {n: p.detach().clone() for n, p in model.named_parameters()}

def test_frozen_parameter_partitioned_and_never_stepped():
    model, batches = make_model(), data(2, 1)
    model.body[2].bias.requires_grad_(False)
    frozen = model.body[2].bias.detach().clone()
    opt = make_optimizer(model)
    for s in range(2):
        loss_fn(model, batches[s, 0]).backward()
        for p in model.parameters():
            if p.grad is None and p.requires_grad: p.grad = torch.zeros_like(p)
        opt.step(); opt.zero_grad()
    for params in run_distributed(frozen_rank, 2):
        torch.testing.assert_close(params['body.2.bias'], frozen, atol=0, rtol=0)
        for n, p in model.named_parameters(): torch.testing.assert_close(params[n], p.detach(), atol=1e-5, rtol=1e-5, msg=n)

def checkpoint_rank(rank, ws, d):
    "Train 2 steps, save (flexrt.checkpoint); train 1 more. A fresh engine loaded from the save and trained 1 step ends equal."
    import flexrt
    batches, b = data(3, 1), BATCH // ws
    cfg = {'train_batch_size': BATCH, 'steps_per_print': 1000, 'zero_optimization': {'stage': 3}}
    def build():
        model = make_model(); return model, flexrt.initialize(model=model, config=cfg, optimizer=make_optimizer(model))[0]
    def one_step(engine, s):
        engine.backward(loss_fn(engine, batches[s, 0, rank * b:(rank + 1) * b])); engine.step()
    model, engine = build()
    for s in range(2): one_step(engine, s)
    engine.save_checkpoint(d, tag='two')
    one_step(engine, 2)
    model2, engine2 = build()
    engine2.load_checkpoint(d, tag='two')
    one_step(engine2, 2)
    with GatheredParameters(model.parameters()), GatheredParameters(model2.parameters()):
        same = all(torch.equal(p, q) for p, q in zip(model.parameters(), model2.parameters()))
    names = {p: n for n, p in model.named_parameters()}
    pieces = [(names[pc.param], pc.start, pc.numel) for f in engine.optimizer.fragments() for pc in f.pieces]
    engine.close(); engine2.close()
    return same, pieces

def test_checkpoint_round_trip_and_fragments(tmp_path):
    (same0, pieces0), (same1, pieces1) = run_distributed(checkpoint_rank, 2, args=(str(tmp_path),))
    assert same0 and same1
    half = VOCAB * DIM // 2   # each rank's fragment holds its half of every parameter
    assert ('emb.weight', 0, half) in pieces0 and ('emb.weight', half, half) in pieces1

def modifier_rank(rank, ws):
    model = make_model()
    opt = Stage3Optimizer(model, torch.optim.SGD(model.parameters(), lr=0.0), Precision.bf16(), ZeroConfig(stage=3, stage3_param_persistence_threshold=0))
    with GatheredParameters(model.body[0].weight, modifier_rank=1), torch.no_grad():
        model.body[0].weight.fill_(float(rank + 1))   # rank 1's 2.0 wins; rank 0's 1.0 is discarded
    assert dict(model.named_parameters())['body.0.weight'].numel() == 0
    loss_fn(model, data(1, 1)[0, 0]).backward(); opt.reduced_gradients(); opt.step(); opt.zero_grad()   # lr 0: masters written back
    with GatheredParameters(model.body[0].weight): value = model.body[0].weight.detach().float().unique().tolist()
    opt.close()
    return value

def test_gathered_parameters_modifier_rank_broadcasts_and_repartitions():
    assert run_distributed(modifier_rank, 2) == [[2.0], [2.0]]

def close_rank(rank, ws):
    model = make_model()
    opt = Stage3Optimizer(model, make_optimizer(model), Precision.fp32(), ZeroConfig(stage=3, stage3_param_persistence_threshold=0))
    loss_fn(model, data(1, 1)[0, 0]).backward(); opt.reduced_gradients(); opt.step(); opt.zero_grad()
    with GatheredParameters(model.parameters()): expected = [p.detach().clone() for p in model.parameters()]
    opt.close()
    restored = all(torch.equal(p, e) for p, e in zip(model.parameters(), expected))
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    hooks += sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    marked = any(hasattr(p, '_zero3') for p in model.parameters()) or any(type(m._parameters) is not dict for m in model.modules())
    # the module is a plain module again: another stage-3 optimizer can be built on it in the same process
    opt2 = Stage3Optimizer(model, make_optimizer(model), Precision.fp32(), ZeroConfig(stage=3))
    loss_fn(model, data(1, 1)[0, 0]).backward(); opt2.reduced_gradients(); opt2.step(); opt2.close()
    return restored, hooks, marked, model.emb.weight is model.head.weight

def test_close_restores_full_parameters_and_removes_hooks():
    for restored, hooks, marked, tied in run_distributed(close_rank, 2):
        assert restored and hooks == 0 and not marked and tied

class ExternalUse(nn.Module):
    "A head that uses the embedding's weight in the parent's forward (GPT-2 style tying)"
    def __init__(self):
        super().__init__()
        self.emb, self.proj = nn.Embedding(VOCAB, DIM), nn.Linear(DIM, DIM)
    def forward(self, ids): return F.linear(self.proj(self.emb(ids)), self.emb.weight)

def external_rank(rank, ws):
    from flexrt.zero.stage3 import register_external_parameter
    torch.manual_seed(0); model = ExternalUse()
    register_external_parameter(model, model.emb.weight)
    opt = Stage3Optimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), Precision.fp32(), ZeroConfig(stage=3, stage3_param_persistence_threshold=0))
    loss_fn(model, data(1, 1)[0, 0]).backward(); opt.reduced_gradients(); opt.step(); opt.zero_grad()
    with GatheredParameters(model.parameters()): out = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.close()
    return out

def test_external_parameter_in_parent_forward():
    torch.manual_seed(0); model = ExternalUse()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn(model, data(1, 1)[0, 0]).backward(); opt.step()
    for out in run_distributed(external_rank, 2):
        for n, p in model.named_parameters(): torch.testing.assert_close(out[n], p.detach(), atol=1e-6, rtol=1e-6)

def test_errors():
    model = make_model()
    with pytest.raises(ValueError, match='not a parameter of the module'):
        Stage3Optimizer(model, torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1), Precision.fp32())
    opt = make_optimizer(model)
    loss_fn(model, data(1, 1)[0, 0]).backward(); opt.step()
    with pytest.raises(ValueError, match='before the first optimizer step'): Stage3Optimizer(model, opt, Precision.fp32())

def overflow_rank(rank, ws):
    model, precision = make_model(), Precision.fp16(initial_scale_power=8)
    opt = Stage3Optimizer(model, make_optimizer(model), precision, ZeroConfig(stage=3, stage3_param_persistence_threshold=0))
    precision.backward(loss_fn(model, data(1, 1)[0, 0, rank * 4:(rank + 1) * 4]))
    grads = opt.reduced_gradients()
    if rank == 1: grads[0][3] = math.inf   # only rank 1's shard overflows
    before = opt.groups[0]['master'].detach().clone()
    overflow = precision.unscale_and_check(grads)
    if not overflow: opt.step()
    opt.zero_grad()
    unchanged = torch.equal(before, opt.groups[0]['master'].detach())
    opt.close()
    return overflow, unchanged, precision.loss_scale

def test_fp16_overflow_on_one_rank_skips_everywhere():
    assert run_distributed(overflow_rank, 2) == [(True, True, 2. ** 8), (True, True, 2. ** 8)]   # hysteresis 2: scale kept once

def engine_rank(rank, ws, stage):
    import flexrt
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    cfg = {'train_batch_size': 8, 'train_micro_batch_size_per_gpu': 2, 'gradient_clipping': 0.5, 'steps_per_print': 1000,
           'optimizer': {'type': 'AdamW', 'params': {'lr': 0.01}}, 'zero_optimization': {'stage': stage}}
    engine, *_ = flexrt.initialize(model=model, config=cfg)
    g, losses, b = torch.Generator().manual_seed(1), [], 8 // (2 * ws)
    for step in range(6):   # accumulation: 2 micro-batches per step
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
        sl = slice((step % 2) * 4 + rank * b, (step % 2) * 4 + (rank + 1) * b)
        loss = (engine(x[sl]) - y[sl]).square().mean()
        engine.backward(loss); engine.step(); losses.append(loss.item())
    with torch.no_grad(): evaluation = engine.module(torch.ones(1, 8))   # evaluation through engine.module
    norm = engine.get_global_grad_norm()
    engine.close()
    return losses, evaluation, norm, [p.detach().clone() for p in model.parameters()]

def test_engine_stage3_matches_stage0():
    "Through flexrt.initialize (the engine picks Stage3Optimizer for stage 3): same losses, norms, evaluation, weights"
    for a, b in zip(run_distributed(engine_rank, 2, args=(0,)), run_distributed(engine_rank, 2, args=(3,))):
        torch.testing.assert_close(torch.tensor(b[0]), torch.tensor(a[0]), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(b[1], a[1], atol=1e-6, rtol=1e-6)
        assert abs(a[2] - b[2]) < 1e-5
        for p, q in zip(b[3], a[3]): torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-6)

# --- parameters read outside their own module's forward, with no declaration ---------------------------------------

class TiedGPT(nn.Module):
    "GPT-style: the head is `F.linear(h, self.tok.weight)` in the root's forward; `gain`'s weight is read, never called"
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
                                    for _ in range(2))
        self.gain = nn.Linear(1, DIM, bias=False)
        self.ln = nn.LayerNorm(DIM)
    def forward(self, ids):
        h = self.tok(ids)
        for block in self.blocks: h = h + block(h)
        return F.linear(self.ln(h) * self.gain.weight.view(-1), self.tok.weight)

def tied_rank(rank, ws, stage, gas, reuse):
    import flexrt
    torch.manual_seed(0)
    model, batches = TiedGPT(), data(3, gas)
    cfg = {'train_batch_size': BATCH, 'train_micro_batch_size_per_gpu': BATCH // ws // gas, 'steps_per_print': 1000,
           'zero_optimization': {'stage': stage, 'stage3_param_persistence_threshold': 0, 'stage3_max_reuse_distance': reuse}}
    engine, *_ = flexrt.initialize(model=model, optimizer=make_optimizer(model), config=cfg)
    b, losses = BATCH // ws, []
    for s in range(3):
        for m in range(gas):
            loss = loss_fn(engine, batches[s, m, rank * b:(rank + 1) * b])
            engine.backward(loss); engine.step(); losses.append(loss.item())
    at_rest = [p.numel() for p in model.parameters()]   # iterating does not gather
    with torch.no_grad(): eval_loss = loss_fn(engine.module, batches[0, 0]).item()
    head = engine.module.tok.weight.detach().clone()      # read outside a forward: gathered on demand (every rank reads it)
    with GatheredParameters(model.parameters()): params = {n: p.detach().clone() for n, p in model.named_parameters()}
    declared = any(hasattr(m, '_zero3_external') for m in model.modules())
    engine.close()
    return losses, params, eval_loss, head, at_rest, declared

@pytest.mark.parametrize('ws,gas,reuse', [(1, 1, 0), (2, 2, 0), (2, 1, 10**9), (4, 2, 0), (4, 1, 10**9)])
def test_tied_head_read_in_parent_forward_matches_stage0(ws, gas, reuse):
    "No register_external_parameter: the reads are detected; same losses, weights and evaluation as stage 0"
    stage0 = run_distributed(tied_rank, ws, args=(0, gas, reuse))
    for (losses, params, eval_loss, head, at_rest, declared), (losses0, params0, eval0, *_) in zip(run_distributed(tied_rank, ws, args=(3, gas, reuse)), stage0):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(losses0), atol=1e-5, rtol=1e-5)
        for n in params0: torch.testing.assert_close(params[n], params0[n], atol=1e-5, rtol=1e-5, msg=n)
        assert abs(eval_loss - eval0) < 1e-5
        torch.testing.assert_close(head, params0['tok.weight'], atol=1e-5, rtol=1e-5)
        assert all(n == 0 for n in at_rest) and not declared

def claim_rank(rank, ws):
    "What the detection did: the root claimed the head weight; it is released after each forward and gathered for backward"
    torch.manual_seed(0)
    model = TiedGPT()
    opt = Stage3Optimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), Precision.fp32(),
                          ZeroConfig(stage=3, stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0))
    records = {r.name: r for r in opt.partitioner.records.values()}
    seen = {}
    def before_head_backward(grad):   # the root's output gradient: autograd is about to run F.linear's backward
        seen['tok_whole_in_backward'] = records['tok.weight'].full
    out = model(data(1, 1)[0, 0, :, :-1])
    seen['tok_released_after_forward'] = not records['tok.weight'].full
    out.register_hook(before_head_backward)
    out.square().mean().backward()
    root = next(u for u in opt.partitioner.units if u.module is model)
    claimed = sorted(r.name for r in root.records)
    opt.close()
    return seen, claimed

def test_reads_are_claimed_by_the_module_in_forward():
    for seen, claimed in run_distributed(claim_rank, 2):
        assert claimed == ['gain.weight', 'tok.weight']
        assert seen == {'tok_released_after_forward': True, 'tok_whole_in_backward': True}
