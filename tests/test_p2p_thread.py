"""On gloo, asynchronous direct-message collectives run on one thread per group: their results equal the synchronous
(calling-thread) ones exactly, on 2 and 4 ranks, with many ops in flight on two groups at once; the per-group tag
counters count the same ops either way; a thread lives only while its group has ops queued, and destroying a group,
closing a ZeRO engine or joining leaves none behind."""
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

def _p2p_threads():
    import threading
    return [t for t in threading.enumerate() if t.name == 'flexrt-p2p']

def stop_rank(rank, world):
    from flexrt import comm as dist
    from flexrt.comm.state import comm_state
    sub = dist.new_group([0, 1])
    out = torch.empty(2 * world)
    works = [dist.all_gather_into_tensor_p2p(out, torch.full((2,), float(rank)), async_op=True)]
    works.append(dist.all_gather_into_tensor_p2p(torch.empty(4), torch.full((2,), float(rank)), group=sub, async_op=True))
    dist.destroy_process_group(sub)              # runs the sub-group's queued op to its end first, joins its thread
    sub_done, kept = works[1].is_completed() or works[1]._works[0].is_completed(), sub in comm_state.p2p_threads
    for w in works: w.wait()
    for t in _p2p_threads(): t.join(timeout=60)  # nothing left queued: each thread ends by itself
    return out.tolist(), sub_done, kept, None in comm_state.p2p_threads, [t.name for t in _p2p_threads()]

def test_destroying_a_group_stops_its_thread():
    for out, sub_done, sub_kept, default_kept, left in run_distributed(stop_rank, 2):
        assert out == [0., 0., 1., 1.] and sub_done and not sub_kept and default_kept and left == []

def idle_rank(rank, world):
    "A thread runs only while its group has ops queued; engine.close() and destroy_process_group() join what is left"
    from flexrt import comm as dist
    import flexrt
    x = torch.full((6,), float(rank))
    for _ in range(3):                           # bursts of ops: each starts a thread that ends once they ran
        works = [dist.all_gather_into_tensor_p2p(torch.empty(12), x, async_op=True) for _ in range(4)]
        for w in works: w.wait()
        dist.join_p2p_threads()
        after_burst = _p2p_threads()
        assert after_burst == [], after_burst
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    left = []
    for stage in (1, 2, 3):
        engine, *_ = flexrt.initialize(model=model, config={'train_micro_batch_size_per_gpu': 2, 'steps_per_print': 10**9,
            'optimizer': {'type': 'Adam', 'params': {'lr': 1e-3}}, 'zero_optimization': {'stage': stage,
            'reduce_bucket_size': 16 * 17, 'stage3_param_persistence_threshold': 0}})
        for _ in range(2):
            engine.backward(engine(torch.randn(2, 16)).square().mean()); engine.step()
        used = dist.comm_state.p2p_threads.get(None)
        engine.destroy()                         # the deferred gathers of the last step included
        left.append((used is not None, _p2p_threads()))
    return left

def test_no_p2p_thread_outlives_its_work():
    for left in run_distributed(idle_rank, 2, timeout=120):
        assert left == [(True, [])] * 3
