"""The comms logger on real gloo ranks: message sizes and bandwidth formulas per op (nccl-tests conventions), what is
profiled under each setting, async ops timed at completion, straggler analysis, and logging off meaning off."""
import multiprocessing, threading
import time
import pytest, torch
from helpers import run_distributed
from flexrt import comm as dist
from flexrt.comm.logger import bus_factor

F32 = 4

def _every_op(rank, ws):
    "Call each op once with logging on; return {op: (size, ranks, count, busbw/algbw)}"
    dist.configure({'comms_logger': {'enabled': True, 'prof_all': True}})
    k, nxt, prv = 256, (rank + 1) % ws, (rank - 1) % ws  # k fp32 elements per rank-sized piece
    x = torch.ones(k)
    dist.all_reduce(x); dist.broadcast(x, 0); dist.reduce(x, 0)
    dist.all_gather([torch.empty(k) for _ in range(ws)], x)
    dist.all_gather_into_tensor(torch.empty(ws * k), x)
    dist.reduce_scatter(torch.empty(k), [torch.ones(k) for _ in range(ws)])
    dist.reduce_scatter_tensor(torch.empty(k), torch.ones(ws * k))
    dist.all_to_all([torch.empty(k) for _ in range(ws)], [torch.ones(k) for _ in range(ws)])
    dist.all_to_all_single(torch.empty(ws * k), torch.ones(ws * k))
    dist.gather(x, [torch.empty(k) for _ in range(ws)] if rank == 0 else None, dst=0)
    dist.scatter(torch.empty(k), [torch.ones(k) for _ in range(ws)] if rank == 0 else None, src=0)
    for w in [dist.isend(x, nxt), dist.irecv(torch.empty(k), prv)]: w.wait()
    if rank % 2 == 0: dist.send(x, nxt); dist.recv(torch.empty(k), prv)
    else: dist.recv(torch.empty(k), prv); dist.send(x, nxt)
    for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, nxt), dist.P2POp(dist.irecv, torch.empty(k), prv)]): w.wait()
    dist.all_gather_object([None] * ws, {'a': 1}); dist.broadcast_object_list([1, 2], src=0)
    dist.barrier(); dist.monitored_barrier()
    df = dist.log_summary(print_table=False)
    return {r.op: (r.size_bytes, r.ranks, r.count, r.busbw_gbps / r.algbw_gbps if r.algbw_gbps else None) for r in df.itertuples()}

@pytest.mark.parametrize('ws', [2, 4])
def test_sizes_and_bus_factors(ws):
    piece, full = 256 * F32, ws * 256 * F32
    expected_size = dict(all_reduce=piece, broadcast=piece, reduce=piece, send=piece, recv=piece, isend=piece,
                         irecv=piece, batch_isend_irecv=2 * piece, all_gather=full, all_gather_into_tensor=full,
                         reduce_scatter=full, reduce_scatter_tensor=full, all_to_all=full, all_to_all_single=full,
                         gather=full, scatter=full, all_gather_object=0, broadcast_object_list=0, barrier=0,
                         monitored_barrier=0)
    for rank, got in enumerate(run_distributed(_every_op, ws)):
        assert set(got) == set(expected_size)
        for op, (size, ranks, count, ratio) in got.items():
            assert (size, ranks, count) == (expected_size[op], ws, 1), op
            if size: assert ratio == pytest.approx(bus_factor(op, ws)), op
    assert bus_factor('all_reduce', 4) == 1.5 and bus_factor('reduce_scatter_tensor', 4) == 0.75

class FakeClock:
    "The logger's clock, set by the test: latencies follow from when things happen in the logic, not from the machine"
    def __init__(self): self.now = 0.
    def __call__(self): return self.now

def _async_timing(rank, ws, sent, joined):
    """Rank 1 sends only when rank 0's clock reads 0.4 s, and joins the all_reduce only when it reads 1.4 s; rank 0 then
    waits for the all_reduce with its clock at 2.0 s. The log must hold the completion times (0.4 s after each issue),
    not the issue (0) or the wait (1.0 s after issue)"""
    dist.configure(enabled=True)
    t = torch.ones(4)
    if rank == 1:
        sent.wait(30); dist.send(t, 0)
        joined.wait(30); dist.all_reduce(t)
        return None
    clock, recorded, record = FakeClock(), threading.Event(), dist.comms_logger.record
    def record_and_tell(key, seconds): record(key, seconds); recorded.set()
    dist.comms_logger.clock, dist.comms_logger.record = clock, record_and_tell
    r = torch.empty(4)
    rw = dist.irecv(r, 1)              # issued at 0
    clock.now = 0.4; sent.set()
    rw.wait()                          # gloo p2p has no future: timed when wait() returns
    recorded.clear()
    clock.now = 1.0
    w = dist.all_reduce(t, async_op=True)   # issued at 1.0
    clock.now = 1.4; joined.set()
    assert recorded.wait(30)           # gloo collectives have a future: timed when it completes...
    clock.now = 2.0; w.wait()          # ...not when wait() is called
    stats = dist.get_comm_stats()
    return stats['all_reduce'][16]['total_latency_ms'], stats['irecv'][16]['total_latency_ms'], t.tolist(), r.tolist()

