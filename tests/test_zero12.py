"""ZeRO stages 1 and 2 (flexrt.zero) on real 1-, 2- and 4-rank gloo groups, driven directly (the engine's sequence of
calls): the same losses, parameters and gradient norms as plain torch on the whole batch (fp32, tight) and as stage 0
(bf16/fp16, as tightly: weights within one 16-bit ulp) and as the 16-bit torch reference of tests/reference.py on
1 and 2 ranks, with accumulation, clipping, an fp16 overflow skipped on every rank, and a model with uneven,
tiny, frozen, tied and unused parameters; MoE experts partitioned over their own groups; memory held per rank against
the ZeRO paper's model and against the tensors alive; communication volume 2Ψ per step; per-rank checkpoints."""
import copy, gc, math
import pytest, torch, torch.nn as nn, torch.nn.functional as F
from helpers import run_distributed
from flexrt import comm as dist
from flexrt.precision import Precision
from flexrt.engine.optim import ReplicatedOptimizer
from flexrt.engine.parts import ExpertGroups
from flexrt.zero import ZeroStage1, ZeroStage2

STAGES = {1: ZeroStage1, 2: ZeroStage2}
STEPS, BATCH, LR, CLIP = 3, 8, 0.05, 0.5

class Net(nn.Module):
    "Uneven sizes: a 1-element gain (fewer elements than ranks), a frozen layer, a tied weight, an unused layer"
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb, self.mid, self.frozen, self.unused = nn.Linear(6, 10), nn.Linear(10, 7), nn.Linear(10, 7), nn.Linear(3, 3)
        self.gain = nn.Parameter(torch.tensor([1.5]))
        self.out = nn.Linear(7, 6)
        self.frozen.requires_grad_(False)
    def forward(self, x):
        h = torch.tanh(self.emb(x))
        h = torch.tanh(self.mid(h)) * self.gain + self.frozen(h)
        return F.linear(torch.tanh(self.out(h)), self.emb.weight)[:, :3]   # emb.weight tied into the head

def data(steps=STEPS):
    g = torch.Generator().manual_seed(1)
    return torch.randn(steps * BATCH, 6, generator=g), torch.randn(steps * BATCH, 3, generator=g)

def reference(steps=STEPS):
    "Plain torch, one process, the whole batch per step: (losses, parameters, pre-clip norms)"
    model, (X, Y) = Net(), data(steps)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.)
    losses, norms = [], []
    for s in range(steps):
        loss = F.mse_loss(model(X[s * BATCH:(s + 1) * BATCH]), Y[s * BATCH:(s + 1) * BATCH])
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step(); opt.zero_grad(); losses.append(loss.item())
    return losses, [p.detach() for p in model.parameters()], norms

def make_precision(name):
    if name == 'fp16': return Precision.fp16(initial_scale_power=8, hysteresis=1)
    return Precision.bf16() if name == 'bf16' else Precision.fp32()

def train(owner_cls, precision_name, rank, world, gas, steps=STEPS, inf_at=None, **kw):
    "This rank's share of each global batch through an owner of the optimizer step, in the engine's order"
    model, precision, (X, Y) = Net(), make_precision(precision_name), data(steps)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.)
    owner = owner_cls(model, opt, precision, **kw)
    micro, out = BATCH // (world * gas), {'losses': [], 'norms': [], 'skipped': [], 'scales': []}
    for s in range(steps):
        total = 0.
        for i in range(gas):
            lo = s * BATCH + (i * world + rank) * micro
            x, y = X[lo:lo + micro].to(precision.dtype), Y[lo:lo + micro]
            if inf_at == (s, i) and rank == world - 1: x[0, 0] = math.inf
            owner.set_boundary(i == gas - 1)
            loss = F.mse_loss(model(x).float(), y)
            precision.backward(loss / gas)
            total += loss.item() / gas
        grads = owner.reduced_gradients()
        overflow = precision.unscale_and_check(grads)
        pre, _ = owner.clip_grad_norm(CLIP)
        if not overflow: owner.step()
        owner.zero_grad()
        t = torch.tensor([total]); dist.all_reduce(t)
        out['losses'].append(t.item() / world); out['norms'].append(pre)
        out['skipped'].append(overflow); out['scales'].append(precision.loss_scale)
    out['params'] = [p.detach().float().clone() for p in model.parameters()]
    owner.close()
    return out

