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

def train_rank(rank, ws, stage, dtype, modes, reuse=0):
    "For each mode: a fresh engine trains STEPS steps (2 micro-batches each) on this rank's data; losses and final full params"
    import flexrt
    from flexrt import checkpointing
    from flexrt.zero.stage3_params import GatheredParameters
    out = {}
    for mode in modes:
        checkpointing.reset()
        if mode == 'cpu': checkpointing.configure(deepspeed_config={'activation_checkpointing': {'cpu_checkpointing': True}})
        torch.manual_seed(0)
        model = Net(mode)
        cfg = {'train_batch_size': BATCH * ws, 'train_micro_batch_size_per_gpu': BATCH // 2, 'steps_per_print': 1000,
               'optimizer': {'type': 'AdamW', 'params': {'lr': 0.01}}, 'gradient_clipping': 1.0,
               'zero_optimization': {'stage': stage, 'stage3_param_persistence_threshold': 0,
                                     'stage3_max_reuse_distance': reuse}}
        if dtype == 'bf16': cfg['bf16'] = {'enabled': True}
        engine, *_ = flexrt.initialize(model=model, config=cfg)
        g, losses = torch.Generator().manual_seed(1 + rank), []
        torch.manual_seed(100 + rank)   # dropout masks: the same sequence in every mode
        for _ in range(2 * STEPS):
            x, y = torch.randn(BATCH // 2, 8, generator=g), torch.randn(BATCH // 2, 4, generator=g)
            loss = (engine(x.to(torch.bfloat16 if dtype == 'bf16' else torch.float32)).float() - y).square().mean()
            engine.backward(loss); engine.step(); losses.append(loss.item())
        with GatheredParameters(list(model.parameters())): params = [p.detach().float().clone() for p in model.parameters()]
        comm = getattr(engine.optimizer, 'comm_bytes', None)
        engine.close(); checkpointing.reset()
        out[mode] = losses, params, comm
    return out

def assert_same(results, modes):
    "Bit-for-bit: the recomputation runs the same kernels on the same inputs with the same random state"
    for by_mode in results:
        losses0, params0, _ = by_mode['none']
        for mode in modes:
            losses, params, _ = by_mode[mode]
            assert losses == losses0, mode
            for p, q in zip(params, params0): torch.testing.assert_close(p, q, atol=0, rtol=0, msg=mode)
    assert results[0]['none'][0] != results[1]['none'][0]   # the ranks saw different data (and dropout masks)

@pytest.mark.parametrize('stage', [0, 1, 2, 3])
def test_checkpointed_training_equals_plain_fp32(stage):
    "Every way of checkpointing trains exactly as without it: same dropout masks, same gradients, same steps"
    results = run_distributed(train_rank, 2, args=(stage, 'fp32', ('none',) + MODES))
    assert_same(results, MODES)
    if stage == 3:   # the recomputation gathers no more than the backward gathers anyway (nothing kept: reuse distance 0)
        for by_mode in results:
            for mode in ('flexrt', 'cpu', 'reentrant', 'non_reentrant'): assert by_mode[mode][2] == by_mode['none'][2], mode

@pytest.mark.parametrize('stage', [0, 3])
def test_checkpointed_training_equals_plain_bf16(stage):
    "bf16, and at stage 3 with units kept gathered from forward to backward (the default reuse distance)"
    modes = ('flexrt', 'reentrant', 'non_reentrant')
    assert_same(run_distributed(train_rank, 2, args=(stage, 'bf16', ('none',) + modes, 10**9)), modes)
