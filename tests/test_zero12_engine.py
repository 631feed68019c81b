"""ZeRO stages 1 and 2 through flexrt.initialize on real gloo ranks: the same losses, parameters, norms and counters as
plain torch on the whole batch (1, 2 and 4 ranks, with and without accumulation), bf16 and fp16 equal to the
16-bit torch reference (tests/reference.py) with identical replicas, no_sync, and engines closed and rebuilt with another stage in one process leaving no hooks, gradients,
process groups or memory behind."""
import gc, math
import pytest, torch, torch.nn.functional as F
from helpers import run_distributed
from test_engine import CONFIG, STEPS, BATCH, LR, make_model, make_data, reference, train_rank, low_rank, references, check_low

def zero(stage, **kw): return {'zero_optimization': {'stage': stage, 'reduce_bucket_size': 60, **kw}}

def stages_rank(rank, world):
    return {(stage, gas): train_rank(rank, world, gas, extra=zero(stage, overlap_comm=gas == 1))
            for stage in (1, 2) for gas in (1, 2)}

@pytest.fixture(scope='module')
def ref(): return reference()

@pytest.mark.parametrize('world', [1, 2, 4])
def test_engine_stages_1_2_match_single_process_reference(world, ref):
    ref_losses, ref_params, ref_norms = ref
    per_rank = run_distributed(stages_rank, world, timeout=150)
    for (stage, gas) in per_rank[0]:
        results = [r[stage, gas] for r in per_rank]
        losses = [sum(r[0][s] for r in results) / world for s in range(STEPS)]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        for _, params, norms, counters in results:
            for p, q in zip(params, ref_params): torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=1e-6)
            assert counters == (STEPS, STEPS * BATCH, STEPS * gas, 0, [LR * 0.25], False)   # not stage 0's flat-bucket norm

@pytest.mark.parametrize('prec', ['bf16', 'fp16'])
def test_engine_stages_1_2_16bit_match_the_16bit_reference(prec):
    "The same casts in the same order as tests/reference.py: weights within one 16-bit ulp, losses and norms to fp32 ulps"
    cases = [(1, prec), (2, prec)]
    per_rank, ref = run_distributed(low_rank, 2, args=(cases,)), references(cases)
    for c in cases: check_low([r[c] for r in per_rank], ref[c], prec)

def _alive_bytes():
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor): storages[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
    return sum(storages.values())

def rebuild_rank(rank, world):
    "Engines at stages 1, 2, 0, 2, 1 on one model in one process: nothing piles up"
    import flexrt, torch.distributed as tdist
    model, (X, Y) = make_model(), make_data()
    groups_before, alive, steps = len(tdist.distributed_c10d._world.pg_map), [], []
    for stage in (1, 2, 0, 2, 1):
        engine, *_ = flexrt.initialize(model=model, config={**CONFIG, 'gradient_accumulation_steps': 2, **zero(stage)})
        for k in range(4):
            engine.backward(F.mse_loss(engine(X[:2]), Y[:2])); engine.step()
        assert engine.optimizer.stage == stage
        engine.close()
        assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
        assert all(p.grad is None for p in model.parameters())
        steps.append(engine.global_steps)
        del engine; alive.append(_alive_bytes())
    return steps, alive, len(tdist.distributed_c10d._world.pg_map) - groups_before

def test_close_and_rebuild_with_another_stage_leaks_nothing():
    for steps, alive, new_groups in run_distributed(rebuild_rank, 2):
        assert steps == [2] * 5 and new_groups == 0
        assert alive[3] <= alive[1] + 1024 and alive[4] <= alive[0] + 1024, alive   # same stage again: no growth

def no_sync_rank(rank, world, stage):
    import flexrt
    from flexrt import comm
    X, Y = make_data()
    engine, *_ = flexrt.initialize(model=make_model(), config={**CONFIG, 'gradient_clipping': 0.0, 'comms_logger': {'enabled': True}, **zero(stage)})
    comm.reset_log()
    with engine.no_sync():
        for k in range(2): engine.backward(F.mse_loss(engine(X[rank * 4 + k:][:1]), Y[rank * 4 + k:][:1]) / 3)
    assert comm.get_comm_stats() == {}
    engine.backward(F.mse_loss(engine(X[rank * 4 + 2:][:1]), Y[rank * 4 + 2:][:1]) / 3)
    engine.step()
    ops = set(comm.get_comm_stats())
    engine.close()
    return ops

@pytest.mark.parametrize('stage', [1, 2])
def test_no_sync_accumulates_then_reduce_scatters(stage):
    for ops in run_distributed(no_sync_rank, 2, args=(stage,)):
        assert {'reduce_scatter_tensor_p2p', 'all_gather_into_tensor_p2p'} <= ops   # gloo: the direct-message forms

# ------------------------------------------------------------------ fp16 overflow and MoE through the engine
def fp16_rank(rank, world, stage):
    "Step 2 overflows on the last rank only: skipped everywhere, weights and schedule untouched, scale halved"
    import flexrt
    torch.manual_seed(0)
    config = {'train_batch_size': 4, 'steps_per_print': 1000, 'gradient_clipping': 1.0,
              'fp16': {'enabled': True, 'initial_scale_power': 8, 'hysteresis': 1},
              'optimizer': {'type': 'AdamW', 'params': {'lr': 0.01}}, **zero(stage, overlap_comm=True)}
    engine, *_ = flexrt.initialize(model=torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)), config=config)
    x, snaps, scales = torch.randn(2, 6).half(), [], []
    for step in range(3):
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss * math.inf if (step == 1 and rank == world - 1) else loss); engine.step()
        snaps.append([p.detach().clone() for p in engine.module.parameters()]); scales.append(engine.precision.loss_scale)
    skipped = engine.skipped_steps
    engine.close()
    same = lambda a, b: all(torch.equal(p, q) for p, q in zip(a, b))
    return same(snaps[0], snaps[1]), same(snaps[1], snaps[2]), scales, skipped