def test_async_ops_timed_at_completion():
    ctx = multiprocessing.get_context('fork')
    ar_ms, irecv_ms, t, r = run_distributed(_async_timing, 2, args=(ctx.Event(), ctx.Event()))[0]
    assert ar_ms == pytest.approx(400) and irecv_ms == pytest.approx(400)
    assert t == [2.0] * 4 and r == [1.0] * 4

def _selection(rank, ws):
    x, out = torch.ones(8), {}
    dist.configure({'comms_logger': {'enabled': False, 'prof_all': True}})   # a block saying off means off
    dist.all_reduce(x); out['off'] = dist.get_comm_stats()
    dist.configure({'comms_logger': {'enabled': True, 'prof_all': False, 'prof_ops': ['broadcast']}})
    dist.all_reduce(x); dist.broadcast(x, 0); dist.all_reduce(x, prof=True); dist.all_reduce(x, log_name='grads', prof=True)
    out['selected'] = {op: {s: v['count'] for s, v in sizes.items()} for op, sizes in dist.get_comm_stats().items()}
    dist.reset_log(); dist.configure(prof_all=True, debug=True)
    def train_step(): dist.all_reduce(x)
    train_step(); dist.all_reduce(x)
    df = dist.log_summary(print_table=False)
    out['callers'] = sorted(zip(df.op, df.caller))
    dist.configure(enabled=False); dist.reset_log(); dist.all_reduce(x)
    out['after_off'] = dist.get_comm_stats()
    return out

def test_what_is_profiled():
    for out in run_distributed(_selection, 2):
        assert out['off'] == {} and out['after_off'] == {}
        assert out['selected'] == {'broadcast': {32: 1}, 'all_reduce': {32: 1}, 'grads': {32: 1}}
        assert out['callers'] == [('all_reduce', '_selection'), ('all_reduce', 'train_step')]

class SteppingClock:
    "Advances by `step` seconds at every reading: each op on this rank lasts `step` (start and end are two readings)"
    def __init__(self, step): self.now, self.step = 0., step
    def __call__(self): self.now += self.step; return self.now

def _straggler(rank, ws):
    dist.configure(enabled=True)
    dist.comms_logger.clock = SteppingClock(0.2 if rank == 0 else 0.001)   # rank 0 waits 200 ms in every op, rank 1 1 ms
    for _ in range(3): dist.all_reduce(torch.ones(16))
    df = dist.log_summary(show_straggler=True, print_table=False)
    return df.set_index('op').loc['all_reduce', ['count', 'straggler_ms']].tolist()

def test_straggler_column():
    (c0, s0), (c1, s1) = run_distributed(_straggler, 2)
    assert c0 == c1 == 3
    assert s0 == pytest.approx(3 * 199) and s1 == 0, (s0, s1)  # rank 0 waited 199 ms more than the fastest rank, 3 times

def _verbose(rank, ws, capsys_file):
    import contextlib, io
    buf = io.StringIO()
    dist.configure(enabled=True, verbose=True)
    with contextlib.redirect_stdout(buf): dist.all_reduce(torch.ones(4)); dist.log_summary()
    return buf.getvalue()

def test_verbose_and_table_printing():
    r0, r1 = run_distributed(_verbose, 2, args=(None,))
    assert f'[rank 0] comm op: all_reduce | time (ms):' in r0 and 'msg size: 16 B' in r0
    assert 'busbw_gbps' in r0 and 'busbw_gbps' not in r1  # the table prints on rank 0 only

# ---- CUDA: async latency excludes compute queued between issue and wait; pending events stay few --------------

def _cuda_async(rank, ws):
    dist.init_distributed(backend='nccl', timeout=60)
    dist.configure(enabled=True)
    x = torch.ones(1 << 20, device='cuda')
    dist.all_reduce(x); torch.cuda.synchronize(); dist.reset_log()
    w = dist.all_reduce(x, async_op=True)
    torch.cuda._sleep(int(2e9))        # ~1 s of unrelated kernels on the caller's stream, queued before wait()
    w.wait(); torch.cuda.synchronize()
    ar_ms = dist.comms_logger.stats(wait=True)['all_reduce'][4 << 20]['total_latency_ms']
    for _ in range(200): dist.all_reduce(x)
    torch.cuda.synchronize(); dist.all_reduce(x)   # adding a pair resolves the completed ones
    pending = len(dist.comms_logger._pending)
    dist.destroy_process_group()
    return ar_ms, pending

@pytest.mark.skipif(not torch.cuda.is_available(), reason='no CUDA device on this machine: CUDA-event timing of an async op runs only where a GPU exists')
def test_cuda_async_latency_excludes_later_compute():
    ar_ms, pending = run_distributed(_cuda_async, 1, init=False, start_method='spawn')[0]
    assert ar_ms < 200, ar_ms   # the comm itself, not the ~1 s of kernels queued after it
    assert pending <= 2, pending
