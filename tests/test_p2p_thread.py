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
        dist.join_p2p_threads(); dist.comm_state.p2p_threads.clear()   # `used` below: only this engine's thread
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

def test_a_job_that_raises_does_not_stop_the_runner():
    "A job that raises ends its thread; the ops queued behind it, and later ones, still run (their wait() returns)"
    import threading
    from flexrt.comm.p2p import P2PThread, ThreadedOp
    runner, gate, seen, hook = P2PThread(), threading.Event(), [], threading.excepthook
    threading.excepthook = lambda a: seen.append(a.exc_type)
    try:
        runner.submit(lambda: (seen.append(threading.current_thread()), gate.wait(), 1 / 0))
        queued = ThreadedOp(lambda: seen.append(threading.current_thread())); runner.submit(queued)
        gate.set(); queued.wait(timeout=60)
        later = ThreadedOp(lambda: seen.append('later')); runner.submit(later); later.wait(timeout=60)
        runner.close()
    finally: threading.excepthook = hook
    dead, error, other, last = seen
    assert (error, last) == (ZeroDivisionError, 'later') and other != dead   # a new thread ran the queued op
    assert not runner.running and not any(t.is_alive() for t in runner._started)

def test_wait_honours_its_timeout():
    "P2PWork.wait(timeout) raises TimeoutError naming the op; a later wait finishes it"
    import threading, datetime
    from flexrt.comm.p2p import P2PThread, P2PWork, ThreadedOp
    runner, gate = P2PThread(), threading.Event()
    op = ThreadedOp(gate.wait); runner.submit(op)
    work = P2PWork([op], name='reduce_scatter_tensor_p2p')
    for timeout in (0.01, datetime.timedelta(milliseconds=10)):
        with pytest.raises(TimeoutError, match='reduce_scatter_tensor_p2p did not finish'): work.wait(timeout=timeout)
    assert not work.is_completed()
    gate.set(); assert work.wait(timeout=60) and work.is_completed()
    runner.close()

def test_two_threads_waiting_finish_an_op_once():
    "While one thread runs a handle's finish (the reduce-scatter's copy and sums), another's wait() does not run it again"
    import threading
    from flexrt.comm.p2p import P2PWork
    entered, gate, calls = threading.Event(), threading.Event(), []
    work = P2PWork([], lambda: (entered.set(), gate.wait(30), calls.append(1)), 'reduce_scatter_tensor_p2p')
    waiter = threading.Thread(target=work.wait); waiter.start()
    assert entered.wait(30)
    with pytest.raises(TimeoutError, match='reduce_scatter_tensor_p2p'): work.wait(timeout=0.01)   # busy on the other thread
    gate.set(); assert work.wait(timeout=60); waiter.join(30)
    assert calls == [1] and work.is_completed() and not waiter.is_alive()
