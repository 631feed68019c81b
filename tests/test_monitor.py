"""flexrt.monitor: listeners get every record, a failing listener is reported once and never breaks the caller,
registration is safe while another thread emits, and the engine builds no record when nobody listens."""
import threading, warnings
import pytest, torch
from flexrt import monitor, comm

@pytest.fixture(autouse=True)
def clean():
    yield
    for fn in monitor._listeners: monitor.remove_listener(fn)
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
    def forbidden(*a, **k): raise AssertionError('memory_snapshot called with nobody listening')
    monkeypatch.setattr(parts, 'memory_snapshot', forbidden)
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
