"""flexrt.monitor: listeners get every record, a failing listener is reported once and never breaks the caller,
registration is safe while another thread emits, and the engine builds no record when nobody listens."""
import threading, warnings
import pytest, torch
from flexrt import monitor, comm

@pytest.fixture(autouse=True)
def clean():
    yield
    for fn in monitor.events._listeners: monitor.remove_listener(fn)
    comm.destroy_process_group()

def test_records_reach_every_listener_in_order():
    a, b = [], []
    monitor.add_listener(a.append); monitor.add_listener(b.append)
    for i in range(3): monitor.emit('step', step=i, loss=1.0 / (i + 1))
    assert [r['step'] for r in a] == [r['step'] for r in b] == [0, 1, 2]
    assert a[0]['kind'] == 'step' and a[0]['loss'] == 1.0 and isinstance(a[0]['time'], float)
    assert monitor.remove_listener(a.append) and not monitor.remove_listener(a.append)
    monitor.emit('step', step=3)
    assert len(a) == 3 and len(b) == 4

def test_failing_listener_is_reported_once_and_never_raises():
    calls, good = [], []
    def bad(record): calls.append(record); raise ZeroDivisionError('boom')
    monitor.add_listener(bad); monitor.add_listener(good.append)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for i in range(5): monitor.emit('step', step=i)
    assert len(calls) == 5 and len(good) == 5
    assert len(caught) == 1 and 'ZeroDivisionError: boom' in str(caught[0].message)
    monitor.remove_listener(bad); monitor.add_listener(bad)          # registered afresh: reported afresh
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        monitor.emit('step', step=5)
    assert len(caught) == 1

def test_non_callable_listener_is_rejected():
    with pytest.raises(TypeError, match='must be callable'): monitor.add_listener(42)

def test_listeners_change_while_another_thread_emits():
    seen, stop, errors = [], threading.Event(), []
    def emitter():
        try:
            while not stop.is_set(): monitor.emit('step', step=1)
        except Exception as e: errors.append(e)
    t = threading.Thread(target=emitter); t.start()
    try:
        for _ in range(200):
            monitor.add_listener(seen.append); monitor.remove_listener(seen.append)
    finally:
        stop.set(); t.join()
    assert errors == [] and not monitor.listening()

def test_engine_builds_no_record_when_nobody_listens(monkeypatch):
    import flexrt
    from flexrt.engine import parts
    def forbidden(*a, **k): raise AssertionError('memory_record called with nobody listening')
    monkeypatch.setattr(parts, 'memory_record', forbidden)
    engine, *_ = flexrt.initialize(model=torch.nn.Linear(3, 1), config={'train_batch_size': 2, 'steps_per_print': 1000,
                                   'optimizer': {'type': 'SGD', 'params': {'lr': 0.1}}})
    for _ in range(3): engine.backward(engine(torch.randn(2, 3)).mean()); engine.step()
    assert engine.global_steps == 3
    monkeypatch.undo()                     # the real snapshot again: a listener gets one per step
    seen = []
    with monitor.listen(seen.append):
        engine.backward(engine(torch.randn(2, 3)).mean()); engine.step()
    assert [r['step'] for r in seen] == [4] and seen[0]['memory']['process_rss_bytes'] > 0
    engine.close()


# --- the channel from worker ranks to the kernel ---------------------------------------------------------------
import os, socket
import torch.multiprocessing as tmp

def _free_port():
    from helpers import free_port   # this xdist worker's share of the ports
    return free_port()

def emit_steps(num_steps):
    "A rank: emit `num_steps` step records (module-level, so spawned ranks can import it)"
    rank = int(os.environ.get('RANK', 0))
    for step in range(num_steps): monitor.emit('step', rank=rank, step=step, loss=1.0 / (step + 1), pid=os.getpid())

def spawned_rank(index, num_steps):
    os.environ['RANK'] = str(index)
    emit_steps(num_steps)

@pytest.fixture
def hub():
    hub = monitor.serve()
    yield hub
    monitor.stop_serving()

def _by_rank(records):
    return {r: [x['step'] for x in records if x['rank'] == r] for r in sorted({x['rank'] for x in records})}

def test_plain_notebook_launcher_delivers_every_record_before_it_returns(hub):
    from accelerate import notebook_launcher
    got, callers = [], set()
    def listener(record): got.append(record); callers.add(os.getpid())
    monitor.add_listener(listener)
    notebook_launcher(emit_steps, (50,), num_processes=2, use_port=str(_free_port()))   # forked ranks, no extra args
    steps = [r for r in got if r['kind'] == 'step']                 # no waiting: the ranks flushed before exiting
    assert _by_rank(steps) == {0: list(range(50)), 1: list(range(50))}
    assert callers == {os.getpid()}                                  # listeners ran in this process, never in a rank
    assert {r['pid'] for r in steps}.isdisjoint({os.getpid()}) and hub.num_dropped == 0

def test_spawned_ranks_find_the_kernel_through_the_environment(hub):
    got = []
    monitor.add_listener(got.append)
    tmp.start_processes(spawned_rank, args=(30,), nprocs=2, start_method='spawn')
    assert _by_rank(got) == {0: list(range(30)), 1: list(range(30))}
    assert hub.num_connections == 2

def test_broken_kernel_listener_never_breaks_the_ranks(hub):
    from accelerate import notebook_launcher
    good = []
    def broken(record): raise RuntimeError('widget exploded')
    monitor.add_listener(broken); monitor.add_listener(good.append)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        notebook_launcher(emit_steps, (20,), num_processes=2, use_port=str(_free_port()))
    assert len(good) == 40
    assert [str(w.message) for w in caught if 'widget exploded' in str(w.message)].__len__() == 1