# ------------------------------------------------------------------ numerics: stage 1/2 = torch (fp32), = stage 0 (16-bit)
CASES = [(stage, prec, gas) for stage in (1, 2) for prec in ('fp32', 'bf16', 'fp16') for gas in (1, 2)]

def rank_numerics(rank, world):
    results = {}
    for stage, prec, gas in CASES:
        inf_at = (1, gas - 1) if prec == 'fp16' else None
        kw = dict(bucket_bytes=120, overlap_comm=(gas == 1))
        results[stage, prec, gas] = train(STAGES[stage], prec, rank, world, gas, inf_at=inf_at, **kw)
        if prec != 'fp32': results[0, prec, gas] = train(ReplicatedOptimizer, prec, rank, world, gas, inf_at=inf_at)
        if prec != 'fp32' and gas == 2:
            results['drop', prec] = train(stage0_dropping_last_step(prec), prec, rank, world, gas, inf_at=inf_at)
    for stage in (1, 2):   # reduce_scatter=False: each bucket all-reduced, the chunk kept
        results['all_reduce', stage] = train(STAGES[stage], 'fp32', rank, world, 2, bucket_bytes=120, reduce_scatter=False)
        results['predivide', stage] = train(STAGES[stage], 'fp32', rank, world, 1, bucket_bytes=120, gradient_predivide_factor=2.)
        # the native reduce_scatter_tensor / all_gather_into_tensor, and both as all-reduces (the cases above run
        # gloo's default, the direct-message forms)
        results['native', stage] = train(STAGES[stage], 'fp32', rank, world, 2, bucket_bytes=120, collectives='native')
        results['via_all_reduce', stage] = train(STAGES[stage], 'fp32', rank, world, 2, bucket_bytes=120, collectives='all_reduce')
    return results

def low_reference(_rank, _world, world, prec, gas, drop_step=None):
    "tests/reference.py's 16-bit run of `train`'s model, data (the injected inf included) and optimizer"
    from reference import reference16
    X, Y = data()
    micro, dtype = BATCH // (world * gas), torch.bfloat16 if prec == 'bf16' else torch.float16
    def batch(s, r, i):
        lo = s * BATCH + (i * world + r) * micro
        x = X[lo:lo + micro].clone()
        if prec == 'fp16' and (s, i) == (1, gas - 1) and r == world - 1: x[0, 0] = math.inf
        return x, Y[lo:lo + micro]
    micro_batches = [[[batch(s, r, i) for i in range(gas)] for r in range(world)] for s in range(STEPS)]
    ref = reference16(Net, micro_batches, lambda m, b: F.mse_loss(m(b[0].to(dtype)).float(), b[1]),
                      lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.), dtype, gas=gas, clip=CLIP,
                      scale=1. if prec == 'bf16' else 256., dynamic=prec == 'fp16', drop_step=drop_step)
    ref['losses'] = [sum(sum(r) for r in step) / (gas * world) for step in ref['micro_losses']]
    return ref

def check16(got, want, prec, case, world=2):
    """16-bit runs that do the same casts in the same order: weights within one 16-bit ulp, losses and norms to fp32 ulps.
    On more than 2 ranks the 16-bit sum of the ranks' gradients depends on the order (gloo's all-reduce at stage 0, the
    reduce-scatter at stages 1/2): measured, weights then differ by at most 1 ulp at the tensor's scale and losses by
    8e-5 relative; allowed: 2 ulps at the tensor's scale and 1 relative ulp (2**-8 bf16, 2**-10 fp16). A lost step moves
    weights by about lr = 0.05, 4x that bound (the test checks that a stage 0 losing its last step fails)."""
    from reference import assert_ulps, assert_close16, close16_scale
    dtype = torch.bfloat16 if prec == 'bf16' else torch.float16
    assert got['skipped'] == want['skipped'] and got['scales'] == want['scales'], case
    if world <= 2:
        assert_ulps(got['losses'], want['losses'], msg=case + ' losses')
        assert_ulps(got['norms'], want['norms'], msg=case + ' norms')
        assert_close16(got['params'], want['params'], dtype, msg=case + ' weights')
        return
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got['losses'], want['losses'], rtol=eps, atol=0, equal_nan=True, msg=case + ' losses')
    finite = [math.isfinite(n) for n in want['norms']]
    assert [math.isfinite(n) for n in got['norms']] == finite, case + ' norms'   # inf or nan where a step overflowed
    torch.testing.assert_close([n for n, f in zip(got['norms'], finite) if f], [n for n, f in zip(want['norms'], finite) if f],
                               rtol=eps, atol=0, msg=case + ' norms')
    for i, (p, q) in enumerate(zip(got['params'], want['params'])): assert close16_scale(p, q, dtype), f'{case} weights {i}'

