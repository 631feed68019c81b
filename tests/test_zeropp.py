"""ZeRO++ on CPU/gloo: quantised weights (qwZ, `zero_quantized_weights`), quantised gradients (qgZ,
`zero_quantized_gradients`) and the hierarchical partition (hpZ, `zero_hpz_partition_size`), on real 2-, 3- and
4-rank gloo groups (`flexrt.zero.quantize`, `flexrt.zero.stage3`).

- a quantised gather is within the stated bound of the exact one, block by block (`max|block| / 254` in int8), and the
  quantised reduce-scatter within the sum of the peers' bounds; everything that must be exact stays exact
  (`GatheredParameters` after a quantised gather, the engine's state dict);
- with qwZ alone and gradients that do not depend on the weights, the fp32 masters are bit for bit the unquantised
  run's (only the copy forward computes with is rounded);
- each key on vs off: the same model trained `STEPS` steps on a fixed task ends within `TOLERANCE` of the unquantised
  loss, with the bytes on the wire (the comms logger's) about a quarter of the exact run's;
- hpZ (`zero_hpz_partition_size`, 4 ranks in 2 groups of 2): backward gathers from the secondary pieces within the
  group and trains bit for bit as without it (the pieces hold the values forward used); k = world keeps nothing;
- a non-finite gradient stays visible through qgZ, confined to its block;
- checkpoints load across quantised and unquantised runs (quantisation is on the wire only);
- the autotuner's lossy candidates (`Candidate.to_config` of its `lossy_variants`: stage 3 with qwZ + qgZ, stage 0
  with the bf16 wire) build and train with the keys in effect, none ignored;
- a DeepSpeed config with the keys runs through `python -m flexrt.deepspeed` without a "no effect" warning."""
import json, math, os, subprocess, sys
from pathlib import Path
import pytest, torch, torch.nn as nn, torch.nn.functional as F
from helpers import run_distributed, run_torchrun, free_port, train_on_slices

ROOT = Path(__file__).resolve().parent.parent
STEPS, BATCH, LR = 100, 12, 5e-3  # 12: 6 rows per rank on 2 ranks, 4 on 3
KEYS = {
    'qwZ': {'zero_quantized_weights': True},
    'qgZ': {'zero_quantized_gradients': True},
    'qwZ+qgZ': {'zero_quantized_weights': True, 'zero_quantized_gradients': True},
}
# |final loss (quantised) - final loss (exact)| / final loss (exact), means over the last 10 steps, at most: measured on
# this task (100 steps, the loss from about 0.37 to 0.02-0.05 on each rank's slice; 2 and 3 ranks, stages 1-3) qwZ
# 0.1-0.2 %, qgZ 0.0-0.1 %, both 0.05-0.6 % (200 steps: at most 1.5 %); the bound leaves more than 3x room
TOLERANCE = {'qwZ': 0.05, 'qgZ': 0.05, 'qwZ+qgZ': 0.05}
GATHER_OPS = ('all_gather_into_tensor', 'all_gather_into_tensor_p2p')
GRADIENT_OPS = ('reduce_scatter_tensor', 'reduce_scatter_tensor_p2p', 'reduce_scatter_via_all_reduce',
                'all_to_all_single')


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2))


def make_data():
    "A fixed task: y = sin of a fixed linear map of x"
    g = torch.Generator().manual_seed(7)
    x = torch.randn(STEPS * BATCH, 16, generator=g)
    return x, torch.sin(x @ torch.randn(16, 2, generator=g) / 16**0.5)


def config(stage, world, keys=(), **extra):
    zero = {'stage': stage, 'reduce_bucket_size': 3000, 'stage3_param_persistence_threshold': 0}
    return {'train_batch_size': BATCH, 'train_micro_batch_size_per_gpu': BATCH // world, 'gradient_clipping': 1.0,
            'steps_per_print': 10 ** 6, 'optimizer': {'type': 'AdamW', 'params': {'lr': LR}},
            'zero_optimization': zero | dict(keys), **extra}


def build(stage, world, keys=(), model=None, **extra):
    import flexrt
    engine, *_ = flexrt.initialize(model=make_model() if model is None else model,
                                   config=config(stage, world, keys, **extra))
    return engine


