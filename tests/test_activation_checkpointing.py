"Activation checkpointing at every ZeRO stage (2 gloo ranks): flexrt's / deepspeed.checkpointing's `checkpoint` and torch's (reentrant and not) train exactly like no checkpointing; they keep fewer activation bytes."
import warnings
import pytest, torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as tc
from helpers import run_distributed

WIDTH, DEPTH, BATCH, STEPS = 12, 3, 8, 3
MODES = ('flexrt', 'cpu', 'reentrant', 'non_reentrant', 'function')

class Net(nn.Module):
    "Residual MLP blocks with dropout (recomputation must replay the same mask); `mode` says how each block runs"
    def __init__(self, mode:str, width:int=WIDTH, depth:int=DEPTH):
        super().__init__()
        self.mode, self.inp, self.out = mode, nn.Linear(8, width), nn.Linear(width, 4)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Dropout(0.2),
                                                  nn.Linear(4 * width, width)) for _ in range(depth))
    def run(self, block, h):
        from flexrt import checkpointing
        if self.mode == 'none': return block(h)
        if self.mode in ('flexrt', 'cpu'): return checkpointing.checkpoint(block, h)
        if self.mode == 'function':   # a plain function reading the block's parameters (no module call inside for its first layer)
            return checkpointing.checkpoint(lambda x: block[1:](F.layer_norm(x, x.shape[-1:], block[0].weight, block[0].bias)), h)
        return tc.checkpoint(block, h, use_reentrant=self.mode == 'reentrant')
    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks: h = h + self.run(block, h)
        return self.out(h)

def train_rank(rank, ws, stages, dtype, modes, reuse=0):
    "Per stage and mode: a fresh engine trains STEPS steps (2 micro-batches each) on this rank's data; losses, final params, bytes gathered"
    out = {}
    for stage in stages:
        for mode in modes: out[stage, mode] = train(rank, ws, stage, dtype, mode, reuse)
    return out