@pytest.mark.parametrize('stage', [1, 2])
def test_engine_fp16_overflow_on_one_rank_skips_everywhere(stage):
    for unchanged, then_unchanged, scales, skipped in run_distributed(fp16_rank, 2, args=(stage,)):
        assert unchanged and not then_unchanged and scales == [256., 128., 128.] and skipped == 1

def moe_engine_rank(rank, world, stage):
    import flexrt
    import torch.distributed as tdist
    from test_engine_fp16_moe import MoENet, data as moe_data, BATCH as B, STEPS as S, CLIP as C, LR as L
    groups_before = len(tdist.distributed_c10d._world.pg_map)
    model = MoENet(rank, 100 + rank, 2)
    engine, *_ = flexrt.initialize(model=model, config={'train_batch_size': B, 'gradient_clipping': C,
                                   'optimizer': {'type': 'SGD', 'params': {'lr': L}}, **zero(stage)})
    (X, Y), micro, norms = moe_data(), B // world, []
    for s in range(S):
        lo = s * B + rank * micro
        engine.backward(F.mse_loss(engine(X[lo:lo + micro]), Y[lo:lo + micro])); engine.step()
        norms.append(engine.get_global_grad_norm())
    expert_ranks = {bk.partition.world_size for bk in engine.optimizer.buckets if bk.is_expert}
    shared = [p.detach().clone() for p in model.shared.parameters()]
    expert = [p.detach().clone() for p in model.expert.parameters()]
    engine.close()
    return shared, expert, norms, expert_ranks, len(tdist.distributed_c10d._world.pg_map) - groups_before

@pytest.mark.parametrize('stage', [1, 2])
def test_engine_moe_experts_partitioned_match_one_process(stage):
    from test_engine_fp16_moe import moe_reference
    ref_shared, ref_experts, ref_norms = moe_reference(4, 2)
    for rank, (shared, expert, norms, expert_ranks, leaked) in enumerate(run_distributed(moe_engine_rank, 4, args=(stage,))):
        assert expert_ranks == {2} and leaked == 0
        for p, q in zip(shared, ref_shared): torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        for p, q in zip(expert, ref_experts[rank % 2]): torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=1e-6)

def breakdown_rank(rank, world, stage):
    "engine.memory_breakdown() after two steps, the tensor bytes the engine added to the process, and the state's scalars"
    import flexrt
    from flexrt.memory.tracker import TensorMemoryTracker
    X, Y = make_data()
    gc.collect()
    with TensorMemoryTracker(count_existing=True) as tracker: before = tracker.allocated_bytes
    extra = zero(stage, stage3_param_persistence_threshold=0) if stage else {}
    engine, *_ = flexrt.initialize(model=make_model(), config={**CONFIG, 'scheduler': None, **extra})
    for s in range(2):
        engine.backward(F.mse_loss(engine(X[s * 8 + rank * 4:][:4]), Y[s * 8 + rank * 4:][:4])); engine.step()
    mem = engine.memory_breakdown()
    gc.collect()
    with TensorMemoryTracker(count_existing=True) as tracker: alive = tracker.allocated_bytes - before
    scalars = sum(t.nbytes for s in engine.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() == 0)
    slot = engine.optimizer
    spares = sum(t.nbytes for t in getattr(getattr(slot, 'reducer', None), 'spare_buffers', []))   # stage 2's bucket buffers, kept
    bound = 2 * 4 * max((bk.partition.padded_numel + bk.partition.shard_numel for bk in getattr(slot, 'buckets', [])), default=0)
    engine.close()
    return mem, alive, scalars, spares, bound

@pytest.mark.parametrize('stage', [0, 1, 2, 3])
def test_engine_memory_breakdown_matches_the_zero_model(stage):
    "fp32 AdamW (K = 8): the paper's bytes per rank for each stage, within padding, and every byte the engine keeps alive"
    world, model = 2, make_model()
    psi, tensors = sum(p.numel() for p in model.parameters()), len(list(model.parameters()))
    expected = {'params': 4 * psi / (world if stage == 3 else 1), 'grads': 4 * psi / (world if stage >= 2 else 1),
                'optimizer_state': 8 * psi / (world if stage >= 1 else 1)}
    slack = 4 * world * tensors + 4 * tensors   # padding (< N elements per bucket or parameter) + Adam's step counters
    for mem, alive, scalars, spares, bound in run_distributed(breakdown_rank, world, args=(stage,)):
        assert (0 < spares <= bound) if stage == 2 else spares == 0   # stage 2 keeps at most two bucket buffers (largest bucket + chunk)
        for key, value in {**expected, 'grads': expected['grads'] + spares}.items(): assert value <= mem[key] <= value + slack, (stage, key, mem, expected)
        assert mem['total'] == mem['params'] + mem['grads'] + mem['optimizer_state']
        counted = mem['total'] if stage < 3 else mem['total'] + scalars   # stage 3 leaves the 0-d step counters out
        assert alive == counted, (stage, alive, mem)