def train(engine, rank, world, steps=STEPS, start=0):
    "This rank's slice of every batch: its losses"
    return train_on_slices(engine, make_data(), BATCH, rank, world, steps, start)


def tail(losses):
    return sum(losses[-10:]) / 10


def logged_bytes(ops) -> int:
    "Bytes of the messages of `ops` the comms logger saw (scalars left out)"
    from flexrt import comm
    stats = comm.get_comm_stats()
    return sum(size * v['count'] for op in ops for size, v in stats.get(op, {}).items() if size > 16)


def peer_bound(bound_rows, rank):
    "Per element of this rank's chunk: the sum of the peers' bounds (each row of `bound_rows` is one rank's)"
    return sum(b for j, b in enumerate(bound_rows) if j != rank)


# ---------------------------------------------------------------- bounds: gathers and the reduce-scatter
def bounds_rank(rank, world):
    from flexrt import comm
    from flexrt.zero import GatheredParameters
    from flexrt.zero.stage3 import gather_records, release_records
    from flexrt.zero.quantize import BlockQuantizer, QuantizedReduceScatter
    engine = build(3, world, KEYS['qwZ'])
    train(engine, rank, world, steps=5)  # weights away from their initial values
    part = engine.optimizer.partitioner
    q, gathers = part.weight_quantizer, []
    for p, r in part.records.items():
        gather_records([r])  # exact
        exact = p.data.clone()
        release_records([r])
        gather_records([r], quantizer=q)
        got, lossy = p.data.clone(), r.lossy
        with GatheredParameters([p]):  # whole from the quantised gather: gathered again, exactly
            again = p.data.clone()
        release_records([r])
        # each rank quantised its own shard in blocks of 256: the bound of each element is its block's
        rows = F.pad(exact.reshape(-1), (0, r.shard_numel * world - r.numel)).view(world, -1)
        bound = q.bound(rows).repeat_interleave(q.block_size, dim=1)[:, : r.shard_numel].reshape(-1)[: r.numel]
        gathers.append((r.name, lossy, (got - exact).abs().reshape(-1), bound, torch.equal(again, exact)))
    # what forward computes with (chunks of several parameters, gathered quantised)
    seen = {}

    def look(m, args):
        seen[m] = m.weight.data.clone(), m.weight._zero3[1].lossy

    hooks = [m.register_forward_pre_hook(look) for m in engine.module if isinstance(m, nn.Linear)]
    engine(make_data()[0][:4])
    for h in hooks:
        h.remove()
    # a block of a chunk's gather may hold values of several parameters: the bound is the model's largest / 254
    with GatheredParameters(list(engine.module.parameters())):
        largest = max(float(p.abs().max()) for p in engine.module.parameters())
        exact = {m: m.weight.data.clone() for m in seen}
    forward = [(lossy, float((w - exact[m]).abs().max()), largest / 254) for m, (w, lossy) in seen.items()]
    engine.close()
    # the quantised reduce-scatter: every rank's rows are known to all (seeded), so the exact sum is computed here
    sums = []
    for bits in (8, 4):
        seeded = lambda j: torch.Generator().manual_seed(j)
        rows = [torch.randn(world, 700, generator=seeded(j)) * 10.0 ** (j - 1) for j in range(world)]
        got = QuantizedReduceScatter(rows[rank].clone(), quantizer=BlockQuantizer(bits)).wait()
        exact = sum(r[rank].double() for r in rows).float()
        bound = peer_bound([BlockQuantizer(bits).bound(r[rank]).repeat_interleave(256)[:700] for r in rows], rank)
        out = torch.empty(700)
        comm.reduce_scatter_tensor(out, rows[rank].reshape(-1).clone())
        sums.append((bits, (got - exact).abs(), bound, float((out - exact).abs().max())))
    return gathers, forward, sums


@pytest.mark.parametrize('world', [2, 3])
def test_quantised_gathers_and_reduce_scatter_within_the_bound(world):
    for gathers, forward, sums in run_distributed(bounds_rank, world, timeout=120):
        assert len(gathers) == 6
        for name, lossy, err, bound, exact_again in gathers:
            assert lossy and exact_again, name
            assert (err <= bound).all(), (name, float((err / bound).max()))
            # the gather did round (a shard of one value is its block's largest: exact)
            assert err.max() > 0 or err.numel() <= world, name
        assert len(forward) == 3
        for lossy, err, bound in forward:
            assert lossy and 0 < err <= bound * (1 + 2**-20), (err, bound)
        for bits, err, bound, native in sums:
            assert (err <= bound + 1e-6).all(), (bits, float((err - bound).max()))
            assert err.max() > native, bits  # quantised: further from the exact sum than the native reduce-scatter