DROP = {'bf16': STEPS - 1, 'fp16': 1}   # the last applied step (fp16 skips step 1 on the injected inf)

def stage0_dropping_last_step(prec):
    "Stage 0 that loses its last applied optimizer step"
    from test_engine import DropOneStep
    return lambda *a, **kw: DropOneStep(ReplicatedOptimizer(*a, **kw), DROP[prec])

@pytest.mark.parametrize('world', [1, 2, 4])
def test_stages_1_2_match_torch_and_stage_0(world):
    ref_losses, ref_params, ref_norms = reference()
    refs = {} if world > 2 else run_distributed(
        lambda r, w: {(p, g): low_reference(r, w, world, p, g) for p in ('bf16', 'fp16') for g in (1, 2)}, 1, init=False)[0]
    for rank, results in enumerate(run_distributed(rank_numerics, world, timeout=150)):
        for stage, prec, gas in CASES:
            got, case = results[stage, prec, gas], f"stage {stage} {prec} gas {gas} rank {rank}/{world}"
            if prec == 'fp32':
                assert got['skipped'] == [False] * STEPS, case
                torch.testing.assert_close(got['losses'], ref_losses, rtol=1e-5, atol=1e-6, msg=case)
                torch.testing.assert_close(got['norms'], ref_norms, rtol=1e-5, atol=1e-6, msg=case)
                for p, q in zip(got['params'], ref_params): torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=case)
                continue
            base = results[0, prec, gas]
            if prec == 'fp16':   # the injected inf on the last rank skips step 2 everywhere and halves the scale
                assert got['skipped'] == [False, True, False] and got['scales'] == [256., 128., 128.], case
            check16(got, base, prec, case + ' vs stage 0', world)   # as tight as the sums allow: the same casts
            if world <= 2: check16(got, refs[prec, gas], prec, case + ' vs the 16-bit reference')
        for prec in ('bf16', 'fp16'):   # the same check sees stage 0 losing its last step
            with pytest.raises(AssertionError, match='weights'): check16(results[1, prec, 2], results['drop', prec], prec, 'dropped', world)
        for stage in (1, 2):
            for variant in ('all_reduce', 'predivide', 'native', 'via_all_reduce'):
                got = results[variant, stage]
                torch.testing.assert_close(got['losses'], ref_losses, rtol=1e-5, atol=1e-6, msg=variant)
                for p, q in zip(got['params'], ref_params): torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=variant)

# ------------------------------------------------------------------ memory: the ZeRO paper's model, and the tensors alive
def _alive_bytes()->int:
    "Bytes of every tensor storage alive in this process, each once"
    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            s = obj.untyped_storage()
            if s.data_ptr() not in seen: seen.add(s.data_ptr()); total += s.nbytes()
    return total

def _wide(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 96), nn.Tanh(), nn.Linear(96, 77), nn.Tanh(), nn.Linear(77, 5))

def rank_memory(rank, world, stage, prec):
    precision = make_precision(prec)
    before = _alive_bytes()
    model = _wide()
    owner = STAGES[stage](model, torch.optim.Adam(model.parameters(), lr=1e-3), precision, bucket_bytes=8000)
    x = torch.randn(4, 64).to(precision.dtype)
    precision.backward(model(x).float().square().mean())
    grads = owner.reduced_gradients()
    precision.unscale_and_check(grads); owner.clip_grad_norm(1.); owner.step(); owner.zero_grad()
    del x, grads
    alive = _alive_bytes() - before
    pads = [bk.partition.padded_numel - bk.partition.numel for bk in owner.buckets]
    spares = [t.nbytes for t in getattr(owner.reducer, 'spare_buffers', [])]   # stage 2's bucket buffers, kept for the next backward
    bound = 2 * max(bk.partition.padded_numel + bk.partition.shard_numel for bk in owner.buckets) * precision.dtype.itemsize
    return owner.memory_breakdown(), alive, len(owner.buckets), sum(pads), sum(spares), bound