def train(rank, ws, stage, dtype, mode, reuse):
    """One run: the losses, the final full parameters (fp32), the bytes the optimizer slot gathered and reduce-scattered,
    ZeRO-3's prefetch order, the gradient norms"""
    import flexrt
    from flexrt import checkpointing
    from flexrt.zero.stage3.gathered import GatheredParameters
    checkpointing.unconfigure()
    if mode == 'cpu': checkpointing.configure(deepspeed_config={'activation_checkpointing': {'cpu_checkpointing': True}})
    torch.manual_seed(0)
    model = Net(mode)
    cfg = {'train_batch_size': BATCH * ws, 'train_micro_batch_size_per_gpu': BATCH // 2, 'steps_per_print': 1000,
           'optimizer': {'type': 'AdamW', 'params': {'lr': 0.01}}, 'gradient_clipping': 1.0,
           'zero_optimization': {'stage': stage, 'stage3_param_persistence_threshold': 0,
                                 'stage3_max_reuse_distance': reuse}}
    if dtype == 'bf16': cfg['bf16'] = {'enabled': True}
    engine, *_ = flexrt.initialize(model=model, config=cfg)
    g, losses, norms = torch.Generator().manual_seed(1 + rank), [], []
    torch.manual_seed(100 + rank)   # dropout masks: the same sequence in every mode
    for micro in range(2 * STEPS):
        x, y = torch.randn(BATCH // 2, 8, generator=g), torch.randn(BATCH // 2, 4, generator=g)
        loss = (engine(x.to(torch.bfloat16 if dtype == 'bf16' else torch.float32)).float() - y).square().mean()
        engine.backward(loss); engine.step(); losses.append(loss.item())
        if micro % 2: norms.append(engine.get_global_grad_norm())   # 2 micro-batches a step
    with GatheredParameters(list(model.parameters())): params = [p.detach().float().clone() for p in model.parameters()]
    comm = getattr(engine.optimizer, 'comm_bytes', None)
    trace = [u.index for u in engine.optimizer.partitioner.trace] if stage == 3 else None   # ZeRO-3's prefetch order
    engine.close(); checkpointing.unconfigure()
    return losses, params, comm, trace, norms

def assert_same(results, stages, modes):
    "Bit-for-bit: the recomputation runs the same kernels on the same inputs with the same random state"
    for by in results:
        for stage in stages:
            losses0, params0, *_, norms0 = by[stage, 'none']
            for mode in modes:
                losses, params, *_, norms = by[stage, mode]
                assert losses == losses0 and norms == norms0, (stage, mode)
                for p, q in zip(params, params0): torch.testing.assert_close(p, q, atol=0, rtol=0, msg=f'stage {stage} {mode}')
    assert results[0][0, 'none'][0] != results[1][0, 'none'][0]   # the ranks saw different data (and dropout masks)

def test_checkpointed_training_equals_plain_fp32_every_stage():
    "Every way of checkpointing trains exactly as without it at ZeRO 0-3: same dropout masks, same gradients, same steps"
    results = run_distributed(train_rank, 2, args=((0, 1, 2, 3), 'fp32', ('none',) + MODES))
    assert_same(results, (0, 1, 2, 3), MODES)
    for by in results:   # and the ZeRO stages train as stage 0 (replicated) does, up to summation order: losses and gradient norms
        losses0, *_, norms0 = by[0, 'none']
        for stage in (1, 2, 3):
            losses, *_, norms = by[stage, 'none']
            assert losses == pytest.approx(losses0, rel=1e-5) and norms == pytest.approx(norms0, rel=1e-5), (stage, norms, norms0)
    for by in results:   # stage 3: the recomputation gathers no more than backward does anyway (nothing kept: reuse distance 0)
        for mode in ('flexrt', 'cpu', 'reentrant', 'non_reentrant'):
            assert by[3, mode][2] == by[3, 'none'][2], mode
            assert by[3, mode][3] == by[3, 'none'][3], mode   # the prefetch order: the model's forward, recomputations not in it

def test_checkpointed_training_equals_plain_bf16():
    "bf16 at stages 0 and 3, at stage 3 with units kept gathered from forward to backward (the default reuse distance)"
    modes = ('flexrt', 'reentrant', 'non_reentrant')
    assert_same(run_distributed(train_rank, 2, args=((0, 3), 'bf16', ('none',) + modes, 10**9)), (0, 3), modes)

def memory_rank(rank, ws, modes):
    "Bytes of CPU tensors the first forward leaves alive for backward, and the peak over forward and backward, per stage and mode"
    import flexrt
    from flexrt.memory.tracker import TensorMemoryTracker
    out = {}
    for stage in (0, 3):
        for mode in modes:
            torch.manual_seed(0)
            model = Net(mode, width=32, depth=4)   # activations (512 x 128 per hidden layer) dwarf the parameters
            cfg = {'train_batch_size': 512 * ws, 'steps_per_print': 1000, 'optimizer': {'type': 'SGD', 'params': {'lr': 0.01}},
                   'zero_optimization': {'stage': stage, 'stage3_param_persistence_threshold': 0, 'stage3_max_reuse_distance': 0}}
            engine, *_ = flexrt.initialize(model=model, config=cfg)
            x, y = torch.randn(512, 8), torch.randn(512, 4)
            with TensorMemoryTracker(count_existing=False) as tracker:
                before = tracker.allocated_bytes
                loss = (engine(x) - y).square().mean()
                kept = tracker.allocated_bytes - before
                engine.backward(loss)
                peak = tracker.peak_bytes - before
            del loss
            engine.step(); engine.close()
            out[stage, mode] = kept, peak
    return out

def test_checkpointing_keeps_fewer_activation_bytes():
    "Measured (exact CPU tensor bytes): the forward keeps under a fifth of the bytes, and backward peaks lower, at stages 0 and 3"
    modes = ('none', 'flexrt', 'reentrant', 'non_reentrant')
    for by in run_distributed(memory_rank, 2, args=(modes,)):
        for stage in (0, 3):
            kept0, peak0 = by[stage, 'none']
            assert kept0 > 4 * 512 * 128 * 4 * 2   # at least two 512 x 128 fp32 tensors per block without checkpointing
            for mode in modes[1:]:
                kept, peak = by[stage, mode]
                assert kept < kept0 / 5 and peak < peak0 * 0.6, (stage, mode, kept, kept0, peak, peak0)

def test_ignored_keys_warned_once_each_by_name():
    "partition_activations and contiguous_memory_optimization need model parallelism: one warning each, naming the key and why"
    from flexrt import checkpointing
    from flexrt.config import NoEffectWarning
    checkpointing._WARNED.clear()
    cfg = {'activation_checkpointing': {'partition_activations': True, 'contiguous_memory_optimization': True, 'cpu_checkpointing': True}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for _ in range(3): checkpointing.configure(deepspeed_config=cfg)
    messages = [str(w.message) for w in caught if w.category is NoEffectWarning]
    assert len(messages) == 2 and 'partition_activations' in messages[0] and 'contiguous_memory_optimization' in messages[1]
    assert 'no model parallelism' in messages[0] and 'leaves allocation to torch' in messages[1]
    assert checkpointing.is_configured() and checkpointing.SETTINGS['cpu']
    checkpointing.unconfigure()

@pytest.fixture
def deepspeed_tree():
    import flexrt.deepspeed as fd
    yield fd.use_as_deepspeed()
    fd.stop_using_as_deepspeed()

def test_deepspeed_paths_are_flexrt_checkpointing(deepspeed_tree):
    "`deepspeed.checkpointing` and DeepSpeed's runtime path give flexrt's functions; what needs model parallelism says so"
    import deepspeed
    from deepspeed.runtime.activation_checkpointing import checkpointing as runtime_path
    from flexrt import checkpointing
    assert deepspeed.checkpointing.checkpoint is checkpointing.checkpoint is runtime_path.checkpoint
    assert deepspeed.checkpointing.configure is checkpointing.configure and deepspeed.checkpointing.non_reentrant_checkpoint is checkpointing.checkpoint
    with pytest.raises(NotImplementedError, match='flexrt has no model parallelism'): deepspeed.checkpointing.get_cuda_rng_tracker()

class Tied(nn.Module):
    "GPT-style tied embedding and head, the head checkpointed: the shared weight gets gradients inside and outside the checkpoint"
    def __init__(self, mode):
        super().__init__()
        self.mode, self.tok, self.mid, self.head = mode, nn.Embedding(11, 6), nn.Linear(6, 6), nn.Linear(6, 11, bias=False)
        self.head.weight = self.tok.weight
    def forward(self, ids):
        h = self.mid(self.tok(ids))
        return self.head(h) if self.mode == 'none' else tc.checkpoint(self.head, h, use_reentrant=self.mode == 'reentrant')

def tied_rank(rank, ws, stage, modes):
    import flexrt
    out = {}
    for mode in modes:
        torch.manual_seed(0)
        cfg = {'train_batch_size': 4 * ws, 'steps_per_print': 1000, 'optimizer': {'type': 'SGD', 'params': {'lr': 0.1}},
               'zero_optimization': {'stage': stage, 'stage3_param_persistence_threshold': 0, 'stage3_max_reuse_distance': 0}}
        engine, *_ = flexrt.initialize(model=Tied(mode), config=cfg)
        g, losses = torch.Generator().manual_seed(rank), []
        try:
            for _ in range(3):
                ids = torch.randint(0, 11, (4, 5), generator=g)
                loss = F.cross_entropy(engine(ids[:, :-1]).reshape(-1, 11), ids[:, 1:].reshape(-1))
                engine.backward(loss); engine.step(); losses.append(loss.item())
        except RuntimeError as e: losses = str(e)
        engine.close()
        out[mode] = losses
    return out

def test_parameter_shared_across_a_reentrant_checkpoint():
    "Stage 3 sums the two gradients (the inner backward's and the outer one's); stages 0-2 refuse, saying what to use instead"
    for by in run_distributed(tied_rank, 2, args=(3, ('none', 'reentrant', 'non_reentrant'))):
        assert by['reentrant'] == by['none'] and by['non_reentrant'] == by['none'], by
    for by in run_distributed(tied_rank, 2, args=(1, ('none', 'reentrant', 'non_reentrant'))):
        assert by['non_reentrant'] == by['none'] and 'use_reentrant=False or flexrt.checkpointing.checkpoint' in by['reentrant']
