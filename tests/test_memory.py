"flexrt.memory: snapshots, DeepSpeed's reports on real gloo ranks, and the background sampler (incl. fork)."
import contextlib, io, os, re, threading, time, warnings
from dataclasses import fields
import psutil, pytest, torch
from helpers import run_distributed
from flexrt.memory import (MemorySampler, MemorySnapshot, MemoryStatus, get_ma_status, memory_snapshot,
                           memory_status, reset_peak_memory_stats, see_memory_usage)
from flexrt.memory.tracker import TensorMemoryTracker

MiB = 1 << 20
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason='no CUDA device on this machine: the real CUDA '
                                'path (tracker vs torch.cuda counters, peak reset) runs only where a GPU exists')

class Counted:
    "An on_sample that lets a test wait for the sampler thread's n-th snapshot (an event, not a guess of how long it takes)"
    def __init__(self, then=None): self.n, self.cond, self.then = 0, threading.Condition(), then
    def __call__(self, snapshot):
        if self.then is not None: self.then(snapshot)
        with self.cond: self.n += 1; self.cond.notify_all()
    def wait(self, n:int, timeout:float=60):
        with self.cond: assert self.cond.wait_for(lambda: self.n >= n, timeout), f'{self.n} of {n} samples after {timeout} s'

def printed(f, *args, **kwargs)->list:
    with contextlib.redirect_stdout(io.StringIO()) as out: f(*args, **kwargs)
    return out.getvalue().splitlines()

@pytest.fixture
def cpu_default():
    "For tests of the default device: it is the CPU unless this process has initialised CUDA"
    if torch.cuda.is_initialized():   # only possible if another test file in this pytest run used the GPU
        pytest.skip('CUDA was initialised earlier in this process, so the default device is the GPU; the CPU '
                    'default is still checked by test_unit_formatting_with_cuda_patched_available_but_uninitialised')

# ---- memory_snapshot

def test_snapshot_without_tracker_is_marked_untracked_on_cpu():
    before = time.time(); s = memory_snapshot('cpu'); after = time.time()
    assert (s.tracked, s.allocated_bytes, s.max_allocated_bytes, s.rank, s.device) == (False, 0, 0, 0, 'cpu')
    rss = psutil.Process().memory_info().rss
    assert abs(s.process_rss_bytes - rss) < 64 * MiB
    assert s.process_virtual_bytes >= s.process_rss_bytes
    assert s.system_total_bytes == psutil.virtual_memory().total
    assert s.system_used_percent == pytest.approx(100 * s.system_used_bytes / s.system_total_bytes, abs=1)
    assert s.device_name and before <= s.timestamp <= after            # wall-clock time, taken during the call

