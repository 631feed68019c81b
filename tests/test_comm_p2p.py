"The point-to-point forms of reduce-scatter and all-gather equal the native ops on 2 and 4 gloo ranks, in and out of order."
import pytest, torch
from helpers import run_distributed

def p2p_rank(rank, world):
    from flexrt import comm as dist
    dist.configure(enabled=True); dist.reset_log()
    g = torch.Generator().manual_seed(rank)
    x = [torch.randn(world * 5, 3, generator=g) for _ in range(3)]
    native, p2p = [torch.empty(5, 3) for _ in x], [torch.empty(5, 3) for _ in x]
    for n, t in zip(native, x): dist.reduce_scatter_tensor(n, t)
    works = [dist.reduce_scatter_tensor_p2p(o, t, async_op=True) for o, t in zip(p2p, x)]   # three in flight at once
    for w in reversed(works): w.wait()
    gathered, gathered_p2p = torch.empty(world * 5, 3), torch.empty(world * 5, 3)
    dist.all_gather_into_tensor(gathered, p2p[0]); dist.all_gather_into_tensor_p2p(gathered_p2p, p2p[0])
    stats = dist.get_comm_stats()
    sizes = {op: sorted(stats[op]) for op in ('reduce_scatter_tensor_p2p', 'all_gather_into_tensor_p2p')}
    dist.configure(enabled=False)
    return [torch.allclose(a, b, atol=1e-6) for a, b in zip(native, p2p)], torch.equal(gathered, gathered_p2p), sizes

@pytest.mark.parametrize('world', [2, 4])
def test_p2p_forms_equal_native_ops(world):
    for close, equal, sizes in run_distributed(p2p_rank, world):
        assert close == [True] * 3 and equal
        assert sizes == {'reduce_scatter_tensor_p2p': [world * 15 * 4], 'all_gather_into_tensor_p2p': [world * 15 * 4]}

def bad_rank(rank, world):
    from flexrt import comm as dist
    try: dist.reduce_scatter_tensor_p2p(torch.empty(3), torch.empty(5))
    except ValueError as e: return str(e)

def test_p2p_shape_errors():
    assert all('divisible by 2' in m for m in run_distributed(bad_rank, 2))

def subgroups_rank(rank, world):
    "Ranks 0-1 run two ops in their pair, ranks 2-3 one in theirs, then all four one together: tags are counted per group"
    from flexrt import comm as dist
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pairs[rank // 2]
    out = torch.empty(2)
    for _ in range(2 if rank < 2 else 1): dist.reduce_scatter_tensor_p2p(out, torch.ones(4), group=mine)
    total = torch.empty(1)
    dist.reduce_scatter_tensor_p2p(total, torch.full((4,), float(rank)))
    return out.tolist(), total.item()

def test_p2p_tags_are_counted_per_group():
    for rank, (out, total) in enumerate(run_distributed(subgroups_rank, 4, timeout=60)):
        assert out == [2., 2.] and total == 0 + 1 + 2 + 3

def gather_shapes_rank(rank, world):
    "An (n, k) output with a (k,) input (rows) and with a (1, k) input (chunks, as NCCL's own takes it), against the native gather"
    from flexrt import comm as dist
    out = []
    for piece in [(4,), (1, 4)]:
        x = torch.arange(4.).reshape(piece) + 10 * rank
        native = torch.empty(world * 4); dist.all_gather_into_tensor(native, x.flatten())   # gloo's own rejects a (1, k) input here
        native = native.view(world, 4)
        sync, threaded = torch.empty(world, 4), torch.empty(world, 4)
        dist.all_gather_into_tensor_p2p(sync, x)
        dist.all_gather_into_tensor_p2p(threaded, x, async_op=True).wait()
        out.append((native.tolist(), sync.tolist(), threaded.tolist()))
    return out

def test_all_gather_p2p_takes_rows_or_chunks_like_native():
    expected = [[float(j + 10 * r) for j in range(4)] for r in range(2)]
    for results in run_distributed(gather_shapes_rank, 2):
        for native, sync, threaded in results:
            assert native == expected and sync == native and threaded == native

def report_race_rank(rank, world):
    "The report (another thread) and the training thread wait on the same reduce-scatter handles: each sum is finished once"
    import threading
    from flexrt import comm as dist
    dist.configure(enabled=True); dist.reset_log()
    wrong = 0
    for i in range(20):
        x = torch.full((world * 3,), float(rank + 1 + i))
        out = torch.empty(3)
        work = dist.reduce_scatter_tensor_p2p(out, x, async_op=True)
        reporter = threading.Thread(target=dist.get_comm_stats); reporter.start()
        work.wait(); reporter.join(); work.wait()
        wrong += not torch.equal(out, torch.full((3,), float(sum(r + 1 + i for r in range(world)))))
    count = dist.get_comm_stats()['reduce_scatter_tensor_p2p'][world * 3 * 4]['count']
    dist.configure(enabled=False)
    return wrong, count

def test_a_report_and_a_wait_finish_a_p2p_op_once():
    for wrong, count in run_distributed(report_race_rank, 2, timeout=120):
        assert wrong == 0 and count == 20
