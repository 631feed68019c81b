"""The engine trains exactly like plain torch on the whole batch: same losses, parameters and gradient norms on
1, 2 and 4 gloo ranks, with and without gradient accumulation (fp32, tight tolerance); clipping is torch's
clip_grad_norm_ on the full model (over the reducer's flat buckets on 2 and 4 ranks); bf16 and fp16 equal the 16-bit
torch reference of tests/reference.py (same casts, same order); closing an engine leaves no hooks behind."""
import copy
import pytest, torch, torch.nn as nn, torch.nn.functional as F
from helpers import run_distributed

STEPS, BATCH, CLIP, LR = 4, 8, 0.3, 0.05
CONFIG = {'train_batch_size': BATCH, 'gradient_clipping': CLIP, 'steps_per_print': 1000,
          'optimizer': {'type': 'AdamW', 'params': {'lr': LR, 'weight_decay': 0.01}},
          'scheduler': {'type': 'StepLR', 'params': {'step_size': 2, 'gamma': 0.5}}}

def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))

def make_data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS * BATCH, 6, generator=g), torch.randn(STEPS * BATCH, 3, generator=g)

def reference():
    "Plain torch, one process, the whole batch per step: (losses, parameters, pre-clip norms)"
    model, (X, Y) = make_model(), make_data()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    losses, norms = [], []
    for s in range(STEPS):
        loss = F.mse_loss(model(X[s * BATCH:(s + 1) * BATCH]), Y[s * BATCH:(s + 1) * BATCH])
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step(); sched.step(); opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach() for p in model.parameters()], norms

class DropOneStep:
    "Stands in the engine's optimizer slot and loses the optimizer step numbered `drop` (the bug the 16-bit tests must see)"
    def __init__(self, owner, drop:int): self.owner, self.drop, self.calls = owner, drop, 0
    def step(self):
        self.calls += 1
        if self.calls - 1 != self.drop: self.owner.step()
    def __getattr__(self, name): return getattr(self.owner, name)

def train_rank(rank, world, gas, extra=None, drop_step=None):
    "This rank's share of every global batch, `gas` micro-batches per step: (mean loss per step, parameters, norms)"
    import flexrt
    micro = BATCH // (world * gas)
    engine, *_ = flexrt.initialize(model=make_model(seed=rank), config={**CONFIG, 'gradient_accumulation_steps': gas, **(extra or {})})
    flat = getattr(engine.optimizer, '_flat_gradients', None)   # stage 0 only: the norm and clipping run over the reducer's flat buckets
    if flat is not None:
        flat_results = []
        def spy(): flat_results.append(flat()); return flat_results[-1]
        engine.optimizer._flat_gradients = spy
    if drop_step is not None: engine.optimizer = DropOneStep(engine.optimizer, drop_step)
    assert engine.get_batch_info() == (BATCH, micro, gas)
    X, Y = make_data()
    losses, norms = [], []
    for s in range(STEPS):
        local = []
        for k in range(gas):
            lo = s * BATCH + (rank * gas + k) * micro
            out = engine(X[lo:lo + micro].to(engine.precision.dtype)).float()   # bf16 models take bf16 inputs
            loss = F.mse_loss(out, Y[lo:lo + micro])
            engine.backward(loss); engine.step()
            local.append(loss.item())
        losses.append(sum(local) / gas)
        norms.append(engine.get_global_grad_norm())
    params = [p.detach().float().clone() for p in gathered(engine)]
    if drop_step is not None: engine.optimizer = engine.optimizer.owner
    flat_norm = flat is not None and len(flat_results) == STEPS and all(r is not None for r in flat_results)
    counters = (engine.global_steps, engine.global_samples, engine.micro_steps, engine.skipped_steps, engine.get_lr(), flat_norm)
    engine.close()
    return losses, params, norms, counters

def gathered(engine)->list:
    "The model's parameters, whole (ZeRO-3 partitions them between forwards)"
    if engine.optimizer.stage != 3: return [p.detach().clone() for p in engine.module.parameters()]
    from flexrt.zero.stage3.gathered import GatheredParameters
    with GatheredParameters(engine.module.parameters()): return [p.detach().clone() for p in engine.module.parameters()]

