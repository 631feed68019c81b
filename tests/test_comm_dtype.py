"""`communication_data_type` (gradients reduced in fp16/bf16/fp32) at ZeRO stages 0-3 on real 2- and 3-rank gloo groups.

On a small fixed regression task (an MLP, AdamW, 100 steps, every rank its slice of each batch):
- an fp16 or bf16 wire ends within a documented tolerance of the fp32-wire loss (`TOLERANCE`);
- an fp32 wire is the existing path, bit for bit (losses and weights `torch.equal` to a run without the key);
- the comms logger shows half the gradient bytes (every gradient message of a 16-bit wire is half its fp32 size);
- a checkpoint saved with a bf16 wire loads exactly into an fp32-wire run and back (quantisation is on the wire only);
- `gradient_predivide_factor` / `prescale_gradients` divide before the wire at every stage (an fp16 sum that would
  overflow stays finite with `prescale_gradients`);
- a DeepSpeed config with `communication_data_type` builds the wire and warns no "no effect" (this one needs the
  engine to pass the key to `SlotArgs`: see `test_config_key_reaches_every_stage_without_warning`).

The data-path tests hand the wire to the slot through `optimizer_slot=` (a `SlotArgs` with `communication_data_type`
set), so they test the zero wing alone."""
import dataclasses, math, warnings
import pytest, torch, torch.nn as nn, torch.nn.functional as F
from helpers import run_distributed, train_on_slices

STEPS, BATCH, LR = 100, 12, 5e-3  # 12: 6 rows per rank on 2 ranks, 4 on 3
# |final loss (16-bit wire) - final loss (fp32 wire)| / final loss (fp32 wire), mean over the last 10 steps, at most:
# measured on this task (2 and 3 ranks, stages 0-3, fp32 final loss 0.010-0.012 from 0.18): bf16 0.03-0.07 %,
# fp16 at most 0.003 %; the bounds leave more than 10x room
TOLERANCE = {'fp16': 0.002, 'bf16': 0.01}
GRADIENT_OPS = ('all_reduce', 'reduce_scatter_tensor', 'reduce_scatter_tensor_p2p', 'reduce_scatter_via_all_reduce')


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 2))


def make_data():
    "A fixed task: y = sin of a fixed linear map of x (learnt to about 1/20 of the first loss in 100 steps)"
    g = torch.Generator().manual_seed(7)
    x = torch.randn(STEPS * BATCH, 8, generator=g)
    return x, torch.sin(x @ torch.randn(8, 2, generator=g) / 8**0.5)


def config(stage, world, **extra):
    return {'train_batch_size': BATCH, 'train_micro_batch_size_per_gpu': BATCH // world, 'gradient_clipping': 1.0,
            'steps_per_print': 10 ** 6, 'optimizer': {'type': 'AdamW', 'params': {'lr': LR}},
            'zero_optimization': {'stage': stage, 'reduce_bucket_size': 400, 'stage3_param_persistence_threshold': 0},
            **extra}


def with_wire(wire):
    "An `optimizer_slot` builder: the stage's own slot, its gradients reduced in `wire`"
    from flexrt.zero.slots import build_optimizer_slot
    return lambda args: build_optimizer_slot(dataclasses.replace(args, communication_data_type=wire))


def build(rank, world, stage, wire, **extra):
    import flexrt
    engine, *_ = flexrt.initialize(model=make_model(), config=config(stage, world, **extra),
                                   optimizer_slot=with_wire(wire))
    return engine


def train(engine, rank, world, steps=STEPS, start=0):
    "This rank's slice of every batch: its losses"
    return train_on_slices(engine, make_data(), BATCH, rank, world, steps, start)


def gradient_bytes():
    "{(op, message bytes): count} of the gradient reductions the comms logger saw (scalars left out)"
    from flexrt import comm
    stats = comm.get_comm_stats()
    return {(op, size): v['count'] for op in GRADIENT_OPS for size, v in stats.get(op, {}).items() if size > 16}


# ---------------------------------------------------------------- training: tolerance, bit-exactness, bytes
def wires_rank(rank, world, stage):
    "Every wire at one stage: losses, final weights and the gradient messages of 3 logged steps"
    from flexrt import comm
    out = {}
    for wire in (None, 'fp32', 'fp16', 'bf16'):
        engine = build(rank, world, stage, wire)
        losses = train(engine, rank, world)
        comm.configure(enabled=True)
        comm.reset_log()
        train(engine, rank, world, steps=3)
        sizes = gradient_bytes()
        comm.configure(enabled=False)
        weights = engine.module_state_dict()
        wire_of = (engine.optimizer.partitioner.grads.wire if stage == 3 else engine.optimizer.reducer.wire).dtype
        engine.close()
        out[wire] = losses, weights, sizes, wire_of
    return out


def tail(losses):
    "The mean of the last 10 losses"
    return sum(losses[-10:]) / 10