def test_a_slow_kernel_fills_the_buffer_and_the_kernel_learns_the_drop_count(hub):
    "The kernel's listener blocks: the hub stops reading, the socket fills, the sender waits, the buffer overflows"
    release, got = threading.Event(), []
    def slow(record): release.wait(); got.append(record)
    monitor.add_listener(slow)
    fwd, emitted = monitor.Forwarder(hub.address, hub.key, capacity=20, interval=0.001), 0
    while fwd.num_dropped < 100:                                     # emit never waits: the loop ends on drops alone
        fwd({'kind': 'step', 'rank': 0, 'step': emitted, 'pad': 'x' * 2000}); emitted += 1
    release.set(); fwd.flush()
    steps = [r['step'] for r in got]
    assert len(steps) + hub.num_dropped == emitted and hub.num_dropped == fwd.num_dropped >= 100
    assert steps == sorted(set(steps)) and steps[-20:] == list(range(emitted - 20, emitted))   # the oldest went
    fwd.close()

def test_no_hub_means_no_forwarding():
    monitor.stop_serving()
    assert monitor.ADDRESS_VARIABLE not in os.environ
    from helpers import run_distributed
    assert run_distributed(_listening_in_rank, 2, init=False) == [False, False]

def _listening_in_rank(rank, world_size): return monitor.listening()

def test_sinks_write_jsonl_and_csv_that_follow_reads_back(tmp_path):
    jsonl, table = monitor.JSONLSink(tmp_path / 'run-{rank}.jsonl'), monitor.CSVSink(tmp_path / 'steps.csv')
    got = []
    watcher = monitor.follow(tmp_path / 'run-0.jsonl', got.append, interval=0.02)
    with monitor.listen(jsonl), monitor.listen(table):
        for step in range(5): monitor.emit('step', step=step, memory={'allocated_bytes': step})
    jsonl.close(); table.close(); watcher.stop()
    assert [r['step'] for r in got] == list(range(5))
    import pandas as pd
    assert list(pd.read_csv(tmp_path / 'steps.csv')['memory.allocated_bytes']) == list(range(5))

def test_tensorboard_sink_writes_scalars_that_tensorboard_reads_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    sink = monitor.TensorBoardSink(tmp_path / 'tb-{rank}')
    with monitor.listen(sink):
        for step in range(4):
            monitor.emit('step', step=step, loss=2.0 ** -step, lr=[0.1], skipped=step == 2, memory={'allocated_bytes': 8 * step})
        monitor.log(step=7, loss=100.0)                              # not a step record: not written
    sink.close()
    acc = EventAccumulator(str(tmp_path / 'tb-0')); acc.Reload()
    assert sorted(acc.Tags()['scalars']) == ['loss', 'memory.allocated_bytes']
    assert [(e.step, e.value) for e in acc.Scalars('loss')] == [(0, 1.0), (1, 0.5), (2, 0.25), (3, 0.125)]
    assert [e.value for e in acc.Scalars('memory.allocated_bytes')] == [0.0, 8.0, 16.0, 24.0]

def test_tensorboard_sink_says_what_to_install_when_missing(tmp_path, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, 'torch.utils.tensorboard', None)      # as if tensorboard were not installed
    with pytest.raises(ImportError, match='pip install tensorboard'): monitor.TensorBoardSink(tmp_path)


# --- a serving kernel collects garbage before it forks -----------------------------------------------------------
import gc
from helpers import pending_finalisers

def _who_finalises_an_unreachable_cycle(depth:int=1):
    """Fork with an unreachable cycle pending; return the pids whose garbage collection finalised it, and the child's.
    With `depth` > 1 each finaliser leaves a new cycle behind: one collection is then not enough"""
    with pending_finalisers(depth) as finalisers:
        pid = os.fork()
        if pid == 0:
            gc.collect(); os._exit(0)
        os.waitpid(pid, 0)
    return finalisers, pid

def test_serving_kernel_finalises_garbage_itself_before_forking(hub):
    finalisers, child = _who_finalises_an_unreachable_cycle()
    assert finalisers == [os.getpid()]                               # in the kernel, before the fork; never in the rank

def test_serving_kernel_collects_until_no_garbage_is_left(hub):
    finalisers, child = _who_finalises_an_unreachable_cycle(depth=3)   # each finaliser leaves a new cycle
    assert finalisers == [os.getpid()] * 3                           # all three in the kernel; none left to the rank

def test_without_a_hub_fork_is_left_alone():
    monitor.stop_serving()
    finalisers, child = _who_finalises_an_unreachable_cycle()
    assert finalisers == [child, os.getpid()]                        # the child inherited the cycle and finalised it

def test_memory_sampler_records_reach_listeners():
    got, two = [], threading.Event()
    def listener(record): got.append(record); len(got) >= 2 and two.set()
    with monitor.listen(listener), monitor.sample_memory(interval_ms=5, device='cpu') as sampler: assert two.wait(60)
    assert len(got) == sampler.num_samples >= 2 and {r['kind'] for r in got} == {'memory'}
    assert [r['timestamp'] for r in got] == [s.timestamp for s in sampler.snapshots()]

def test_channel_counts_connected_ranks(hub, monkeypatch):
    closed, close_peer = threading.Event(), hub._close_peer
    monkeypatch.setattr(hub, '_close_peer', lambda *a, **k: (close_peer(*a, **k), closed.set()))   # counted, then closed
    fwd = monitor.Forwarder(hub.address, hub.key)
    fwd({'kind': 'log', 'step': 0}); fwd.flush()
    assert monitor.ranks_connected() == 1
    fwd.close()
    assert closed.wait(60)           # the hub notices the closed socket on its own thread
    assert monitor.ranks_connected() == 0
