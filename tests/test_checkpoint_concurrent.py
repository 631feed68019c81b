"""Saves that overlap never corrupt: two independent jobs saving the same directory and tag over and over leave a
checkpoint that loads whole, every file from one writer (the DeepSpeed-readable module file included)."""
import subprocess, sys
from pathlib import Path
import pytest, torch
from helpers import run_distributed

WRITER = r'''
import sys, torch
sys.path.insert(0, sys.argv[2])
from helpers import run_distributed
from test_checkpoint_concurrent import save_loop
print(run_distributed(save_loop, 1, args=(sys.argv[1], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == 'async'),
                      timeout=600)[0], flush=True)
'''

def small_engine(seed):
    import flexrt
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    return flexrt.initialize(model=model, config={'train_batch_size': 2, 'steps_per_print': 10**6,
                                                  'optimizer': {'type': 'Adam', 'params': {'lr': 1e-2}}})[0]

def save_loop(rank, world, d, writer, saves, async_save):
    """Train and save tag 't' `saves` times (each asynchronous save waited for by the next); how many saves reported
    success and how many raised CheckpointError"""
    from flexrt.checkpoint import CheckpointError
    from flexrt.checkpoint.async_save import CheckpointWriter
    e, done, refused = small_engine(writer), 0, 0
    saves_of = CheckpointWriter(e)
    for i in range(saves + 1):
        if i:
            e.backward(e(torch.randn(2, 64)).pow(2).mean())
            e.step()
        try:
            saves_of.wait()   # the save before: its outcome
            done += i > 0
        except CheckpointError:
            refused += 1
        if i < saves:
            saves_of.save(d, tag='t', client_state={'writer': writer, 'save': i}, async_save=async_save)
    e.close()
    return done, refused

def load_final(rank, world, d):
    "Load what the writers left: the flexrt files verified by checksum; the DeepSpeed module file's client state"
    from flexrt.checkpoint.storage import safe_load
    e = small_engine(99)
    path, client = e.load_checkpoint(d)
    weights = {k: v.clone() for k, v in e.module.state_dict().items()}
    e.close()
    deepspeed = safe_load(Path(path) / 'mp_rank_00_model_states.pt')
    return path, client, weights, {'writer': deepspeed['writer'], 'save': deepspeed['save']}, deepspeed['module']

@pytest.mark.parametrize('mode', ['sync', 'async'])
def test_two_jobs_saving_one_tag_leave_it_loadable(tmp_path, mode):
    d, script = tmp_path / 'ckpt', tmp_path / 'writer.py'
    script.write_text(WRITER)
    here = str(Path(__file__).parent)
    procs = [subprocess.Popen([sys.executable, str(script), str(d), here, str(w), '40', mode], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for w in (1, 2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    counts = [eval(out.strip().splitlines()[-1]) for out, _ in outs]
    assert all(done + refused == 40 for done, refused in counts), counts
    path, client, weights, deepspeed_client, module = run_distributed(load_final, 1, args=(str(d),))[0]
    assert Path(path) == d / 't' and client['writer'] in (1, 2)
    assert deepspeed_client == client     # DeepSpeed's module file comes from the same save as flexrt's files
    for k, v in module.items():
        assert torch.equal(v, weights[k]), k

def overlapping_rank(rank, world, d):
    """Engine A saves tag 't' asynchronously, its thread held before its first file; engine B (another thread of the
    process) saves 't' meanwhile: it must wait for A's save to publish, then publish its own whole"""
    import threading
    import flexrt.checkpoint.storage as storage
    from flexrt.checkpoint.async_save import CheckpointWriter
    a, b = small_engine(1), small_engine(2)
    writer_a, real, reached, gate = CheckpointWriter(a), storage.atomic_write, threading.Event(), threading.Event()
    def held(path, *args, **kwargs):
        if threading.current_thread().name.startswith('flexrt-checkpoint'):
            reached.set()
            gate.wait()
        return real(path, *args, **kwargs)
    storage.atomic_write = held
    try:
        job = writer_a.save(d, tag='t', client_state={'writer': 'a'}, async_save=True)
        assert reached.wait(60)
        saver = threading.Thread(target=b.save_checkpoint, args=(d, 't', {'writer': 'b'}))
        saver.start()
        blocked = not saver.join(1.0) and saver.is_alive()   # B waits on the directory's lock while A's save is open
    finally:
        gate.set()
        storage.atomic_write = real
    assert writer_a.wait() and bool(job)
    saver.join()
    c = small_engine(3)
    path, client = c.load_checkpoint(d)
    for engine in (a, b, c):
        engine.close()
    return blocked, client

def test_a_save_waits_for_another_save_in_flight_into_the_directory(tmp_path):
    blocked, client = run_distributed(overlapping_rank, 1, args=(str(tmp_path),))[0]
    assert blocked and client == {'writer': 'b'}   # B published after A, whole