# each stage once; 2 ranks take the reduce-scatter's two-rank path (a peer's part received straight into the output)
@pytest.mark.parametrize('stage,world', [(0, 3), (1, 2), (2, 3), (3, 2)])
def test_wire_dtype_trains_close_to_fp32_and_halves_the_bytes(stage, world):
    for got in run_distributed(wires_rank, world, args=(stage,), timeout=120):
        plain, fp32 = got[None], got['fp32']
        assert plain[0] == fp32[0]  # the fp32 wire is the existing path: the same losses, bit for bit
        assert all(torch.equal(plain[1][k], fp32[1][k]) for k in plain[1])
        assert plain[2] == fp32[2] and plain[2]  # and the same messages
        assert (plain[3], fp32[3]) == (None, torch.float32)
        assert tail(fp32[0]) < 0.5 * sum(fp32[0][:10]) / 10  # the task is learnt
        for wire, dtype in (('fp16', torch.float16), ('bf16', torch.bfloat16)):
            losses, _, sizes, wire_of = got[wire]
            assert wire_of == dtype
            assert all(map(math.isfinite, losses))
            gap = abs(tail(losses) - tail(fp32[0])) / tail(fp32[0])
            assert gap <= TOLERANCE[wire], (wire, gap)
            assert losses != fp32[0]  # the wire did round something
            # every gradient message of the 16-bit wire is half its fp32 size, as many of them
            assert sizes == {(op, size // 2): n for (op, size), n in fp32[2].items()}, (sizes, fp32[2])


# ---------------------------------------------------------------- checkpoints: exact across wires
def checkpoint_rank(rank, world, stage, saved_wire, loaded_wire, path):
    "Train with `saved_wire`, save; load into a `loaded_wire` engine: the same weights and masters, training goes on"
    first = build(rank, world, stage, saved_wire)
    train(first, rank, world, steps=20)
    first.save_checkpoint(path, tag='t')
    weights = first.module_state_dict()
    masters = [f.master.detach().clone() for f in first.optimizer.fragments()]
    first.close()
    second = build(rank, world, stage, loaded_wire)
    second.load_checkpoint(path, tag='t')
    loaded = second.module_state_dict()
    same_masters = all(torch.equal(a, f.master) for a, f in zip(masters, second.optimizer.fragments()))
    more = train(second, rank, world, steps=5, start=20)
    second.close()
    return all(torch.equal(weights[k], loaded[k]) for k in weights), same_masters, more


@pytest.mark.parametrize('stage', [0, 1, 2, 3])
def test_checkpoints_load_across_wires(stage, tmp_path):
    for saved, loaded in (('bf16', 'fp32'), ('fp32', 'bf16')):
        path = str(tmp_path / f'{saved}-{loaded}')
        for same_weights, same_masters, more in run_distributed(checkpoint_rank, 2, args=(stage, saved, loaded, path)):
            assert same_weights and same_masters, (saved, loaded)
            assert all(map(math.isfinite, more))


# ---------------------------------------------------------------- predivision happens before the wire
def overflow_rank(rank, world, stage, extras):
    """One step whose gradient sum is above fp16's range (65504) unless it is divided before the fp16 wire: every rank
    sees the same rows, each gradient's largest element is 5e4, the sum over 3 ranks 1.5e5 (stage 1 adds its own chunk
    in fp32, after the wire: the other 2 ranks' sum, 1e5, is what overflows there)"""
    X, Y = make_data()
    probe = make_model()
    F.mse_loss(probe(X[:4]), Y[:4]).backward()
    scale = 5e4 / max(float(p.grad.abs().max()) for p in probe.parameters())
    finite = []
    for extra in extras:   # one launch, one engine after the other
        engine = build(rank, world, stage, 'fp16', gradient_clipping=0.0, **extra)
        engine.backward(F.mse_loss(engine(X[:4]), Y[:4]) * scale)
        finite.append(all(bool(torch.isfinite(g).all()) for g in engine.optimizer.reduced_gradients()))
        engine.close()
    return finite


@pytest.mark.parametrize('stage', [0, 1, 2, 3])
def test_prescale_gradients_divides_before_the_wire(stage):
    # each rank checks its own gradients (its shard at stages 1-3): the overflow shows on some rank
    extras = ({}, {'prescale_gradients': True}, {'gradient_predivide_factor': 3.0})
    plain, prescaled, predivided = zip(*run_distributed(overflow_rank, 3, args=(stage, extras)))   # by setting
    assert not all(plain) and all(prescaled) and all(predivided), (plain, prescaled, predivided)


# ---------------------------------------------------------------- the config key, as DeepSpeed spells it
def config_rank(rank, world):
    import flexrt
    out = []
    for stage in range(4):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            engine, *_ = flexrt.initialize(model=make_model(),
                                           config=config(stage, world, communication_data_type='bf16'))
        slot = engine.optimizer
        wire = (slot.partitioner.grads.wire if stage == 3 else slot.reducer.wire).dtype
        train(engine, rank, world, steps=2)
        engine.close()
        out.append((wire, [str(w.message) for w in caught if 'communication_data_type' in str(w.message)]))
    return out


def test_config_key_reaches_every_stage_without_warning():
    "The key as DeepSpeed spells it reaches every stage's reducer, and no 'no effect' warning is given"
    for per_stage in run_distributed(config_rank, 2):
        assert per_stage == [(torch.bfloat16, [])] * 4, per_stage