# ---------------------------------------------------------------- qwZ alone: exact masters
def linear_model():
    torch.manual_seed(1)
    return nn.Linear(300, 100, bias=False)


def equal_gradients_rank(rank, world):
    """Loss = <y, c>: the weight's gradient is c^T x whatever the weight, so qwZ changes what forward computes but not
    the gradients: the masters must follow exactly"""
    x = torch.randn(8, 300, generator=torch.Generator().manual_seed(3 + rank))
    c = torch.randn(8, 100, generator=torch.Generator().manual_seed(5))
    out = {}
    for name, keys in (('exact', {}), ('qwZ', KEYS['qwZ'])):
        engine = build(3, world, keys, model=linear_model(), gradient_clipping=0.0)
        outputs = []
        for _ in range(5):
            y = engine(x)
            outputs.append(y.detach().clone())
            engine.backward((y * c).sum())
            engine.step()
        masters = [f.master.detach().clone() for f in engine.optimizer.fragments()]
        out[name] = masters, outputs, engine.module_state_dict()
        engine.close()
    return out


def test_qwz_master_weights_equal_the_unquantised_run():
    for got in run_distributed(equal_gradients_rank, 2):
        (m0, y0, s0), (m1, y1, s1) = got['exact'], got['qwZ']
        assert all(torch.equal(a, b) for a, b in zip(m0, m1))  # the update is exact
        assert s0.keys() == s1.keys() and all(torch.equal(s0[k], s1[k]) for k in s0)  # so is the state dict
        assert all(not torch.equal(a, b) for a, b in zip(y0, y1))  # forward computed with quantised weights
        # each output sums 300 products of a weight (error <= max|w| / 254) and an input
        bound = 300 * float(s0['weight'].abs().max()) / 254 * 5.0
        assert all(float((a - b).abs().max()) < bound for a, b in zip(y0, y1))


# ---------------------------------------------------------------- each key on vs off: training and bytes
def training_rank(rank, world, runs):
    from flexrt import comm
    out = {}
    for stage, name in runs:
        engine = build(stage, world, KEYS.get(name, {}))
        losses = train(engine, rank, world)
        comm.configure(enabled=True)
        comm.reset_log()
        train(engine, rank, world, steps=3)
        sent = logged_bytes(GATHER_OPS), logged_bytes(GRADIENT_OPS)
        comm.configure(enabled=False)
        engine.close()
        out[stage, name] = losses, sent
    return out


# every key at stage 3 on 2 ranks, both together on 3; qgZ at stages 1 and 2 (one launch per world size)
RUNS = {2: [(3, 'exact'), (3, 'qwZ'), (3, 'qgZ'), (3, 'qwZ+qgZ'), (2, 'exact'), (2, 'qgZ')],
        3: [(3, 'exact'), (3, 'qwZ+qgZ'), (1, 'exact'), (1, 'qgZ')]}


@pytest.mark.parametrize('world', [2, 3])
def test_each_key_trains_close_to_unquantised_with_fewer_bytes(world):
    for got in run_distributed(training_rank, world, args=(RUNS[world],), timeout=150):
        for stage, name in RUNS[world]:
            exact, (gathered, reduced) = got[stage, 'exact']
            if name == 'exact':
                assert tail(exact) < 0.25 * sum(exact[:10]) / 10  # the task is learnt
                continue
            losses, (g, r) = got[stage, name]
            assert all(map(math.isfinite, losses)) and losses != exact, name
            gap = abs(tail(losses) - tail(exact)) / tail(exact)
            print(f'stage {stage}, {world} ranks, {name}: loss {tail(losses):.5f} vs {tail(exact):.5f} ({gap:.2%}), '
                  f'bytes gathered {g / max(gathered, 1):.3f}, reduced {r / reduced:.3f} of exact')
            assert gap <= TOLERANCE[name], (stage, name, gap)
            # int8 and a scale per 256 values: 0.254 of fp32, more where small shards pad their last block
            if 'qwZ' in name:
                assert g < 0.35 * gathered, (stage, name, g, gathered)
            if 'qgZ' in name:
                assert r < 0.35 * reduced, (stage, name, r, reduced)


