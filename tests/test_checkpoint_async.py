"""Asynchronous checkpoint saves on real gloo ranks: the same files as a synchronous save at every ZeRO stage,
training that goes on bit-exactly, a SIGKILL during the background write that leaves the previous checkpoint in
place, and a background error raised on every rank at the next call."""
import errno, os, signal, subprocess, sys
from pathlib import Path
import pytest, torch
from helpers import run_distributed, checkpoint_tree
from test_checkpoint import engine_for, random_steps, snapshot, make_model, config

def async_engine(stage, writer='process', seed=0):
    "`engine_for(stage, gas=1)` whose asynchronous saves are written by `writer` ('process' or 'thread')"
    import flexrt
    cfg = {**config(stage, gas=1), 'checkpoint': {'async_writer': writer}}
    return flexrt.initialize(model=make_model(seed, 0.1), config=cfg)[0]

def writer_for(engine):
    from flexrt.checkpoint.async_save import CheckpointWriter
    return CheckpointWriter(engine)

# ---------------------------------------------------------------------------------------------------------------
# the same files, and training that goes on as after a synchronous save

def same_files_rank(rank, world, d, stage, writer):
    "Save one state synchronously and asynchronously (then step at once, while the thread may still write)"
    e = async_engine(stage, writer)
    random_steps(e, 2)
    writer = writer_for(e)
    assert writer.save(Path(d, 'sync'), tag='t', client_state={'epoch': 3}) is True
    job = writer.save(Path(d, 'async'), tag='t', client_state={'epoch': 3}, async_save=True)
    random_steps(e, 1)        # changes masters, optimizer state, buffers and generators under the thread
    landed_before = bool(job)
    assert writer.wait() is True and bool(job)
    e.close()
    return landed_before, job.writer

# every stage through the writer process (the default on Linux); the thread writer, where the process cannot run, at
# stage 0 here (the notebook checks it byte for byte in one process too)
@pytest.mark.parametrize('stage,writer', [(0, 'process'), (1, 'process'), (2, 'process'), (3, 'process'),
                                          (0, 'thread')])
def test_async_save_writes_what_a_synchronous_save_writes(tmp_path, stage, writer):
    landed = run_distributed(same_files_rank, 2, args=(str(tmp_path), stage, writer))
    assert landed == [(False, writer)] * 2  # not reported as done before `wait` agreed it landed; written by `writer`
    sync, done = checkpoint_tree(tmp_path / 'sync'), checkpoint_tree(tmp_path / 'async')
    assert sorted(done) == sorted(sync) and 't/rank_00001.pt' in done
    for name in sync:
        assert done[name] == sync[name], name

def resume_rank(rank, world, d, stage, async_save):
    "Train, save, train on (under the background write when async); then a fresh engine loads and trains the same"
    e = engine_for(stage, gas=1)
    random_steps(e, 2)
    writer = writer_for(e)
    writer.save(d, tag='t', async_save=async_save)
    after = random_steps(e, 3)
    writer.close()
    final = snapshot(e)[0]
    e.close()
    e = engine_for(stage, gas=1, seed=5)
    writer = writer_for(e)
    writer.load(d, tag='t')
    resumed = random_steps(e, 3)
    e.close()
    return after, final, resumed

@pytest.mark.parametrize('stage', [1, 3])
def test_training_after_an_async_save_goes_on_bit_exactly(tmp_path, stage):
    sync = run_distributed(resume_rank, 2, args=(str(tmp_path / 's'), stage, False))
    done = run_distributed(resume_rank, 2, args=(str(tmp_path / 'a'), stage, True))
    for rank in range(2):
        (after_s, final_s, resumed_s), (after_a, final_a, resumed_a) = sync[rank], done[rank]
        assert after_a == after_s == resumed_a == resumed_s, rank     # losses and gradient norms, bitwise
        for k, v in final_s.items(): assert torch.equal(final_a[k], v), (rank, k)

