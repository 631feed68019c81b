"""fp16 overflow on one rank skips the step on every rank (weights, schedule untouched; scale halved; counted), and
MoE expert parameters are reduced over their own groups: an engine with experts spread over ranks trains exactly
like one process holding every expert."""
import math
import pytest, torch, torch.nn as nn, torch.nn.functional as F
from helpers import run_distributed

LR = 0.1

def fp16_config(**extra):
    return {'train_batch_size': 4, 'steps_per_print': 1000, 'gradient_clipping': 1.0,
            'fp16': {'enabled': True, 'initial_scale_power': 8, 'hysteresis': 1},
            'optimizer': {'type': 'SGD', 'params': {'lr': LR}},
            'scheduler': {'type': 'StepLR', 'params': {'step_size': 1, 'gamma': 0.5}}, **extra}

def snapshot(engine): return [p.detach().clone() for p in engine.module.parameters()]

def train_step(engine, x, poison=False):
    loss = engine(x.half()).float().pow(2).mean()
    engine.backward(loss * math.inf if poison else loss)
    engine.step()

def overflow_rank(rank, world):
    "Step 2 overflows on rank 1 only"
    import flexrt
    from flexrt import monitor
    torch.manual_seed(0)
    engine, *_ = flexrt.initialize(model=nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)), config=fp16_config())
    x, events = torch.randn(2, 6), []
    with monitor.listen(events.append):
        train_step(engine, x)
        before, lr, scale = snapshot(engine), engine.get_lr(), engine.precision.loss_scale
        train_step(engine, x, poison=rank == 1)
        unchanged = all(torch.equal(p, q) for p, q in zip(before, snapshot(engine)))
        after = (engine.get_lr(), engine.precision.loss_scale, engine.skipped_steps, engine.global_steps)
        train_step(engine, x)
    moved = not all(torch.equal(p, q) for p, q in zip(before, snapshot(engine)))
    engine.close()
    return unchanged, (lr, scale), after, moved, engine.get_lr(), [(e['step'], e['skipped'], e['loss_scale'], e['comm_bytes']) for e in events]

def test_fp16_overflow_on_one_rank_skips_everywhere():
    for unchanged, (lr, scale), after, moved, final_lr, events in run_distributed(overflow_rank, 2):
        assert unchanged                                  # the skipped step left the weights alone
        assert after == (lr, scale / 2, 1, 2)             # schedule not stepped, scale halved, skip counted
        assert moved and final_lr == [LR * 0.25]          # the next clean step trains and schedules again
        grad_bytes = (6 * 8 + 8 + 8 * 3 + 3) * 2      # every fp16 gradient all-reduced once per step
        assert events == [(1, False, 256., grad_bytes), (2, True, 128., grad_bytes), (3, False, 128., grad_bytes)]

# --- MoE: experts spread over ranks ------------------------------------------------------------------------------

class MoENet(nn.Module):
    "A shared layer and one expert; with ep_size n, rank r holds expert r % n"
    def __init__(self, shared_seed, expert_seed, ep_size):
        super().__init__()
        torch.manual_seed(shared_seed); self.shared = nn.Linear(6, 8)
        torch.manual_seed(expert_seed); self.expert = nn.Linear(8, 3)
        for p in self.expert.parameters(): p.allreduce, p.group_name = False, f'ep_size_{ep_size}'
    def forward(self, x): return self.expert(torch.tanh(self.shared(x)))

STEPS, BATCH, CLIP = 3, 8, 0.2

def data():
    g = torch.Generator().manual_seed(3)
    return torch.randn(STEPS * BATCH, 6, generator=g), torch.randn(STEPS * BATCH, 3, generator=g)

def moe_reference(world, ep_size):
    "One process with every expert: rank r's samples go through expert r % ep_size; the loss is the mean over ranks"
    shared = MoENet(0, 100, ep_size).shared
    experts = nn.ModuleList(MoENet(0, 100 + e, ep_size).expert for e in range(ep_size))
    params = [*shared.parameters(), *experts.parameters()]
    opt = torch.optim.SGD(params, lr=LR)
    (X, Y), micro, norms = data(), BATCH // world, []
    for s in range(STEPS):
        loss = sum(F.mse_loss(experts[r % ep_size](torch.tanh(shared(X[s * BATCH + r * micro:][:micro]))),
                              Y[s * BATCH + r * micro:][:micro]) for r in range(world)) / world
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params, CLIP).item())
        opt.step(); opt.zero_grad()
    return [p.detach() for p in shared.parameters()], [[p.detach() for p in e.parameters()] for e in experts], norms

