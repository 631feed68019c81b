"""flexrt.utils.partition on real gloo groups: PartitionedTensor round trips with uneven sizes (incl. to_meta /
from_meta), all_gather_dp_groups on its fused and sharded paths; plus balanced partitions against brute force."""
import itertools, random
import pytest, torch
from helpers import run_distributed
from flexrt import comm as dist
from flexrt.utils import (PartitionedTensor, all_gather_dp_groups, partition_uniform, partition_balanced,
                          align_dense_tensors, prefix_sum_inc)

SHAPES = [(10,), (3, 7), (2, 1), (5, 2, 3)]     # uneven over 2 and 4 ranks; (2, 1) leaves ranks with nothing

def _pt_round_trip(rank, world_size):
    out = []
    for i, shape in enumerate(SHAPES):
        full = torch.arange(float(torch.Size(shape).numel())).reshape(shape) + 100 * i
        pt = PartitionedTensor(full, group=None)
        bounds = partition_uniform(full.numel(), world_size)
        local_ok = torch.equal(pt.data(), full.flatten()[bounds[rank]:bounds[rank + 1]])
        meta = pt.to_meta()
        # the receiver gets the meta and its own piece (as a pipeline stage would) and rebuilds the object
        rebuilt = PartitionedTensor.from_meta(meta.clone(), pt.data().clone(), group=None, device='cpu')
        out.append(dict(local_ok=local_ok, local_size=pt.local_size(), full_size=pt.full_size(),
                        full_ok=torch.equal(pt.full(), full), rebuilt_ok=torch.equal(rebuilt.full(), full),
                        meta=meta.tolist(), dtype_ok=pt.full().dtype == full.dtype))
    try:
        PartitionedTensor.from_meta(PartitionedTensor(torch.ones(10), None).to_meta(), torch.ones(99), None)
        out.append(None)
    except ValueError as e: out.append(str(e))
    return out

@pytest.mark.parametrize('world', [2, 4])
def test_partitioned_tensor_round_trip(world):
    results = run_distributed(_pt_round_trip, world)
    for rank, res in enumerate(results):
        for shape, r in zip(SHAPES, res):
            n = torch.Size(shape).numel()
            b = partition_uniform(n, world)
            assert r['local_ok'] and r['full_ok'] and r['rebuilt_ok'] and r['dtype_ok'], (rank, shape, r)
            assert r['local_size'] == b[rank + 1] - b[rank] and r['full_size'] == list(shape)
            assert r['meta'] == [len(shape), *shape, world, rank, *b]
        assert 'local_part has 99 elements' in res[-1]
    assert sum(r[1]['local_size'] for r in results) == 21

def _subgroup_pt(rank, world_size):
    "PartitionedTensor over a subgroup: ranks {1, 3} of 4 split a tensor, ranks {0, 2} another"
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    g = groups[rank % 2]
    full = torch.arange(9.) * (1 + rank % 2)
    pt = PartitionedTensor(full, g)
    return pt.local_size(), torch.equal(pt.full(), full), pt.to_meta().tolist()

def test_partitioned_tensor_subgroup():
    results = run_distributed(_subgroup_pt, 4)
    assert [r[0] for r in results] == [5, 5, 4, 4] and all(r[1] for r in results)
    assert results[3][2] == [1, 9, 2, 1, 0, 5, 9]

def _dp_gather(rank, world_size, bucket, use_flat, per_group_list):
    "Two parameter groups of different sizes; each rank writes only its own partition, then gathers"
    sizes = [6, 11]                          # elements per partition of each parameter group
    flats = [torch.full((s * world_size,), -1.) for s in sizes]
    parts = [list(f.split(s)) for f, s in zip(flats, sizes)]
    for g, s in enumerate(sizes):
        parts[g][rank].copy_(torch.arange(float(s)) + 1000 * rank + 100 * g)
    expected = [torch.cat([torch.arange(float(s)) + 1000 * r + 100 * g for r in range(world_size)])
                for g, s in enumerate(sizes)]
    group = [None, None] if per_group_list else None
    all_gather_dp_groups(flats if use_flat else None, parts, group, start_alignment_factor=2,
                         allgather_bucket_size=bucket)
    return all(torch.equal(f, e) for f, e in zip(flats, expected))