# ---------------------------------------------------------------- hpZ: 4 ranks, 2 groups of 2
def hpz_rank(rank, world):
    """Backward gathers every parameter (`stage3_max_reuse_distance: 0` keeps none from forward); with hpZ it gathers
    the forward's values from the secondary pieces within the group: the same values, so the same training"""
    from torch.distributed.distributed_c10d import _world
    out, groups = {}, len(_world.pg_map)
    for name, keys in (('exact', {}), ('hpZ', {'zero_hpz_partition_size': 2}),
                       ('hpZ+qwZ', {'zero_hpz_partition_size': 2, 'zero_quantized_weights': True})):
        engine = build(3, world, keys | {'stage3_max_reuse_distance': 0})
        hpz = engine.optimizer.partitioner.hpz
        made = len(_world.pg_map) - groups
        losses = train(engine, rank, world, steps=20)
        masters = [f.master.detach().clone() for f in engine.optimizer.fragments()]
        engine.close()
        # hpZ's group (this rank's of the 2 made) is destroyed with the engine: none piles up over many engines
        out[name] = losses, masters, None if hpz is None else (hpz.size, hpz.rank, hpz.num_gathers, made,
                                                                 len(_world.pg_map) - groups)
    engine = build(3, world, {'zero_hpz_partition_size': world})  # one group of every rank: nothing to keep
    out['k = world'] = engine.optimizer.partitioner.hpz
    engine.close()
    return out


def test_hpz_backward_gathers_within_the_group_and_trains_the_same():
    for rank, got in enumerate(run_distributed(hpz_rank, 4, timeout=150)):
        exact, hpz, both = got['exact'], got['hpZ'], got['hpZ+qwZ']
        assert exact[2] is None and got['k = world'] is None
        size, group_rank, gathers, made, left = hpz[2]
        assert (size, group_rank) == (2, rank % 2) and gathers >= 20  # a backward gather (or more) every step
        assert (made, left) == (1, 0) and both[2][3:] == (1, 0)
        assert hpz[0] == exact[0] and all(torch.equal(a, b) for a, b in zip(hpz[1], exact[1]))  # bit for bit
        assert both[2][2] >= 20 and both[0] != exact[0]
        assert abs(tail(both[0]) - tail(exact[0])) / tail(exact[0]) <= TOLERANCE['qwZ']


# ---------------------------------------------------------------- checkpoints; a non-finite gradient through qgZ
def checkpoint_rank(rank, world, path):
    "Save from one setting, load into the other (both ways): the same weights and masters; training goes on"
    out = []
    for saved, loaded in (('qwZ+qgZ', 'exact'), ('exact', 'qwZ+qgZ')):
        first = build(3, world, KEYS.get(saved, {}))
        train(first, rank, world, steps=10)
        first.save_checkpoint(path, tag=saved)
        weights = first.module_state_dict()
        masters = [f.master.detach().clone() for f in first.optimizer.fragments()]
        first.close()
        second = build(3, world, KEYS.get(loaded, {}))
        second.load_checkpoint(path, tag=saved)
        loaded_weights = second.module_state_dict()
        same_masters = all(torch.equal(a, f.master) for a, f in zip(masters, second.optimizer.fragments()))
        more = train(second, rank, world, steps=5, start=10)
        second.close()
        out.append((all(torch.equal(weights[k], loaded_weights[k]) for k in weights), same_masters, more))
    return out, nonfinite_gradient(rank, world)


def nonfinite_gradient(rank, world):
    """One backward at stage 3 with qgZ where the last rank's gradient of the first weight element is inf: that element
    belongs to rank 0, which receives it quantised; the block it is in comes back non-finite, the rest finite"""
    engine = build(3, world, KEYS['qgZ'])
    weight = engine.module[0].weight
    if rank == world - 1:
        weight.register_hook(lambda g: g.index_put((torch.tensor(0), torch.tensor(0)), torch.tensor(float('inf'))))
    X, Y = make_data()
    engine.backward(F.mse_loss(engine(X[:4]), Y[:4]))
    shards = [r.grad_shard for r in engine.optimizer.partitioner.records.values()]
    bad = sum(int((~torch.isfinite(g)).sum()) for g in shards)  # the block may span the ends of two parameters
    element = not bool(torch.isfinite(weight._zero3[1].grad_shard[0]))
    engine.close()
    return bad, element