def both_accumulations(rank, world):
    return [train_rank(rank, world, gas) for gas in (1, 2)]

@pytest.fixture(scope='module')
def ref(): return reference()

@pytest.mark.parametrize('world', [1, 2, 4])
def test_matches_single_process_reference(world, ref):
    ref_losses, ref_params, ref_norms = ref
    assert max(ref_norms) > CLIP   # clipping is active in this run, so it is checked too
    per_rank = run_distributed(both_accumulations, world)
    for gas_index, gas in enumerate((1, 2)):
        results = [r[gas_index] for r in per_rank]
        losses = [sum(r[0][s] for r in results) / world for s in range(STEPS)]   # the global loss: mean over ranks
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for losses_r, params, norms, counters in results:
            for p, q in zip(params, ref_params): torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=1e-6)
            assert counters == (STEPS, STEPS * BATCH, STEPS * gas, 0, [LR * 0.25], world > 1)   # 1 rank: no buckets

# ---- 16-bit: the same casts in the same order as tests/reference.py, at every ZeRO stage
LOW = {'bf16': ({'bf16': {'enabled': True}}, torch.bfloat16, 1.),
       'fp16': ({'fp16': {'enabled': True, 'initial_scale_power': 8, 'hysteresis': 1}}, torch.float16, 256.)}

def low_rank(rank, world, cases, drop=None):
    "Train each (stage, precision) of `cases` on this rank, gas 2; `drop`: (stage, precision, step) whose optimizer step is lost"
    out = {}
    for stage, prec in cases:
        extra = {**LOW[prec][0], 'zero_optimization': {'stage': stage, 'reduce_bucket_size': 60}}
        out[stage, prec] = train_rank(rank, world, 2, extra=extra, drop_step=drop[2] if drop and drop[:2] == (stage, prec) else None)
    return out

def low_batches(world=2, gas=2):
    X, Y = make_data()
    micro = BATCH // (world * gas)
    at = lambda s, r, k: s * BATCH + (r * gas + k) * micro
    return [[[(X[at(s, r, k):at(s, r, k) + micro], Y[at(s, r, k):at(s, r, k) + micro]) for k in range(gas)]
             for r in range(world)] for s in range(STEPS)]

def low_reference(prec, stage, drop_step=None):
    "tests/reference.py's 16-bit run of this file's model, data, optimizer and schedule"
    from reference import reference16
    _, dtype, scale = LOW[prec]
    loss = lambda model, b: F.mse_loss(model(b[0].to(dtype)).float(), b[1])
    return reference16(make_model, low_batches(), loss, lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.01), dtype,
                       lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5), gas=2, clip=CLIP, scale=scale,
                       dynamic=prec == 'fp16', reduce='micro' if stage == 3 else 'boundary', drop_step=drop_step)

def check_low(results, ref, prec):
    "The comparison of every 16-bit test: losses and norms within a few fp32 ulps, weights within one 16-bit ulp"
    from reference import assert_ulps, assert_close16
    for rank, (losses, params, norms, counters) in enumerate(results):
        assert_ulps(losses, [sum(ref['micro_losses'][s][rank]) / 2 for s in range(STEPS)], msg=f'losses rank {rank}')
        assert_ulps(norms, ref['norms'], msg=f'norms rank {rank}')
        assert_close16(params, ref['params'], LOW[prec][1], msg=f'weights rank {rank}')
    assert all(torch.equal(p, q) for p, q in zip(results[0][1], results[1][1]))   # replicas stay identical

def references(cases, drop=None):
    "The references of `cases`, computed in a forked single-threaded process like the ranks"
    def run(rank, world): return {c: low_reference(c[1], c[0], drop[2] if drop and drop[:2] == c else None) for c in cases}
    return run_distributed(run, 1, init=False)[0]

@pytest.mark.parametrize('prec', ['bf16', 'fp16'])
def test_16bit_stage_0_matches_the_16bit_reference(prec):
    cases = [(0, prec)]
    per_rank, ref = run_distributed(low_rank, 2, args=(cases,)), references(cases)
    check_low([r[0, prec] for r in per_rank], ref[0, prec], prec)