@pytest.mark.parametrize('world', [2, 4])
@pytest.mark.parametrize('bucket, use_flat, per_group_list', [
    (10**9, True, False),    # one fused all_gather_into_tensor per group
    (8, True, True),         # shards of 2 elements per rank (bucket 8 over 4 ranks), uneven tail
    (5, False, False),       # no flat buffers: gathered straight into the partition views
])
def test_all_gather_dp_groups(world, bucket, use_flat, per_group_list):
    assert run_distributed(_dp_gather, world, args=(bucket, use_flat, per_group_list)) == [True] * world

def _dp_gather_bad(rank, world_size):
    flat = torch.zeros(8)
    try: all_gather_dp_groups([flat], [list(flat.split([3, 5]))], None); return None
    except ValueError as e: return str(e)

def test_all_gather_dp_groups_rejects_uneven_partitions():
    assert all('partitions must have equal sizes' in r for r in run_distributed(_dp_gather_bad, 2))

# ---------------------------------------------------------------- single process
def _brute_force(weights, k):
    best = None
    for cuts in itertools.combinations(range(1, len(weights)), k - 1):
        b = [0, *cuts, len(weights)]
        s = [sum(weights[x:y]) for x, y in zip(b, b[1:])]
        best = min(best or (max(s) - min(s), max(s)), (max(s) - min(s), max(s)))
    return best

def test_partition_balanced_is_optimal():
    rng = random.Random(7)
    for trial in range(400):
        n = rng.randint(2, 10); k = rng.randint(1, n)
        w = [rng.randint(0, 12) for _ in range(n)] if trial % 2 else [rng.random() * 3 for _ in range(n)]
        parts = partition_balanced(w, k)
        assert parts[0] == 0 and parts[-1] == n and len(parts) == k + 1
        assert all(a < b for a, b in zip(parts, parts[1:])), (w, k, parts)   # no empty part
        s = [sum(w[a:b]) for a, b in zip(parts, parts[1:])]
        assert (max(s) - min(s), max(s)) == pytest.approx(_brute_force(w, k)), (w, k, parts)

def test_partition_known_cases():
    assert partition_balanced([1] * 5, 4) == [0, 2, 3, 4, 5]          # spread 1 (DeepSpeed 0.7.7: 2)
    assert partition_uniform(10, 4) == [0, 3, 6, 8, 10]                # remainder spread (0.7.7: [0,2,4,6,10])
    assert partition_balanced([4, 1, 1, 1, 1], 2) == [0, 1, 5]
    assert prefix_sum_inc([3, 4, 5]) == [3, 7, 12]

def test_partition_bad_input():
    with pytest.raises(ValueError, match='weights\\[2\\] = -1'): partition_balanced([1, 2, -1], 2)
    with pytest.raises(ValueError, match='num_parts must be >= 1'): partition_balanced([1, 2], 0)
    with pytest.raises(TypeError, match='num_items must be an int'): partition_uniform('4', 2)
    with pytest.raises(TypeError, match='tensor_list\\[0\\] is a str'): align_dense_tensors(['x'], 4)
    with pytest.raises(TypeError, match='tensor must be a torch.Tensor'): PartitionedTensor([1, 2], None)

def test_align_dense_tensors_pads_to_alignment():
    ts = [torch.ones(5, dtype=torch.float16), torch.ones(2, 2, dtype=torch.float16)]
    out = align_dense_tensors(ts, 8)
    assert sum(t.numel() for t in out) == 16 and out[-1].dtype == torch.float16 and not out[-1].any()