def test_checkpoints_load_across_quantised_and_unquantised_runs(tmp_path):
    results = run_distributed(checkpoint_rank, 2, args=(str(tmp_path),), timeout=120)
    for rank, (loads, (bad, element)) in enumerate(results):
        for same_weights, same_masters, more in loads:
            assert same_weights and same_masters and all(map(math.isfinite, more))
        # rank 0 owns the element: its block (256 values, the element among them) is non-finite, nothing else
        assert (element and 1 <= bad <= 256) if rank == 0 else (not element and bad == 0), (rank, element, bad)


# ---------------------------------------------------------------- the autotuner's lossy candidates
def lossy_candidates_rank(rank, world):
    """The configs of the autotuner's lossy variants (`Candidate.to_config`) as `flexrt.initialize` gets them: stage 3
    with qwZ + qgZ (persistence 0: every parameter gathered), stage 0 with the bf16 wire; 3 steps each"""
    import warnings, flexrt
    from flexrt.autotuner.space import Candidate, lossy_variants
    out = {}
    for point in (Candidate(3, BATCH // world, stage3_param_persistence_threshold=0), Candidate(0, BATCH // world)):
        c = lossy_variants(point)[0]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            engine, *_ = flexrt.initialize(model=make_model(), config=c.to_config(config(0, world), world))
            losses = train(engine, rank, world, steps=3)
        slot = engine.optimizer
        wire = (slot.partitioner.weight_quantizer.bits, slot.partitioner.grads.quantizer.bits) if c.stage == 3 \
            else str(slot.reducer.wire.dtype)
        out[c.name] = losses, wire, [str(w.message) for w in caught if 'no effect' in str(w.message)]
        engine.close()
    return out


def test_the_autotuners_lossy_candidates_run_as_named():
    for got in run_distributed(lossy_candidates_rank, 2, timeout=120):
        assert set(got) == {'z3_gas1_tmbspg6_qwZ_qgZ', 'z0_gas1_tmbspg6_bf16'}, got
        for name, (losses, wire, ignored) in got.items():
            assert all(map(math.isfinite, losses)) and not ignored, (name, losses, ignored)
        assert got['z3_gas1_tmbspg6_qwZ_qgZ'][1] == (8, 8) and got['z0_gas1_tmbspg6_bf16'][1] == 'torch.bfloat16', got


# ---------------------------------------------------------------- the keys through the DeepSpeed alias
SCRIPT = """
import json, sys, warnings
warnings.simplefilter('always')
import deepspeed, torch, torch.nn.functional as F
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 2))
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=sys.argv[1])
torch.manual_seed(engine.global_rank)
for _ in range(3):
    x = torch.randn(4, 16)
    engine.backward(F.mse_loss(engine(x), x[:, :2]))
    engine.step()
slot = engine.optimizer
# one write a line: the two ranks share stdout
print(f'QUANTIZERS {slot.partitioner.weight_quantizer.bits} {slot.partitioner.grads.quantizer.bits}')
"""


def test_deepspeed_config_with_the_keys_runs_without_no_effect_warnings(tmp_path):
    cfg = config(3, 2, KEYS['qwZ+qgZ'] | {'zero_hpz_partition_size': 2})  # hpZ over 2 of 2 ranks: nothing to keep
    (tmp_path / 'ds.json').write_text(json.dumps(cfg))
    (tmp_path / 'train.py').write_text(SCRIPT)
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', '2', '--master_port', str(free_port()),
           '-m', 'flexrt.deepspeed', str(tmp_path / 'train.py'), str(tmp_path / 'ds.json')]
    env = os.environ | {'OMP_NUM_THREADS': '1', 'PYTHONPATH': str(ROOT)}
    r = run_torchrun(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.count('QUANTIZERS 8 8') == 2, r.stdout[-2000:]
    assert 'no effect' not in r.stdout + r.stderr, (r.stdout + r.stderr)[-4000:]
