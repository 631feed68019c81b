"""flexrt.launch: a background run stops on every rank at the same step, a crash surfaces with rank and traceback,
signal handlers come back, and no rank outlives the launch."""
import os, signal, sys, threading, time
from pathlib import Path
import psutil, pytest, torch
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
    logs, ten = [], threading.Event()
    def listener(record):
        if record['kind'] == 'log': logs.append((record['rank'], record['step'])); len(logs) >= 10 and ten.set()
    with monitor.listen(listener):
        run = launch(count_until_stopped, (5000,), num_processes=2, background=True)
        assert not run.done                                          # returned at once
        assert ten.wait(90)                                          # ten records arrived while it runs
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


# --- blaming the right rank: the one that died or never arrived, not the survivor that noticed ----------------------
def die_on_rank(rank, after=2):
    "`rank` is SIGKILLed at step `after`; the others wait for it in an all_reduce"
    from flexrt import comm as dist
    dist.init_distributed(timeout=60)
    for step in range(100):
        monitor.log(step=step)
        if step == after and dist.get_rank() == rank:
            monitor.flush()          # the kernel has heard of this rank, as of any rank that ran for a while
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(torch.ones(1))
    dist.destroy_process_group()

def hang_on_rank(rank, after=2, timeout=3):
    "`rank` never enters the all_reduce of step `after`; the others time out in it after `timeout` seconds"
    from flexrt import comm as dist
    dist.init_distributed(timeout=timeout)
    for step in range(100):
        monitor.log(step=step)
        if step == after and dist.get_rank() == rank: threading.Event().wait()   # stuck for good, as a real hang
        dist.all_reduce(torch.ones(1))
    dist.destroy_process_group()

def test_a_killed_rank_is_named_with_its_signal():
    with pytest.raises(RankError) as info: launch(die_on_rank, (1,), num_processes=2)
    error = info.value
    assert (error.rank, error.signal) == (1, 'SIGKILL')
    assert str(error).startswith('rank 1 died: killed by SIGKILL, without reporting an error.')
    # the survivor's own report, as context, where it got it out: torch's elastic agent SIGTERMs the other ranks as
    # soon as it sees one die (it polls every 0.1 s), so on a busy machine rank 0 can be stopped before it reports
    if 'Then rank 0' in str(error):
        assert 'Then rank 0 failed: CommError: all_reduce did not complete' in str(error)

@pytest.mark.parametrize('num_processes', [2, 3])
def test_a_rank_that_never_arrives_is_named_with_the_op_and_who_waited(num_processes):
    with pytest.raises(RankError) as info: launch(hang_on_rank, (1,), num_processes=num_processes)
    error, others = info.value, [r for r in range(num_processes) if r != 1]
    assert (error.rank, error.op, error.waiting) == (1, 'all_reduce', others)
    assert str(error).startswith(f'rank 1 did not arrive at all_reduce: rank{"s" if len(others) > 1 else ""} {others} waited in it')
    assert 'within the timeout of 3s' in str(error)                  # the configured timeout is what ended the wait
    assert 'in hang_on_rank' in error.traceback                      # where rank 1 was: its own stack