def moe_rank(rank, world, ep_size, bf16=False):
    import flexrt
    import torch.distributed as tdist
    groups_before = len(tdist.distributed_c10d._world.pg_map)
    model = MoENet(rank, 100 + rank, ep_size)      # the broadcasts must make each group's replicas equal
    engine, *_ = flexrt.initialize(model=model, config={'train_batch_size': BATCH, 'gradient_clipping': CLIP,
                                   'optimizer': {'type': 'SGD', 'params': {'lr': LR}}, 'bf16': {'enabled': bf16}})
    (X, Y), micro, norms = data(), BATCH // world, []
    for s in range(STEPS):
        lo = s * BATCH + rank * micro
        out = engine(X[lo:lo + micro].to(engine.precision.dtype)).float()
        engine.backward(F.mse_loss(out, Y[lo:lo + micro])); engine.step()
        norms.append(engine.get_global_grad_norm())
    shared = [p.detach().float().clone() for p in model.shared.parameters()]
    expert = [p.detach().float().clone() for p in model.expert.parameters()]
    engine.close()
    return shared, expert, norms, len(tdist.distributed_c10d._world.pg_map) - groups_before

@pytest.mark.parametrize('world,ep_size', [(2, 2), (4, 2)])
def test_moe_matches_one_process_with_every_expert(world, ep_size):
    ref_shared, ref_experts, ref_norms = moe_reference(world, ep_size)
    assert max(ref_norms) > CLIP
    for rank, (shared, expert, norms, leaked_groups) in enumerate(run_distributed(moe_rank, world, args=(ep_size,))):
        for p, q in zip(shared, ref_shared): torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        for p, q in zip(expert, ref_experts[rank % ep_size]): torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=1e-6)
        assert leaked_groups == 0    # close() destroyed the expert groups it created

class AllExperts(nn.Module):
    "One process holding the shared layer and every expert; rank r's samples go through expert r % ep_size"
    def __init__(self, ep_size):
        super().__init__()
        self.shared = MoENet(0, 100, ep_size).shared
        self.experts = nn.ModuleList(MoENet(0, 100 + e, ep_size).expert for e in range(ep_size))
    def forward(self, x, rank): return self.experts[rank % len(self.experts)](torch.tanh(self.shared(x)))

def bf16_moe_reference(_rank, _world, world, ep_size, drop_step=None, reduce='boundary'):
    "tests/reference.py's bf16 run: each expert's gradient summed over the ranks that hold it, divided by the world size"
    from reference import reference16
    (X, Y), micro = data(), BATCH // world
    batches = [[[(X[s * BATCH + r * micro:][:micro], Y[s * BATCH + r * micro:][:micro], r)] for r in range(world)] for s in range(STEPS)]
    loss = lambda m, b: F.mse_loss(m(b[0].to(torch.bfloat16), b[2]).float(), b[1])
    return reference16(lambda: AllExperts(ep_size), batches, loss, lambda ps: torch.optim.SGD(ps, lr=LR), torch.bfloat16,
                       clip=CLIP, drop_step=drop_step, reduce=reduce)

def test_bf16_moe_matches_the_16bit_reference():
    """bf16 masters carry the expert marks: the global norm sums each expert once, and every weight is within one bf16
    ulp of the torch run with the same casts (2 ranks: each 16-bit sum is one rounding, whatever the algorithm)"""
    from reference import assert_ulps, assert_close16
    (ref,) = run_distributed(bf16_moe_reference, 1, args=(2, 2), init=False)
    (dropped,) = run_distributed(bf16_moe_reference, 1, args=(2, 2, STEPS - 1), init=False)
    n_shared = len(list(nn.Linear(6, 8).parameters()))
    ref_shared, ref_experts = ref['params'][:n_shared], [ref['params'][n_shared + 2 * e:][:2] for e in range(2)]
    assert max(ref['norms']) > CLIP
    for rank, (shared, expert, norms, _) in enumerate(run_distributed(moe_rank, 2, args=(2, True))):
        assert_ulps(norms, ref['norms'], msg='norms')
        assert_close16(shared, ref_shared, msg='shared weights')
        assert_close16(expert, ref_experts[rank], msg=f'expert {rank} weights')
        with pytest.raises(AssertionError):   # the same check sees a lost last step
            assert_close16(shared + expert, dropped['params'][:n_shared] + dropped['params'][n_shared + 2 * rank:][:2])

def expert_overflow_rank(rank, world):
    "fp16; step 2 puts inf only into rank 1's expert gradient, which no collective reduces: rank 0 must skip too"
    import flexrt
    engine, *_ = flexrt.initialize(model=MoENet(0, 100 + rank, 2), config=fp16_config())
    x = torch.randn(2, 6)
    train_step(engine, x)
    before, scale = snapshot(engine), engine.precision.loss_scale
    if rank == 1: hook = engine.module.expert.weight.register_hook(lambda g: torch.full_like(g, math.inf))
    train_step(engine, x)
    if rank == 1: hook.remove()
    unchanged = all(torch.equal(p, q) for p, q in zip(before, snapshot(engine)))
    out = unchanged, engine.precision.loss_scale / scale, engine.skipped_steps
    engine.close()
    return out

def test_overflow_in_one_ranks_expert_skips_everywhere():
    assert run_distributed(expert_overflow_rank, 2) == [(True, 0.5, 1), (True, 0.5, 1)]
