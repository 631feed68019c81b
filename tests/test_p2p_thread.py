"""On gloo, asynchronous direct-message collectives run on one thread per group: their results equal the synchronous
(calling-thread) ones exactly, on 2 and 4 ranks, with many ops in flight on two groups at once; the per-group tag
counters count the same ops either way; destroying the groups stops the threads."""
import pytest, torch
from helpers import run_distributed

def ops_rank(rank, world, threaded):
    from flexrt import comm as dist
    from flexrt.comm.state import comm_state
    from flexrt.comm.p2p import ThreadedOp
    comm_state.p2p_threaded = threaded
    pairs = dist.new_group([0, 1]) if world > 2 else None
    g = torch.Generator().manual_seed(rank)
    inputs = [torch.randn(world * 7, generator=g) for _ in range(6)]
    outs, works = [], []
    for i, x in enumerate(inputs):                       # reduce-scatters and all-gathers interleaved, all in flight
        rs = torch.empty(7); works.append(dist.reduce_scatter_tensor_p2p(rs, x, async_op=True)); outs.append(rs)
        ag = torch.empty(world * 7); works.append(dist.all_gather_into_tensor_p2p(ag, x[:7], async_op=True)); outs.append(ag)
        if pairs is not None and rank < 2:               # a second group with its own thread and counter
            pg = torch.empty(14); works.append(dist.all_gather_into_tensor_p2p(pg, x[:7], group=pairs, async_op=True)); outs.append(pg)
    on_thread = [isinstance(w._works[0], ThreadedOp) for w in works]
    for w in reversed(works): w.wait()                   # in any order
    tags, num_threads = sorted(comm_state.p2p_tags.values()), len(comm_state.p2p_threads)
    return outs, on_thread, tags, num_threads

@pytest.mark.parametrize('world', [2, 4])
def test_threaded_p2p_equals_synchronous(world):
    threaded = run_distributed(ops_rank, world, args=(True,), timeout=60)
    synchronous = run_distributed(ops_rank, world, args=(False,), timeout=60)
    for rank, ((outs, on_thread, tags, num_threads), (ref, ref_on_thread, ref_tags, ref_threads)) in enumerate(zip(threaded, synchronous)):
        assert len(outs) == len(ref) and all(torch.equal(a, b) for a, b in zip(outs, ref))
        assert all(on_thread) and not any(ref_on_thread) and ref_threads == 0
        ops = 12 + (6 if world > 2 and rank < 2 else 0)
        assert tags == ref_tags and sum(tags) == ops             # the counters count the same ops either way
        assert num_threads == (2 if world > 2 and rank < 2 else 1)

def stop_rank(rank, world):
    from flexrt import comm as dist
    from flexrt.comm.state import comm_state
    sub = dist.new_group([0, 1])
    out = torch.empty(2 * world)
    dist.all_gather_into_tensor_p2p(out, torch.full((2,), float(rank)), async_op=True).wait()
    dist.all_gather_into_tensor_p2p(torch.empty(4), torch.full((2,), float(rank)), group=sub, async_op=True).wait()
    threads = dict(comm_state.p2p_threads)
    dist.destroy_process_group(sub)
    threads[sub]._thread.join(timeout=30)
    return out.tolist(), threads[sub]._thread.is_alive(), sub in comm_state.p2p_threads, None in comm_state.p2p_threads

def test_destroying_a_group_stops_its_thread():
    for out, alive, sub_kept, default_kept in run_distributed(stop_rank, 2):
        assert out == [0., 0., 1., 1.] and not alive and not sub_kept and default_kept