def step_at_once_rank(rank, world, d, stage):
    """Save synchronously, then asynchronously with the thread's copies held back until this rank's next optimizer step
    waits for them (its forward and backward run first, then the step changes what the copies read); the same steps
    in a second engine that only saves synchronously"""
    import threading, time
    from unittest import mock
    from flexrt.checkpoint.async_save import DeferredCopies
    e = engine_for(stage, gas=1)
    random_steps(e, 2)
    writer = writer_for(e)
    assert writer.save(Path(d, 'sync'), tag='t', client_state={'epoch': 3}) is True
    real_run, left = DeferredCopies.run, []
    def held(later):                   # the thread's copies: made only once the main thread waits for them
        left.append(len(later.pairs))
        while writer.pending.copy_waited_from is None: time.sleep(0.005)
        time.sleep(0.1)
        real_run(later)
    with mock.patch.object(DeferredCopies, 'run', held):
        job = writer.save(Path(d, 'async'), tag='t', client_state={'epoch': 3}, async_save=True)
        copied_at_return = job.copied.is_set()
        after = random_steps(e, 2)     # the first step waits for the copies, the second does not
    assert writer.wait() is True
    writer.close()
    e.close()
    e = engine_for(stage, gas=1)       # the same steps, saving synchronously only
    random_steps(e, 2)
    writer_for(e).save(Path(d, 'plain'), tag='t', client_state={'epoch': 3})
    plain = random_steps(e, 2)
    e.close()
    return copied_at_return, left, job.step_wait_seconds, after == plain

@pytest.mark.parametrize('stage', [0, 1, 2, 3])
def test_a_step_right_after_an_async_save_waits_for_its_copies_and_changes_nothing_saved(tmp_path, stage):
    results = run_distributed(step_at_once_rank, 2, args=(str(tmp_path), stage))
    for rank, (copied_at_return, left, waited, same_losses) in enumerate(results):
        assert not copied_at_return, rank          # the save returned before the thread copied
        assert waited >= 0.1, (rank, waited)       # the optimizer step waited for the copies
        assert same_losses, rank                   # training went on as after a synchronous save
    left = [n for _, (n,), _, _ in results]
    assert all(n > 0 for n in left), left          # each rank left copies of masters or optimizer state to its thread
    sync, done = checkpoint_tree(tmp_path / 'sync'), checkpoint_tree(tmp_path / 'async')
    assert sorted(done) == sorted(sync)
    for name in sync:
        assert done[name] == sync[name], name     # the state before the step, byte for byte

# ---------------------------------------------------------------------------------------------------------------
# a SIGKILL while the thread writes: the previous checkpoint stays published and loadable

KILL_WORKER = r'''
import sys, threading, torch
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from helpers import run_distributed
from test_checkpoint import engine_for, random_steps
import os, signal
import flexrt.checkpoint.storage as storage
from test_checkpoint_async import async_engine
def loop(rank, world, d, pause_rank, pause_file, who):
    """Save 'one' and wait; save 'two' asynchronously, its write held forever on `pause_rank` before `pause_file`: in
    this process (the thread's writes, rank 0's publication), or by stopping the rank's writer process"""
    from flexrt.checkpoint.async_save import CheckpointWriter
    from flexrt.checkpoint import writer_process as writers
    e = async_engine(1, who)
    writer = CheckpointWriter(e)
    random_steps(e, 1)
    writer.save(d, tag='one', async_save=True)
    writer.wait()
    stop = rank == pause_rank and who == 'process' and pause_file.startswith('rank_')
    if stop:   # the writer process writes nothing more: it holds 'two' before its first file
        os.kill(writers.writer_process().proc.pid, signal.SIGSTOP)
    real = storage.atomic_write
    def held(path, *args, **kwargs):
        if Path(path).name == pause_file and rank == pause_rank and Path(path).parent.name == '.two.partial':
            print('PAUSED', flush=True)
            threading.Event().wait()   # until the SIGKILL
        return real(path, *args, **kwargs)
    storage.atomic_write = held
    random_steps(e, 1)
    writer.save(d, tag='two', async_save=True)
    if stop: print('PAUSED', flush=True)
    random_steps(e, 2)                 # training goes on while the write is held
    writer.wait()
run_distributed(loop, 2, args=(sys.argv[1], int(sys.argv[3]), sys.argv[4], sys.argv[5]), timeout=10**6)
'''