@pytest.mark.parametrize('world,stage,prec', [(2, 1, 'bf16'), (2, 2, 'fp32'), (4, 2, 'bf16'), (4, 1, 'fp32')])
def test_memory_matches_the_zero_model_and_the_tensors_alive(world, stage, prec):
    psi = sum(p.numel() for p in _wide().parameters())
    b = 4 if prec == 'fp32' else 2
    K = 8 if prec == 'fp32' else 12                          # Adam's moments (+ the fp32 master in bf16)
    for mem, alive, num_buckets, pad, spares, bound in run_distributed(rank_memory, world, args=(stage, prec)):
        assert num_buckets > 1
        assert (0 < spares <= bound) if stage == 2 else spares == 0   # at most two buffers of the largest bucket and its chunk
        grads = b * psi if stage == 1 else b * psi / world + spares
        expected = {'params': b * psi, 'grads': grads, 'optimizer_state': K * psi / world + 4 * num_buckets}   # + Adam's step counters
        slack = {'params': b * pad, 'grads': b * pad, 'optimizer_state': K * pad}
        for key in expected:
            assert expected[key] <= mem[key] <= expected[key] + slack[key], (key, mem, expected)
        assert mem['total'] == mem['params'] + mem['grads'] + mem['optimizer_state']
        assert mem['total'] <= alive <= mem['total'] + 4096, (mem, alive)   # nothing else sizeable stays alive

# ------------------------------------------------------------------ communication: 2Ψ per optimizer step
def _volume():
    stats = dist.get_comm_stats()
    return {op: sum(size * row['count'] for size, row in stats.get(op, {}).items())
            for op in ('all_reduce',) + NATIVE + P2P + VIA}

VIA = ('reduce_scatter_via_all_reduce', 'all_gather_via_all_reduce')   # the same collectives run as all-reduces
P2P = ('reduce_scatter_tensor_p2p', 'all_gather_into_tensor_p2p')      # gloo's default: direct messages
NATIVE = ('reduce_scatter_tensor', 'all_gather_into_tensor')
FORMS = {'native': NATIVE, 'p2p': P2P, 'all_reduce': VIA}

def rank_volume(rank, world, stage, prec, gas, collectives):
    precision, model = make_precision(prec), _wide()
    owner = STAGES[stage](model, torch.optim.Adam(model.parameters(), lr=1e-3), precision, bucket_bytes=8000, overlap_comm=True,
                          collectives=collectives)
    rs_op = FORMS[owner.collectives][0]
    dist.configure(enabled=True); dist.reset_log()
    after_micro = []
    for i in range(gas):
        owner.set_boundary(i == gas - 1)
        precision.backward(model(torch.randn(4, 64).to(precision.dtype)).float().square().mean())
        after_micro.append(_volume()[rs_op])
    grads = owner.reduced_gradients()
    precision.unscale_and_check(grads); owner.clip_grad_norm(1.); owner.step(); owner.zero_grad()
    padded = sum(bk.partition.padded_numel for bk in owner.buckets)
    return _volume(), after_micro, padded, owner.comm_bytes

@pytest.mark.parametrize('world,stage,prec,gas,collectives', [(2, 1, 'fp32', 3, 'native'), (2, 2, 'bf16', 3, 'native'),
                                                             (4, 2, 'fp32', 1, 'native'), (4, 1, 'bf16', 2, 'native'),
                                                             (2, 1, 'bf16', 2, 'auto'), (4, 2, 'fp32', 2, 'auto'),
                                                             (2, 2, 'fp32', 2, 'all_reduce'), (4, 1, 'fp32', 1, 'p2p')])
def test_communication_is_two_psi_per_step(world, stage, prec, gas, collectives):
    "Ψ reduce-scattered and Ψ all-gathered per step, in whichever form; on gloo 'auto' is the p2p form, logged under its own names"
    psi, b = sum(p.numel() for p in _wide().parameters()), (4 if prec == 'fp32' else 2)
    used = FORMS['p2p' if collectives == 'auto' else collectives]   # these tests run on gloo
    for volume, after_micro, padded, comm_bytes in run_distributed(rank_volume, world, args=(stage, prec, gas, collectives)):
        assert after_micro[:-1] == [0] * (gas - 1)                  # nothing sent off the boundary
        rs, ag = volume[used[0]] // b, volume[used[1]] // b
        assert all(volume[op] == 0 for form in FORMS.values() if form != used for op in form)
        assert rs == ag == padded and psi <= padded < psi + 10 * world   # Ψ each way, up to the padding
        assert volume['all_reduce'] <= 64                           # only the norm and the overflow flag besides
        assert comm_bytes == (rs + ag) * b