def rebuild_rank(rank, world):
    "Build, train, close and rebuild engines in one process: hooks and gradient buffers do not pile up"
    import flexrt
    model = make_model()
    X, Y = make_data()
    for _ in range(3):
        engine, *_ = flexrt.initialize(model=model, config={**CONFIG, 'gradient_accumulation_steps': 2})
        for k in range(4):
            engine.backward(F.mse_loss(engine(X[:2]), Y[:2])); engine.step()
        assert all(len(p._post_accumulate_grad_hooks or {}) == 1 for p in model.parameters())
        engine.close()
        assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
        assert all(p.grad is None for p in model.parameters())
    return engine.global_steps

def test_close_and_rebuild_leaves_no_hooks():
    assert run_distributed(rebuild_rank, 2) == [2, 2]

def no_sync_rank(rank, world):
    "DDP's pattern: micro-steps inside no_sync() accumulate locally; the backward outside reduces the sum"
    import flexrt
    from flexrt import comm
    X, Y = make_data()
    engine, *_ = flexrt.initialize(model=make_model(), config={**CONFIG, 'gradient_clipping': 0.0, 'comms_logger': {'enabled': True}})
    comm.reset_log()   # forget the initial broadcast
    with engine.no_sync():
        for k in range(2): engine.backward(F.mse_loss(engine(X[rank * 4 + k:][:1]), Y[rank * 4 + k:][:1]) / 3)
    assert comm.get_comm_stats() == {}   # nothing communicated inside the block
    engine.backward(F.mse_loss(engine(X[rank * 4 + 2:][:1]), Y[rank * 4 + 2:][:1]) / 3)
    engine.step()
    assert 'all_reduce' in comm.get_comm_stats()
    norm = engine.get_global_grad_norm(); engine.close()
    assert not comm.comms_logger.enabled  # close() put the comms logger back as it was
    return norm

def test_no_sync_accumulates_then_reduces():
    model, (X, Y) = make_model(), make_data()
    loss = sum(F.mse_loss(model(X[r * 4 + k:][:1]), Y[r * 4 + k:][:1]) / 3 for r in range(2) for k in range(3)) / 2
    loss.backward()
    expected = torch.nn.utils.clip_grad_norm_(model.parameters(), float('inf')).item()
    for norm in run_distributed(no_sync_rank, 2): assert norm == pytest.approx(expected, rel=1e-5)

# ---- zero_grad leaves buffers as they are (the next backward overwrites them): a step with no backward still sees zeros
def _step_without_backward(rank, world, stage):
    import flexrt
    engine, *_ = flexrt.initialize(model=make_model(), config={**CONFIG, 'gradient_clipping': 0.,
                                   'zero_optimization': {'stage': stage, 'reduce_bucket_size': 60}})
    X, Y = make_data()
    micro = BATCH // world
    engine.backward(F.mse_loss(engine(X[rank * micro:(rank + 1) * micro]), Y[rank * micro:(rank + 1) * micro])); engine.step()
    grads = engine.optimizer.reduced_gradients()   # after zero_grad, with no backward since: every gradient is zero
    out = (len(grads) > 0, all(bool((g == 0).all()) for g in grads if g is not None), all(g is not None for g in grads))
    engine.backward(F.mse_loss(engine(X[:micro]), Y[:micro])); engine.step()
    engine.zero_grad(set_to_none=False)   # torch's other contract: stages 0-1 keep whole gradients, as zeros
    kept = [p.grad for p in engine.module.parameters()]
    out += (all(g is not None and bool((g == 0).all()) for g in kept) if stage < 2 else all(g is None for g in kept),)
    engine.close()
    return out

@pytest.mark.parametrize('stage', [0, 1, 2, 3])
def test_gradients_after_zero_grad_are_zeros_not_the_last_step(stage):
    for nonempty, zeros, present, set_to_none_false in run_distributed(_step_without_backward, 2, args=(stage,)):
        assert nonempty and present and zeros and set_to_none_false