def wait_for_line(proc, text, timeout=120):
    "Block until the worker prints `text` (read from its stdout)"
    import select, time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], deadline - time.monotonic())
        if not ready: break
        line = proc.stdout.readline()
        if not line: raise AssertionError(f'the worker ended (exit code {proc.wait()}) before printing {text}')
        if line.startswith(text): return
    raise AssertionError(f'the worker did not print {text} within {timeout} s')

def load_latest_rank(rank, world, d):
    "Load `latest`, then save again into the directory (the dead writer's lock is gone with it)"
    e = engine_for(1, gas=1, seed=3)
    writer = writer_for(e)
    path, _ = writer.load(d)
    steps = e.global_steps
    writer.save(d, tag='three', async_save=True)
    writer.close()
    e.close()
    return Path(path).name, steps

# where the write is held: rank 1 before its shard (its writer process stopped); rank 0 before the manifest (every
# shard written, not published)
@pytest.mark.parametrize('pause_rank,pause_file,who',
                         [(1, 'rank_00001.pt', 'process'), (0, 'manifest.json', 'process')])
def test_sigkill_during_the_background_write_leaves_the_previous_checkpoint(tmp_path, pause_rank, pause_file, who):
    from flexrt.checkpoint import consolidate, CheckpointError
    from flexrt.checkpoint.layout import read_latest, tag_dir
    d, script = tmp_path / 'ckpt', tmp_path / 'worker.py'
    script.write_text(KILL_WORKER)
    here = str(Path(__file__).parent)
    proc = subprocess.Popen([sys.executable, str(script), str(d), here, str(pause_rank), pause_file, who],
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        wait_for_line(proc, 'PAUSED')
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    assert read_latest(d) == 'one'
    with pytest.raises(CheckpointError, match="no complete checkpoint with tag 'two'"): tag_dir(d, 'two')
    assert len(consolidate(d)) > 0          # every file of 'one' verified by size and checksum
    loaded = run_distributed(load_latest_rank, 2, args=(str(d),))
    assert loaded == [('one', 1), ('one', 1)]
    assert read_latest(d) == 'three'

# ---------------------------------------------------------------------------------------------------------------
# a background error reaches every rank at the next call

def failing_rank(rank, world, d):
    "Three asynchronous saves failing in the background (faults planted in this process); each next call's error"
    import flexrt.checkpoint.storage as storage
    import flexrt.checkpoint.async_save as async_save
    e = async_engine(0, 'thread')
    writer = writer_for(e)
    random_steps(e, 1)
    writer.save(d, tag='good', async_save=True)
    real_write, real_finish, raised = storage.atomic_write, async_save.finish_save, {}
    def full(path, *args, **kwargs):   # rank 1's disk fills up: its shard fails, its marker is still written
        if rank == 1 and Path(path).suffix == '.pt': raise OSError(errno.ENOSPC, 'No space left on device')
        return real_write(path, *args, **kwargs)
    def dead(path, *args, **kwargs):   # rank 1 cannot write at all, not even its marker: rank 0 must not wait for it
        if rank == 1: raise PermissionError(errno.EACCES, 'Permission denied')
        return real_write(path, *args, **kwargs)
    def unpublishable(*args):          # rank 0 fails to publish
        raise OSError(errno.EIO, 'Input/output error')
    cases = [('full', 'atomic_write', full, storage), ('dead', 'atomic_write', dead, storage),
             ('publish', 'finish_save', unpublishable, async_save)]
    for case, name, fake, module in cases:
        writer.wait()   # the save before lands before the fault is in place
        setattr(module, name, fake)
        try:
            writer.save(d, tag=case, async_save=True)   # returns: the fault strikes in the background
            random_steps(e, 1)
            try:
                writer.save(d, tag=f'{case}2', async_save=True) if case == 'full' else writer.wait()
            except Exception as err: raised[case] = f'{type(err).__name__}: {err}'
        finally:
            storage.atomic_write, async_save.finish_save = real_write, real_finish
        assert writer.wait() is True   # nothing in flight: the error was raised once
    writer.save(d, tag='after', async_save=True)
    writer.close()
    e.close()
    return raised

def test_a_background_error_reaches_every_rank_at_the_next_call(tmp_path):
    from flexrt.checkpoint.layout import read_latest, available_tags
    d = tmp_path / 'ckpt'
    results = run_distributed(failing_rank, 2, args=(str(d),), timeout=120)
    assert results[0] == results[1]    # the same error on every rank
    raised = results[0]
    assert raised['full'].startswith("CheckpointError: the asynchronous save of checkpoint 'full'")
    assert 'failed on rank 1: rank 1: ' in raised['full']
    assert 'No space left on device' in raised['full']
    assert 'failed on rank 1' in raised['dead'] and 'Permission denied' in raised['dead']
    assert 'failed on rank 0' in raised['publish'] and 'Input/output error' in raised['publish']
    assert sorted(available_tags(d)) == ['after', 'good'] and read_latest(d) == 'after'
    assert sorted(p.name for p in d.iterdir()) == ['after', 'good', 'latest', 'zero_to_fp32.py']   # no staging left

# ---------------------------------------------------------------------------------------------------------------
# the engine's own surface, once `Engine` holds a `CheckpointWriter`

def engine_surface_rank(rank, world, d):
    e = engine_for(2, gas=1)
    random_steps(e, 1)
    job = e.save_checkpoint(d, tag='t', async_save=True)
    random_steps(e, 1)
    assert e.wait_for_checkpoint() is True and bool(job)
    path, _ = e.load_checkpoint(d)
    e.save_checkpoint(d, tag='u', async_save=True)
    e.close()     # waits for 'u'
    return Path(path).name

def test_engine_save_checkpoint_async(tmp_path):
    from flexrt.checkpoint.layout import read_latest
    assert run_distributed(engine_surface_rank, 2, args=(str(tmp_path),)) == ['t', 't']
    assert read_latest(tmp_path) == 'u'

# ---------------------------------------------------------------------------------------------------------------
# real faults in rank 1's writer process: a file size limit, then the process killed in the middle of a save

def process_fault_rank(rank, world, d):
    import resource
    from flexrt.checkpoint import writer_process as writers
    e = async_engine(0, 'process')
    writer = writer_for(e)
    random_steps(e, 1)
    writer.save(d, tag='good', async_save=True)
    writer.wait()
    raised, pid = {}, writers.writer_process().proc.pid
    if rank == 1:   # the writer process may write files of 1 KiB at most: torch.save fails part-way
        hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)[1]
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (1024, hard))
    writer.save(d, tag='limited', async_save=True)
    random_steps(e, 1)
    try: writer.wait()
    except Exception as err: raised['limited'] = f'{type(err).__name__}: {err}'
    if rank == 1:
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (hard, hard))
        os.kill(pid, signal.SIGSTOP)      # holds the next save ...
    writer.save(d, tag='killed', async_save=True)
    if rank == 1:
        os.kill(pid, signal.SIGKILL)      # ... and dies in it
    random_steps(e, 1)
    try: writer.wait()
    except Exception as err: raised['killed'] = f'{type(err).__name__}: {err}'
    writer.save(d, tag='after', async_save=True)   # a new writer process
    writer.close()
    e.close()
    return raised, writers.writer_process().proc.pid != pid

def test_a_failure_in_the_writer_process_reaches_every_rank(tmp_path):
    from flexrt.checkpoint.layout import read_latest, available_tags
    d = tmp_path / 'ckpt'
    results = run_distributed(process_fault_rank, 2, args=(str(d),), timeout=120)
    assert results[0][0] == results[1][0]    # the same errors on every rank
    raised = results[0][0]
    assert raised['limited'].startswith("CheckpointError: the asynchronous save of checkpoint 'limited'")
    assert 'failed on rank 1: rank 1: RuntimeError' in raised['limited'], raised['limited']
    assert 'failed on rank 1: rank 1: the checkpoint writer process' in raised['killed'], raised['killed']
    assert 'was killed by SIGKILL before it wrote the files' in raised['killed']
    assert results[1][1]                     # rank 1 writes 'after' through a new process
    assert sorted(available_tags(d)) == ['after', 'good'] and read_latest(d) == 'after'
    assert sorted(p.name for p in d.iterdir()) == ['after', 'good', 'latest', 'zero_to_fp32.py']   # no staging left
