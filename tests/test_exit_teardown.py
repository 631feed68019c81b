"""Ranks that never call `destroy_process_group()` get their process group ended at exit by flexrt, while Python is
still alive (flexrt.comm.teardown): under torchrun at interpreter exit, under `flexrt.launch` (forked ranks) at the
child's end, after returning, after `Run.stop()` and after raising. Otherwise gloo can abort the rank at exit
(SIGABRT, "terminate called without an active exception"; `bench/exit_abort.py` counts how often).

Each check is an exit handler that runs after flexrt's and records whether the group is still initialised (and,
under torchrun, whether gloo's threads still run: a destroyed group keeps them while anything references it): an
`atexit` handler registered before flexrt is imported (atexit is last-in, first-out), or a multiprocessing finalizer
of lower priority. With `FLEXRT_EXIT_TEARDOWN=0` every test here fails."""
import os, re, subprocess, sys, threading
from pathlib import Path
import pytest
from helpers import free_port, TORCH_EXIT_ABORT

ROOT = Path(__file__).resolve().parent.parent
CONFIG = {'train_batch_size': 16, 'zero_optimization': {'stage': 0},
          'optimizer': {'type': 'AdamW', 'params': {'lr': 1e-3, 'torch_adam': True}}}

SCRIPT = '''
import atexit, os, sys
import torch.distributed as td
rank = os.environ['RANK']
def gloo_threads():   # gloo's worker and transport threads (Linux names them)
    tasks, names = f'/proc/{os.getpid()}/task', []
    for t in os.listdir(tasks):
        try: names.append(open(f'{tasks}/{t}/comm').read())
        except FileNotFoundError: pass   # the thread ended between the listing and the read
    return sum(n.startswith(('pt_gloo', 'gloo')) for n in names)
def at_exit():   # registered first: runs last
    print(f'rank {rank} at exit: group initialised {td.is_initialized()}, gloo threads {gloo_threads()}', flush=True)
atexit.register(at_exit)

import torch, torch.nn.functional as F
import flexrt
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
engine, *_ = flexrt.initialize(model=model, config=CONFIG)
for step in range(4):
    x = torch.randn(8, 8)
    loss = F.mse_loss(engine(x), x.sum(1, keepdim=True))
    engine.backward(loss)
    engine.step()   # at stages 1-2 the last one leaves its all-gather in flight on flexrt's p2p thread
print(f'rank {rank} trained: group initialised {td.is_initialized()}, gloo threads {gloo_threads()}', flush=True)
if RAISE: raise RuntimeError(f'rank {rank} fails after training')
# no engine.close(), no destroy_process_group(): what the HF Trainer, Accelerate and most scripts do
'''

@pytest.mark.skipif(not sys.platform.startswith('linux'), reason="counts gloo's threads in /proc")
@pytest.mark.parametrize('stage,raises', [(0, False), (2, True)], ids=['stage0-returns', 'stage2-raises'])
def test_torchrun_ranks_end_their_group_before_interpreter_exit(tmp_path, stage, raises):
    script = tmp_path / 'train_no_destroy.py'
    script.write_text(f"CONFIG = {dict(CONFIG, zero_optimization={'stage': stage})!r}\nRAISE = {raises}\n" + SCRIPT)
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', '2', '--master_port', str(free_port()),
           str(script)]
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONPATH': str(ROOT)}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)   # not retried on abort
    out = r.stdout + r.stderr
    assert TORCH_EXIT_ABORT not in out, out[-3000:]
    # the two ranks' prints can interleave within a line
    ended = dict(re.findall(r'(rank \d) at exit: (group initialised \w+, gloo threads \d+)', r.stdout))
    gone = 'group initialised False, gloo threads 0'   # destroyed, and its threads ended while Python was alive
    if raises:   # the first rank to fail ends; torchrun then SIGTERMs the other, which may not get to its exit
        assert r.returncode != 0 and 'fails after training' in out, out[-3000:]
        assert ended and set(ended.values()) == {gone}, out[-3000:]
    else:
        assert r.returncode == 0, out[-3000:]
        assert len(re.findall(r'trained: group initialised True, gloo threads [1-9]', r.stdout)) == 2, out[-3000:]
        assert ended == {'rank 0': gone, 'rank 1': gone}, out[-3000:]
    assert 'flexrt.comm.teardown' not in out, out[-3000:]   # nothing failed or overran in the teardown

# --- ranks forked by flexrt.launch (accelerate's notebook_launcher): multiprocessing children skip atexit -----------
def train_without_destroying(folder:str, steps:int, raises:bool=False):
    "Train `steps` steps (fewer when stopped), never closing; record at the rank's very end whether the group lived"
    import multiprocessing.util, torch, torch.nn.functional as F
    import torch.distributed as td
    import flexrt
    from flexrt.launch import should_stop
    path = Path(folder) / f"rank{os.environ['RANK']}"
    record = lambda: path.write_text(f'{td.is_initialized()}')
    multiprocessing.util.Finalize(None, record, exitpriority=0)   # runs after flexrt's (priority 10)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    engine, *_ = flexrt.initialize(model=model, config=CONFIG)
    for step in range(steps):
        x = torch.randn(8, 8)
        engine.backward(F.mse_loss(engine(x), x.sum(1, keepdim=True)))
        engine.step()
        flexrt.monitor.emit('log', step=step)
        if should_stop(): break
    assert td.is_initialized()
    if raises: raise ValueError('rank fails after training')

@pytest.mark.parametrize('how', ['returns', 'stopped', 'raises'])
def test_launched_ranks_end_their_group_at_their_end(tmp_path, how):
    from flexrt import monitor
    from flexrt.launch import launch, RankError
    if how == 'returns': launch(train_without_destroying, (str(tmp_path), 4), num_processes=2)
    elif how == 'raises':
        with pytest.raises(RankError, match='rank fails after training'):
            launch(train_without_destroying, (str(tmp_path), 4, True), num_processes=2)
    else:
        stepped = threading.Event()
        with monitor.listen(lambda r: r.get('kind') == 'log' and stepped.set()):
            run = launch(train_without_destroying, (str(tmp_path), 100_000), num_processes=2, background=True)
            assert stepped.wait(90)
            run.stop()
            assert run.wait(90) and run.error is None
    ended = {p.name: p.read_text() for p in tmp_path.glob('rank*')}
    if how == 'raises': ended = {k: v for k, v in ended.items() if v}   # the launcher may kill the second rank first
    assert ended and set(ended.values()) == {'False'}, ended
    if how != 'raises': assert sorted(ended) == ['rank0', 'rank1']
