"""flexrt.launch: a background run stops on every rank at the same step, a crash surfaces with rank and traceback,
signal handlers come back, and no rank outlives the launch."""
import os, signal, sys, time
from pathlib import Path
import psutil, pytest
from flexrt import monitor
from flexrt.launch import launch, RankError

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / 'examples'))
from quickstart_train import count_until_stopped, fail_on_rank

@pytest.fixture(autouse=True)
def clean():
    yield
    monitor.stop_serving()

def _alive(pids): return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]

def test_background_run_stops_every_rank_at_the_same_step():
    logs = []
    with monitor.listen(lambda r: r['kind'] == 'log' and logs.append((r['rank'], r['step']))):
        run = launch(count_until_stopped, (5000,), num_processes=2, background=True)
        assert not run.done                                          # returned at once
        deadline = time.time() + 90
        while len(logs) < 10 and time.time() < deadline: time.sleep(0.05)   # poll: the ranks' records arrive from other processes
        run.stop()
        assert run.wait(90)
    assert run.done and run.error is None and len(run.pids) == 2
    last = {rank: max(s for r, s in logs if r == rank) for rank in (0, 1)}
    assert last[0] == last[1] < 4999                                 # stopped early, together
    assert sorted(s for r, s in logs if r == 0) == list(range(last[0] + 1))
    assert _alive(run.pids) == []

def test_crash_on_one_rank_names_the_rank_and_its_traceback_and_restores_signals():
    def mine(signum, frame): pass
    previous = signal.signal(signal.SIGINT, mine)
    try:
        with pytest.raises(RankError, match='rank 1 failed with ValueError: bad batch at step 2') as info:
            launch(fail_on_rank, (1,), num_processes=2)
        assert signal.getsignal(signal.SIGINT) is mine
    finally: signal.signal(signal.SIGINT, previous)
    assert info.value.rank == 1 and 'in fail_on_rank' in info.value.traceback
    assert 'Traceback on rank 1' in str(info.value)

def test_no_rank_outlives_a_crash():
    seen = []
    with monitor.listen(lambda r: r['kind'] == 'rank_start' and seen.append(r['pid'])):
        with pytest.raises(RankError): launch(fail_on_rank, (0, 1), num_processes=2)
    assert len(seen) == 2 and _alive(seen) == []

def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match='num_processes must be a positive int'): launch(print, num_processes=0)
    with pytest.raises(TypeError, match='train must be a function'): launch('train.py')
    import flexrt.launch                                             # the module is callable: flexrt.launch(train, ...)
    with pytest.raises(ValueError, match='num_processes must be a positive int'): flexrt.launch(print, num_processes=-1)