# ------------------------------------------------------------------ MoE: experts partitioned over their own groups
class MoENet(nn.Module):
    "A shared layer and one expert; with ep_size 2, rank r holds expert r % 2"
    def __init__(self, expert_seed):
        super().__init__()
        torch.manual_seed(0); self.shared = nn.Linear(6, 9)
        torch.manual_seed(expert_seed); self.expert = nn.Linear(9, 3)
        for p in self.expert.parameters(): p.allreduce, p.group_name = False, 'ep_size_2'
    def forward(self, x): return self.expert(torch.tanh(self.shared(x)))

def rank_moe(rank, world, stage):
    out = {}
    for name, cls in (('stage0', ReplicatedOptimizer), ('zero', STAGES[stage])):
        model, (X, Y) = MoENet(100 + rank % 2), data()
        groups = ExpertGroups(list(model.parameters()))
        owner = cls(model, torch.optim.AdamW(model.parameters(), lr=LR), Precision.fp32(), expert_groups=groups, bucket_bytes=100)
        norms = []
        for s in range(STEPS):
            owner.set_boundary(True)
            x, y = X[s * BATCH:(s + 1) * BATCH].chunk(world)[rank], Y[s * BATCH:(s + 1) * BATCH].chunk(world)[rank]
            F.mse_loss(model(x), y).backward()
            owner.reduced_gradients(); norms.append(owner.clip_grad_norm(0.2)[0]); owner.step(); owner.zero_grad()
        out[name] = ([p.detach().clone() for p in model.parameters()], norms)
        owner.close(); groups.close()
    expert_world = {bk.partition.world_size for bk in owner.buckets if bk.is_expert}
    return out, expert_world

@pytest.mark.parametrize('stage', [1, 2])
def test_moe_experts_partitioned_over_their_groups_match_stage_0(stage):
    for (out, expert_world) in run_distributed(rank_moe, 4, args=(stage,)):
        assert expert_world == {2}                                  # each expert split over its 2 replicas
        (p0, n0), (pz, nz) = out['stage0'], out['zero']
        torch.testing.assert_close(nz, n0, rtol=1e-5, atol=1e-6)
        for a, b in zip(pz, p0): torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

# ------------------------------------------------------------------ checkpoints: this rank's shard, through flexrt.checkpoint
def rank_checkpoint(rank, world, stage, d):
    import flexrt
    from flexrt.checkpoint import CheckpointError
    (X, Y) = data(4)
    cfg = {'train_batch_size': BATCH, 'bf16': {'enabled': True}, 'gradient_clipping': CLIP, 'steps_per_print': 1000,
           'zero_optimization': {'stage': stage, 'reduce_bucket_size': 60}}   # 120 bytes per bucket, as before
    model = Net()
    engine = flexrt.initialize(model=model, config=cfg, optimizer=torch.optim.AdamW(model.parameters(), lr=LR))[0]
    def one_step(s):
        x, y = X[s * BATCH:(s + 1) * BATCH].chunk(world)[rank], Y[s * BATCH:(s + 1) * BATCH].chunk(world)[rank]
        engine.backward(F.mse_loss(engine(x.to(torch.bfloat16)).float(), y)); engine.step()
    one_step(0); one_step(1)
    engine.save_checkpoint(d, tag='two')
    num = len(engine.optimizer.fragments())
    one_step(2); after = [p.detach().clone() for p in model.parameters()]
    one_step(3)
    engine.load_checkpoint(d, tag='two'); one_step(2)
    again = [p.detach().clone() for p in model.parameters()]
    errors = []
    other = Net(); other.out = nn.Linear(7, 5)   # another layout: a different output size
    bad = flexrt.initialize(model=other, config=cfg, optimizer=torch.optim.AdamW(other.parameters(), lr=LR))[0]
    try: bad.load_checkpoint(d, tag='two')
    except CheckpointError as e: errors.append(str(e))
    engine.close(); bad.close()
    return num, after, again, errors

@pytest.mark.parametrize('stage', [1, 2])
def test_checkpoint_restores_this_ranks_shard(tmp_path, stage):
    for rank, (num, after, again, errors) in enumerate(run_distributed(rank_checkpoint, 2, args=(stage, str(tmp_path)))):
        assert num > 1
        assert all(torch.equal(a, b) for a, b in zip(after, again))
        assert len(errors) == 1 and 'shape mismatch' in errors[0]
