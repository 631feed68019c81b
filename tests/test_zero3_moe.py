"""MoE expert parameters at ZeRO stage 3: partitioned over their expert data-parallel group, reduced there and divided
as stage 0 divides them, counted once in the global norm. An engine at stage 3 trains exactly like stage 0 and like
one process holding every expert (the model and reference of test_engine_fp16_moe)."""
import pytest, torch, torch.nn as nn, torch.nn.functional as F
from helpers import run_distributed
from test_engine_fp16_moe import MoENet, moe_reference, bf16_moe_reference, data, LR, STEPS, BATCH, CLIP

def moe_rank(rank, world, ep_size, stage, dtype='fp32', gas=1, threshold=0):
    import flexrt
    from flexrt.zero.stage3.gathered import GatheredParameters
    model = MoENet(rank, 100 + rank, ep_size)      # the engine's broadcasts make each group's replicas equal
    cfg = {'train_batch_size': BATCH, 'train_micro_batch_size_per_gpu': BATCH // world // gas, 'gradient_clipping': CLIP,
           'optimizer': {'type': 'SGD', 'params': {'lr': LR}}, 'bf16': {'enabled': dtype == 'bf16'}, 'steps_per_print': 1000,
           'zero_optimization': {'stage': stage, 'stage3_param_persistence_threshold': threshold}}
    engine, *_ = flexrt.initialize(model=model, config=cfg)
    (X, Y), micro, losses, norms = data(), BATCH // world // gas, [], []
    for s in range(STEPS):
        for m in range(gas):
            lo = s * BATCH + rank * (BATCH // world) + m * micro
            out = engine(X[lo:lo + micro].to(engine.precision.dtype)).float()
            loss = F.mse_loss(out, Y[lo:lo + micro])
            engine.backward(loss); engine.step(); losses.append(loss.item())
        norms.append(engine.get_global_grad_norm())
    shards = {}
    if stage == 3:   # each expert parameter is split over its expert data-parallel group: world // ep_size ranks
        shards = {r.name: (r.world_size, r.shard_numel) for r in engine.optimizer.partitioner.records.values()}
    with GatheredParameters(model.parameters()):
        shared = [p.detach().float().clone() for p in model.shared.parameters()]
        expert = [p.detach().float().clone() for p in model.expert.parameters()]
    engine.close()
    return losses, shared, expert, norms, shards

@pytest.mark.parametrize('world,ep_size,gas,threshold', [(4, 2, 1, 0), (4, 2, 2, 10), (2, 2, 1, 0)])
def test_fp32_moe_stage3_matches_stage0_and_one_process(world, ep_size, gas, threshold):
    ref_shared, ref_experts, ref_norms = moe_reference(world, ep_size)
    stage0 = run_distributed(moe_rank, world, args=(ep_size, 0, 'fp32', gas, threshold))
    stage3 = run_distributed(moe_rank, world, args=(ep_size, 3, 'fp32', gas, threshold))
    for rank, (a, b) in enumerate(zip(stage0, stage3)):
        torch.testing.assert_close(torch.tensor(b[0]), torch.tensor(a[0]), rtol=1e-5, atol=1e-6)   # losses
        torch.testing.assert_close(torch.tensor(b[3]), torch.tensor(a[3]), rtol=1e-5, atol=1e-6)   # global norms
        for p, q in zip(b[1] + b[2], a[1] + a[2]): torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        if gas == 1:
            for p, q in zip(b[1], ref_shared): torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
            for p, q in zip(b[2], ref_experts[rank % ep_size]): torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(torch.tensor(b[3]), torch.tensor(ref_norms), rtol=1e-5, atol=1e-6)
        shards = b[4]
        assert shards['expert.weight'] == (world // ep_size, -(-8 * 3 // (world // ep_size)))
        assert shards['shared.weight'] == (world, -(-6 * 8 // world))
    assert max(ref_norms) > CLIP   # clipping acted

def test_bf16_moe_stage3_matches_stage0_and_the_16bit_reference():
    """bf16 on 2 ranks (each 16-bit sum one rounding): stage 3 equals stage 0 and tests/reference.py's run with the same
    casts, weights within one bf16 ulp, losses and norms to fp32 ulps; the same check sees a lost last step"""
    from reference import assert_ulps, assert_close16
    (ref,) = run_distributed(bf16_moe_reference, 1, args=(2, 2, None, 'micro'), init=False)
    (dropped,) = run_distributed(bf16_moe_reference, 1, args=(2, 2, STEPS - 1, 'micro'), init=False)
    stage0, stage3 = run_distributed(moe_rank, 2, args=(2, 0, 'bf16')), run_distributed(moe_rank, 2, args=(2, 3, 'bf16'))
    for rank, (a, b) in enumerate(zip(stage0, stage3)):
        want = ref['params'][:2] + ref['params'][2 + 2 * rank:][:2]   # shared, then this rank's expert
        assert_ulps(b[0], [step[rank][0] for step in ref['micro_losses']], msg='losses')
        assert_ulps(b[0], a[0], msg='losses vs stage 0')
        assert_ulps(b[3], ref['norms'], msg='norms'); assert_ulps(b[3], a[3], msg='norms vs stage 0')
        assert_close16(b[1] + b[2], want, msg='weights'); assert_close16(b[1] + b[2], a[1] + a[2], msg='weights vs stage 0')
        with pytest.raises(AssertionError):
            assert_close16(b[1] + b[2], dropped['params'][:2] + dropped['params'][2 + 2 * rank:][:2])

def missing_groups_rank(rank, world):
    from flexrt.precision import Precision
    from flexrt.zero.stage3 import Stage3Optimizer
    model = MoENet(0, 100, 2)
    try: Stage3Optimizer(model, torch.optim.SGD(model.parameters(), lr=LR), Precision.fp32())
    except ValueError as e: return str(e)

def test_expert_parameters_without_expert_groups_is_an_error():
    for message in run_distributed(missing_groups_rank, 2): assert 'expert_groups' in message