def test_snapshot_reads_the_tracker_exactly():
    with TensorMemoryTracker():
        before = memory_snapshot('cpu')
        t = torch.empty(MiB // 4)
        after = memory_snapshot('cpu')
        del t
        freed = memory_snapshot('cpu')
    assert after.tracked and after.allocated_bytes - before.allocated_bytes == MiB
    assert freed.allocated_bytes == before.allocated_bytes and freed.max_allocated_bytes >= after.allocated_bytes
    assert after.reserved_bytes == after.allocated_bytes            # CPU: no allocator cache

def test_bad_device_is_refused():
    with pytest.raises(ValueError, match="'cpu' and 'cuda' devices, not 'meta'"): memory_snapshot('meta')

@pytest.mark.usefixtures('cpu_default')
def test_nothing_initialises_cuda():
    with TensorMemoryTracker():
        memory_snapshot(); get_ma_status(); printed(see_memory_usage, 'x', force=True); printed(memory_status, 'x')
        counted = Counted()
        with MemorySampler(interval_ms=1, on_sample=counted): counted.wait(2)   # the thread sampled, and again
    assert not torch.cuda.is_initialized()

def test_unit_formatting_with_cuda_patched_available_but_uninitialised(monkeypatch, capsys):
    """A unit test of the reports' device choice and formatting: torch.cuda is patched to say a GPU is there but unused
    (a GPU machine running CPU work); the real CUDA path is test_cuda_snapshot_matches_torch_and_see_memory_usage_resets_peaks"""
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'is_initialized', lambda: False)
    with TensorMemoryTracker(count_existing=False) as tracker:
        t = torch.empty(MiB // 4)
        s = memory_snapshot()
        assert (s.device, s.tracked, s.allocated_bytes) == ('cpu', True, MiB)
        assert get_ma_status() == MiB
        see_memory_usage('cpu work', force=True)
        assert capsys.readouterr().out.startswith('cpu work | cpu: allocated 1.00 MiB | max allocated 1.00 MiB')
        (line,) = printed(MemoryStatus(), 'cpu work')
        assert 'device=cpu current alloc=1.00 MiB (delta=1.00 MiB' in line
        with MemorySampler(interval_ms=1) as sampler: pass
        assert {(x.device, x.allocated_bytes) for x in sampler.snapshots()} == {('cpu', MiB)}
        del t
    gpu = memory_snapshot('cuda')                                    # named explicitly: not measured, and said so
    assert (gpu.device, gpu.tracked, gpu.allocated_bytes, gpu.max_reserved_bytes) == ('cuda:0', False, 0, 0)
    assert gpu.device_name == 'CUDA (not initialised yet)'
    see_memory_usage('gpu', force=True)                              # the default is still the CPU
    assert 'gpu | cpu: tensor bytes untracked' in capsys.readouterr().out
    (line,) = printed(MemoryStatus(), 'x')
    assert 'device=cpu current alloc=tensor bytes untracked' in line

# ---- see_memory_usage, memory_status, get_ma_status

@pytest.mark.usefixtures('cpu_default')
def test_see_memory_usage_is_silent_unless_forced(capsys):
    with TensorMemoryTracker() as tracker:
        t = torch.empty(MiB // 4); del t
        see_memory_usage('not forced')
        assert capsys.readouterr().out == ''
        assert tracker.peak_bytes >= tracker.allocated_bytes + MiB   # and peaks untouched
        see_memory_usage('forced', force=True)
        lines = capsys.readouterr().out.splitlines()
        assert tracker.peak_bytes == tracker.allocated_bytes        # peaks reset
    assert len(lines) == 1
    assert re.match(r'forced \| cpu: allocated [\d.]+ \S+ \| max allocated [\d.]+ \S+ \| cached [\d.]+ \S+ \| '
                    r'max cached [\d.]+ \S+ \| process RSS [\d.]+ \S+ \| virtual [\d.]+ \S+ \| '
                    r'system used [\d.]+ \S+ \([\d.]+%\)$', lines[0]), lines[0]

@pytest.mark.usefixtures('cpu_default')
def test_see_memory_usage_without_tracker_says_untracked(capsys):
    see_memory_usage('plain', force=True)
    (line,) = capsys.readouterr().out.splitlines()
    assert 'tensor bytes untracked (enable a TensorMemoryTracker)' in line and 'process RSS' in line

def _reports_on_ranks(rank, world_size):
    with TensorMemoryTracker() as tracker:
        t = torch.empty(MiB // 4); del t
        usage = printed(see_memory_usage, 'step', force=True)
        peak_reset = tracker.peak_bytes == tracker.allocated_bytes
        status = MemoryStatus()
        every = printed(status, 'every rank')
        t = torch.empty(MiB // 4)
        only_one = printed(status, 'rank 1 only', print_rank=1)
        ma, tracked = get_ma_status(), tracker.allocated_bytes
        del t
        snapshot_rank = memory_snapshot().rank
    return dict(usage=usage, peak_reset=peak_reset, every=every, only_one=only_one, ma=ma, tracked=tracked,
                snapshot_rank=snapshot_rank)

def test_reports_on_two_gloo_ranks():
    r0, r1 = run_distributed(_reports_on_ranks, 2)
    assert len(r0['usage']) == 1 and r0['usage'][0].startswith('step | cpu: allocated ')
    assert r1['usage'] == []                                         # only rank 0 prints
    assert r0['peak_reset'] and r1['peak_reset']                     # every rank resets its peaks
    assert [len(r0['every']), len(r1['every'])] == [1, 1]
    assert r0['every'][0].startswith('RANK=0 MEMSTATS every rank device=cpu current alloc=')
    assert r1['every'][0].startswith('RANK=1 MEMSTATS every rank device=cpu current alloc=')
    assert r0['only_one'] == [] and len(r1['only_one']) == 1
    assert 'rank 1 only device=cpu current alloc=' in r1['only_one'][0] and '(delta=1.00 MiB' in r1['only_one'][0]
    assert (r0['ma'], r1['ma']) == (r0['tracked'], 0) and r0['ma'] >= MiB  # get_ma_status: rank 0 only
    assert (r0['snapshot_rank'], r1['snapshot_rank']) == (0, 1)

@pytest.mark.usefixtures('cpu_default')
def test_memory_status_deltas_and_reset_max():
    status = MemoryStatus()
    with TensorMemoryTracker(count_existing=False):
        (first,) = printed(status, 'a')
        t = torch.empty(MiB // 2, dtype=torch.float64)                # 4 MiB
        (second,) = printed(status, 'b')
        del t
        (third,) = printed(status, 'c')
        (fourth,) = printed(status, 'd', reset_max=True)
    assert 'current alloc=0 B (delta=0 B max=0 B)' in first
    assert 'current alloc=4.00 MiB (delta=4.00 MiB max=4.00 MiB) current cache=4.00 MiB (delta=4.00 MiB' in second
    assert 'current alloc=0 B (delta=-4.00 MiB max=4.00 MiB)' in third
    assert 'current alloc=0 B (delta=0 B max=0 B)' in fourth
    assert isinstance(memory_status, MemoryStatus)
    with pytest.raises(ValueError, match='print_rank must be'): status('x', print_rank=-3)
    with pytest.raises(ValueError, match='print_rank must be'): status('x', print_rank='0')

@pytest.mark.usefixtures('cpu_default')
def test_get_ma_status_counts_activation_bytes_and_warns_without_tracker():
    with TensorMemoryTracker():
        x = torch.randn(100, 100, requires_grad=True)
        before = get_ma_status()
        y = torch.tanh(x)                                            # tanh saves its output
        assert get_ma_status() - before == 100 * 100 * 4
        del x, y
    with pytest.warns(UserWarning, match='no TensorMemoryTracker is enabled'):
        assert get_ma_status() == 0

def test_reset_peak_memory_stats_resets_the_tracker():
    with TensorMemoryTracker() as tracker:
        t = torch.empty(MiB); del t
        assert tracker.peak_bytes > tracker.allocated_bytes
        reset_peak_memory_stats()
        assert tracker.peak_bytes == tracker.allocated_bytes

# ---- MemorySampler

COLUMNS = [f.name for f in fields(MemorySnapshot)] + ['elapsed_s']

def _sampler_threads(): return [t for t in threading.enumerate() if t.name.startswith('flexrt-memory-sampler')]

def test_sampler_start_stop_and_thread_gone():
    before = len(_sampler_threads())
    counted = Counted()
    s = MemorySampler(interval_ms=2, capacity=1000, on_sample=counted)
    assert not s.running and len(s) == 0
    assert s.start() is s and s.running and len(_sampler_threads()) == before + 1
    counted.wait(3)                                                  # at start, then every interval
    thread = s._thread
    s.stop()
    assert not s.running and not thread.is_alive() and len(_sampler_threads()) == before
    n = len(s)
    assert n >= 4 and n == s.num_samples == counted.n                # the 3 waited for, and the last at stop
    assert len(s) == n                                               # nothing samples after stop: the thread is gone
    s.stop()                                                         # twice: harmless
    assert len(s) == n
    with s: counted.wait(n + 1)                                      # and it can run again
    assert len(s) >= n + 2 and not s.running                         # its first sample, and the one at stop

def test_sampler_ring_buffer_keeps_the_newest():
    counted, started = Counted(), time.time()
    with MemorySampler(interval_ms=1, capacity=7, on_sample=counted) as s: counted.wait(30)
    kept = s.snapshots()
    assert len(kept) == 7 and s.num_samples >= 30
    assert [k.timestamp for k in kept] == sorted(k.timestamp for k in kept)
    assert started <= kept[0].timestamp and kept[-1].timestamp <= time.time()   # this run's samples
    s.clear()
    assert len(s) == 0 and s.to_dataframe().columns.tolist() == COLUMNS

@pytest.mark.usefixtures('cpu_default')
def test_sampler_dataframe_records_training_memory():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    x, y = torch.randn(128, 64), torch.randint(0, 4, (128,))
    counted = Counted()
    with TensorMemoryTracker() as tracker, MemorySampler(interval_ms=1, on_sample=counted) as s:
        for _ in range(20): torch.nn.functional.cross_entropy(model(x), y).backward()
        counted.wait(2)                                              # a sample after the start one
    df = s.to_dataframe()
    assert df.columns.tolist() == COLUMNS and len(df) >= 3
    assert df.tracked.all() and (df.device == 'cpu').all() and (df['rank'] == 0).all()
    assert (df.max_allocated_bytes >= df.allocated_bytes).all()
    assert df.max_allocated_bytes.iloc[-1] == tracker.peak_bytes
    assert df.elapsed_s.iloc[0] == 0 and df.elapsed_s.is_monotonic_increasing
    assert df.process_rss_bytes.gt(0).all()

@pytest.mark.parametrize('kwargs, message', [(dict(interval_ms=0), 'interval_ms must be a positive number'),
                                             (dict(interval_ms='10'), 'interval_ms must be a positive number'),
                                             (dict(capacity=0), 'capacity must be a positive int'),
                                             (dict(capacity=2.5), 'capacity must be a positive int'),
                                             (dict(device='meta'), "not 'meta'")])
def test_sampler_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message): MemorySampler(**kwargs)

def test_sampler_start_twice_is_refused():
    with MemorySampler(interval_ms=50) as s:
        with pytest.raises(RuntimeError, match='already running'): s.start()

def test_sampler_hands_every_snapshot_to_on_sample_on_its_thread():
    seen, threads = [], set()
    def on_sample(snapshot): seen.append(snapshot); threads.add(threading.current_thread().name)
    counted = Counted(then=on_sample)
    with MemorySampler(interval_ms=2, capacity=1000, on_sample=counted) as s: counted.wait(3)
    assert seen == s.snapshots() and len(seen) == s.num_samples >= 3
    assert any(name.startswith('flexrt-memory-sampler') for name in threads)
    with pytest.raises(TypeError, match='on_sample must be a callable'): MemorySampler(on_sample=[])

def test_sampler_on_sample_error_stops_sampling_and_is_raised_at_stop():
    def refuse(snapshot): raise ConnectionError('sink gone')
    s = MemorySampler(interval_ms=1, on_sample=refuse).start()
    s._thread.join(10)
    assert not s.running and s.num_samples == 1
    with pytest.raises(RuntimeError, match=r"sampler thread failed: ConnectionError\('sink gone'\)"): s.stop()

class _BlockError(Exception): pass

def _broken_sampler(monkeypatch)->MemorySampler:
    "A started sampler whose thread has failed: every snapshot raises"
    import flexrt.memory.reports
    def failing(device=None): raise OSError('cannot read /proc')     # injected failure of the real snapshot
    monkeypatch.setattr(flexrt.memory.reports, 'memory_snapshot', failing)
    s = MemorySampler(interval_ms=1).start()
    s._thread.join(10)
    return s

def test_sampler_thread_failure_is_raised_at_stop(monkeypatch):
    s = _broken_sampler(monkeypatch)
    assert not s.running
    with pytest.raises(RuntimeError, match=r"sampler thread failed: OSError\('cannot read /proc'\)"): s.stop()
    monkeypatch.undo()
    with s: pass                                                     # usable again once snapshots work
    assert len(s) >= 2

def test_sampler_error_does_not_mask_the_exception_leaving_the_block(monkeypatch):
    s = _broken_sampler(monkeypatch)
    with pytest.warns(RuntimeWarning, match=r"MemorySampler failed too: .*OSError\('cannot read /proc'\)"):
        with pytest.raises(_BlockError, match='the real failure') as caught:
            with s: raise _BlockError('the real failure')
    assert len(caught.value.__notes__) == 1
    assert "the memory sampler thread failed: OSError('cannot read /proc')" in caught.value.__notes__[0]
    assert s._thread is None and not s.running                       # stopped all the same
    monkeypatch.undo()
    with s: pass                                                     # and usable again
    assert not s.running and len(s) >= 2

def test_sampler_error_is_raised_when_the_block_succeeds(monkeypatch):
    s = _broken_sampler(monkeypatch)
    with pytest.raises(RuntimeError, match='sampler thread failed'):
        with s: pass
    assert s._thread is None

def _sample_in_rank(rank, world_size):
    from flexrt import comm as dist
    counted = Counted()
    with TensorMemoryTracker() as tracker, MemorySampler(interval_ms=2, on_sample=counted) as s:
        kept = [torch.empty((rank + 1) * MiB // 4) for _ in range(3)]
        t = torch.full((1000,), float(rank))
        before = tracker.allocated_bytes
        dist.all_reduce(t)                                           # in place: adds nothing
        in_place = tracker.allocated_bytes - before
        gathered = [torch.empty(1000) for _ in range(world_size)]    # outputs made here are counted
        dist.all_gather(gathered, t)
        counted.wait(3)
    df = s.to_dataframe()
    return sorted(set(df['rank'])), int(df.allocated_bytes.max()), len(df), in_place, t[0].item()

def test_sampler_and_tracker_inside_each_rank_with_collectives():
    (ranks0, max0, n0, grew0, sum0), (ranks1, max1, n1, grew1, sum1) = run_distributed(_sample_in_rank, 2)
    assert (ranks0, ranks1) == ([0], [1]) and n0 >= 3 and n1 >= 3
    assert max1 - max0 == 3 * MiB                                    # rank 1 kept 3 MiB more tensors
    assert (grew0, grew1) == (0, 0) and sum0 == sum1 == 1.0

def _in_forked_child(rank, world_size, sampler, lock_was_held):
    sampler.on_sample = None                                        # the parent's counter (its lock may be held) stays there
    was_running = sampler.running
    inherited = len(sampler.snapshots())                            # would hang if the held lock were copied
    sampler.clear()
    with sampler: pass                                               # a sample at start and one at stop
    return was_running, inherited, len(sampler), os.getpid()

def test_sampler_survives_fork():
    held, release = threading.Event(), threading.Event()
    counted = Counted()
    with MemorySampler(interval_ms=2, on_sample=counted) as sampler:
        counted.wait(1)                                              # something to inherit
        def hold():
            with sampler._lock:
                held.set(); release.wait(30)
        th = threading.Thread(target=hold); th.start(); held.wait(10)
        try:
            (was_running, inherited, child_kept, child_pid), = run_distributed(
                _in_forked_child, 1, args=(sampler, True), init=False, timeout=30)
        finally:
            release.set(); th.join()
        assert sampler.running                                       # the parent's sampler is untouched
        parent_count = sampler.num_samples
        counted.wait(parent_count + 1)                               # and it goes on sampling
    assert was_running is False and inherited >= 1 and child_kept >= 2 and child_pid != os.getpid()

# ---- CUDA (skipped on CPU-only machines)

def _cuda_reports(rank, world_size):
    "In a spawned child, so that the pytest process never initialises CUDA (its CPU tests rely on that); spawned, not forked: the skip marks asked CUDA whether a device exists, after which torch refuses CUDA in a forked child"
    assert memory_snapshot().device == 'cpu'                         # CUDA present but not used yet: the CPU
    device = torch.device('cuda', torch.cuda.current_device())
    t = torch.empty(MiB // 4, device=device)
    s = memory_snapshot()
    assert s.device == str(device) and s.tracked                     # now the GPU
    assert s.allocated_bytes == torch.cuda.memory_allocated(device)
    assert s.reserved_bytes == torch.cuda.memory_reserved(device)
    del t
    assert torch.cuda.max_memory_allocated(device) > torch.cuda.memory_allocated(device)
    (line,) = printed(see_memory_usage, 'gpu', force=True)
    assert line.startswith(f'gpu | {device}: allocated ')
    assert torch.cuda.max_memory_allocated(device) == torch.cuda.memory_allocated(device)
    assert get_ma_status() == torch.cuda.memory_allocated(device)
    with TensorMemoryTracker(count_existing=False):                  # CPU tensors next to the GPU's
        c = torch.empty(MiB // 4)
        assert memory_snapshot('cpu').allocated_bytes == MiB
        del c
    return True

@needs_cuda
def test_cuda_snapshot_matches_torch_and_see_memory_usage_resets_peaks():
    assert run_distributed(_cuda_reports, 1, init=False, timeout=60, start_method='spawn') == [True]
