"""Elastic launches on real gloo ranks: a run that loses a rank goes on at the new world size from its latest
published checkpoint, bit-exactly as a fresh run loaded from that checkpoint; a save cut short by the death is never
resumed; a launch that cannot go on says why, attempt by attempt; torchrun's own restarts resume the same way, on one node
and on a node of two that lost the other."""
import json, os, signal, subprocess, sys, textwrap
from pathlib import Path
import pytest, torch
from flexrt import monitor
from flexrt.launch import launch, RankError

CONFIG = {'train_batch_size': 12, 'train_micro_batch_size_per_gpu': 2, 'steps_per_print': 10**6,
          'optimizer': {'type': 'Adam', 'params': {'lr': 0.01}}}


def train_step(engine, step:int, rank:int, gas:int) -> list:
    "One optimizer step on this rank's `gas` micro-batches of step `step`'s 12 samples (the same every run): the losses"
    x = torch.randn(12, 8, generator=torch.Generator().manual_seed(1000 + step))
    y = x.sum(1, keepdim=True).sin()
    losses = []
    for k in range(gas):
        at = (rank * gas + k) * 2           # this rank's k-th micro-batch of the step's 12 samples
        loss = ((engine(x[at:at + 2]) - y[at:at + 2]) ** 2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses

def train(directory, stage=0, steps=10, save_at=(5,), kill=None, kill_in_save=None, load_tag=None):
    """A tiny regression on 12 samples per step (the same 12 at any world size), saved into `directory` after each step
    of `save_at`; `kill=(rank, step)` SIGKILLs that rank after that step ('last': the highest rank of the attempt);
    `kill_in_save=(rank, step)` SIGKILLs it while it writes its file of the save after that step. Returns where the
    attempt started, its world size and accumulation, and each step's micro-batch losses on this rank"""
    import flexrt
    from flexrt import comm as dist
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    engine, *_ = flexrt.initialize(model=model, config={**CONFIG, 'zero_optimization': {'stage': stage}})
    if load_tag is not None:
        engine.load_checkpoint(directory, tag=load_tag)
    rank, world, gas = dist.get_rank(), dist.get_world_size(), engine.gradient_accumulation_steps()
    start, losses = engine.global_steps, {}
    for step in range(start, steps):
        losses[step + 1] = train_step(engine, step, rank, gas)
        done = engine.global_steps
        if kill_in_save is not None and (rank, done) == kill_in_save:
            _die_while_writing(f'.global_step{done}.partial')
        if done in save_at:
            engine.save_checkpoint(directory)
        if kill is not None and (world - 1 if kill[0] == 'last' else kill[0]) == rank and done == kill[1]:
            monitor.flush()                     # the kernel has seen this rank's steps, as it would after a while
            os.kill(os.getpid(), signal.SIGKILL)
    engine.close()
    return {'start': start, 'world': world, 'gas': gas, 'losses': losses}

def _die_while_writing(staging: str):
    "SIGKILL this process when it starts writing a file into the staging directory `staging` (the save is unpublished)"
    import flexrt.checkpoint.storage as storage
    real = storage.atomic_write
    def dying(path, *args, **kwargs):
        if Path(path).parent.name == staging:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(path, *args, **kwargs)
    storage.atomic_write = dying

@pytest.fixture(autouse=True)
def clean():
    yield
    monitor.stop_serving()

def _launch(*args, **kwargs):
    "launch(), with the kernel's records of the run"
    records = []
    with monitor.listen(records.append):
        run = launch(*args, **kwargs)
    return run, records

@pytest.mark.parametrize('stage', [0, 3])
def test_a_run_that_loses_a_rank_goes_on_bit_exactly_from_its_checkpoint(tmp_path, stage):
    from flexrt.widgets.dashboard import TrainingDashboard
    d, dash = tmp_path / 'ckpt', TrainingDashboard(redraw=False)
    try:
        run, records = _launch(train, (str(d), stage, 10, (5,), (2, 7)), num_processes=3, max_restarts=1,
                               checkpoint_dir=d)
        dash.draw_text()
    finally:
        dash.close()
    assert 'attempt 1: 3 &rarr; 2 ranks (rank 2 died: killed by SIGKILL' in dash.restarts.value   # one run, marked
    assert dash.restarts.value.endswith('from step 5, 2 steps done again')
    steps = dash.records.frame('step').query('rank == 0')['step'].tolist()
    assert steps[:5] == [1, 2, 3, 4, 5] and steps[-5:] == [6, 7, 8, 9, 10]          # both attempts, one history
    # each step record says its attempt and world size: attempt 0 on 3 ranks up to step 7 (its last records may die
    # with the ranks the launcher kills), attempt 1 on 2 ranks from step 6
    labels = {(r['step'], r['attempt'], r['world_size']) for r in records if r['kind'] == 'step' and r['rank'] == 0}
    first_attempt = {label for label in labels if label[1] == 0}
    assert {(s, 0, 3) for s in range(1, 6)} <= first_attempt <= {(s, 0, 3) for s in range(1, 8)}, sorted(labels)
    assert labels - first_attempt == {(s, 1, 2) for s in range(6, 11)}, sorted(labels)
    first, second = run.attempts
    assert (first.world_size, first.lost_ranks, first.last_step) == (3, [2], 7)
    assert first.cause.startswith('rank 2 died: killed by SIGKILL')
    assert (second.world_size, second.resumed_step, second.lost_steps, second.cause) == (2, 5, 2, None)
    assert run.lost_steps == 2 and len(run.results) == 2
    assert [(r['start'], r['world'], r['gas']) for r in run.results] == [(5, 2, 3), (5, 2, 3)]   # global batch 12 kept
    restart = next(r for r in records if r['kind'] == 'restart')
    assert (restart['attempt'], restart['world_size'], restart['previous_world_size']) == (1, 2, 3)
    resume = next(r for r in records if r['kind'] == 'resume')
    assert (resume['world_size'], resume['resumed_step'], resume['lost_steps']) == (2, 5, 2)
    assert resume['batch_changes'] == {'gradient_accumulation_steps': [2, 3]}
    # a fresh 2-rank run of the same function, loading the step-5 checkpoint by hand
    fresh = launch(train, (str(d), stage, 10, (), None, None, 'global_step5'), num_processes=2)
    for rank in (0, 1):
        assert list(run.results[rank]['losses']) == list(range(6, 11))
        assert run.results[rank]['losses'] == fresh.results[rank]['losses'], rank      # floats: bit-equal

def test_a_save_cut_short_by_the_death_is_not_resumed(tmp_path):
    d = tmp_path / 'ckpt'
    run, _ = _launch(train, (str(d), 0, 8, (3, 6), None, (2, 6)), num_processes=3, max_restarts=1, checkpoint_dir=d)
    first, second = run.attempts
    assert first.lost_ranks == [2] and first.cause.startswith('rank 2 died: killed by SIGKILL')
    assert second.resumed_step == 3                  # global_step6 was being written: `latest` still named step 3
    assert [r['start'] for r in run.results] == [3, 3]
    assert (d / 'latest').read_text().strip() == 'global_step6'     # written whole by the restarted attempt

def test_a_launch_gives_up_after_max_restarts_listing_every_attempt(tmp_path):
    with pytest.raises(RankError) as info:
        launch(train, (str(tmp_path), 0, 10, (), ('last', 2)), num_processes=3, max_restarts=1, checkpoint_dir=tmp_path)
    error = info.value
    assert str(error).startswith('the launch gave up after 2 attempts: max_restarts=1 reached\n'
                                 '  attempt 0 (3 ranks): rank 2 died: killed by SIGKILL')
    assert '\n  attempt 1 (2 ranks): rank 1 died: killed by SIGKILL' in str(error)
    assert [(a.world_size, a.lost_ranks) for a in error.attempts] == [(3, [2]), (2, [1])]
    assert (error.rank, error.signal) == (1, 'SIGKILL')          # the last attempt's culprit

def test_a_launch_gives_up_below_min_processes(tmp_path):
    with pytest.raises(RankError) as info:
        launch(train, (str(tmp_path), 0, 10, (), (1, 2)), num_processes=2, max_restarts=3, min_processes=2,
               checkpoint_dir=tmp_path)
    assert str(info.value).startswith('the launch gave up after 1 attempts: 1 rank survived, fewer than '
                                      'min_processes=2\n  attempt 0 (2 ranks): rank 1 died: killed by SIGKILL')

def deaf_survivor():
    "Rank 1 dies at once; rank 0 ignores SIGTERM (a handler of its own) and computes without a collective"
    from flexrt import comm as dist
    import time
    dist.init_distributed()
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        time.sleep(0.05)

def test_a_survivor_that_ignores_sigterm_is_killed_after_the_grace():
    # torchelastic would wait 30 s for it, then SIGKILL it too (and it would count as lost): the launcher kills it
    # FAILURE_GRACE_S after the death it noticed, and knows that death was its own doing
    run = launch(deaf_survivor, num_processes=2, background=True)
    with pytest.raises(RankError, match='rank 1 died: killed by SIGKILL'): run.wait(120)
    assert run.attempts[0].lost_ranks == [1]

def test_restart_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match='max_restarts must be a non-negative int'): launch(print, max_restarts=-1)
    with pytest.raises(ValueError, match='min_processes must be an int from 1 to num_processes=2'):
        launch(print, max_restarts=1, min_processes=3)
    with pytest.raises(TypeError, match='checkpoint_dir must be a path'): launch(print, checkpoint_dir=3)
    with pytest.raises(ValueError, match='on several nodes use torchrun'):
        launch(print, max_restarts=1, num_nodes=2, results=None)

TORCHRUN_SCRIPT = '''
import json, os, signal, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import torch, flexrt
from flexrt import comm as dist
from test_elastic import CONFIG
marker, out = Path(sys.argv[2]), Path(sys.argv[3])
torch.manual_seed(0)
engine, *_ = flexrt.initialize(model=torch.nn.Linear(8, 1), config=CONFIG)
start = engine.global_steps
for step in range(start, 6):
    for k in range(engine.gradient_accumulation_steps()):
        engine.backward(engine(torch.ones(2, 8)).sum())
        engine.step()
    if engine.global_steps == 3:
        engine.save_checkpoint(os.environ['FLEXRT_CHECKPOINT_DIR'])
    if engine.global_steps == 4 and dist.get_rank() == 1 and not marker.exists():
        marker.touch()                       # once: the restarted group goes on
        os.kill(os.getpid(), signal.SIGKILL)
if dist.get_rank() == 0:
    out.write_text(json.dumps({'start': start, 'restarts': os.environ.get('TORCHELASTIC_RESTART_COUNT'),
                               'steps': engine.global_steps}))
engine.close()
'''

def test_torchrun_max_restarts_resumes_through_initialize(tmp_path):
    script, out = tmp_path / 'train.py', tmp_path / 'out.json'
    script.write_text(TORCHRUN_SCRIPT)
    # torch >= 2.5 shares torchrun's rendezvous store with the workers, and a restarted group then reads the old
    # group's addresses (pytorch/pytorch#135712): a store of their own per restart
    env = {**os.environ, 'FLEXRT_CHECKPOINT_DIR': str(tmp_path / 'ckpt'), 'OMP_NUM_THREADS': '1',
           'TORCH_DISABLE_SHARE_RDZV_TCP_STORE': '1'}
    for name in ('FLEXRT_ATTEMPT', 'FLEXRT_PREVIOUS_ATTEMPT', 'FLEXRT_MONITOR_ADDRESS'): env.pop(name, None)
    torchrun = Path(sys.executable).parent / 'torchrun'
    done = subprocess.run([str(torchrun), '--standalone', '--nproc-per-node', '2', '--max-restarts', '1',
                           str(script), str(Path(__file__).parent), str(tmp_path / 'marker'), str(out)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(out.read_text()) == {'start': 3, 'restarts': '1', 'steps': 6}

# Two torchrun agents on this machine stand for two nodes of one rank each (`--nnodes=1:2`). The first agent hosts the
# rendezvous store (`is_host=1`): the store lives in that agent's process, so the node that dies must be the other one.
# A dead node leaves the rendezvous once its heartbeats are `keep_alive_interval` x `keep_alive_max_attempt` seconds
# old; the survivor then waits `last_call_timeout` for more nodes before it goes on alone (torch's defaults: 15 s and
# 30 s). torchrun starts each worker in a session of its own, so a node's death is its agent's process group and its
# worker, both SIGKILLed.
MULTINODE_SCRIPT = '''
import json, os, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import torch, flexrt
from flexrt import comm as dist
from test_elastic import CONFIG, train_step
out, load_tag = Path(sys.argv[2]), (sys.argv[3] if len(sys.argv) > 3 else None)
restarts = int(os.environ.get('TORCHELASTIC_RESTART_COUNT', '0'))
if restarts == 0 and os.environ.get('WORLD_SIZE') == '1' and load_tag is None:
    time.sleep(600)     # the first rendezvous closed before the other node came: torchrun restarts this worker with it
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
engine, *_ = flexrt.initialize(model=model, config=CONFIG)
directory = os.environ['FLEXRT_CHECKPOINT_DIR']
if load_tag is not None:
    engine.load_checkpoint(directory, tag=load_tag)
rank, world, gas = dist.get_rank(), dist.get_world_size(), engine.gradient_accumulation_steps()
start, losses = engine.global_steps, {}
for step in range(start, 6):
    losses[step + 1] = train_step(engine, step, rank, gas)
    if engine.global_steps == 3 and load_tag is None:
        engine.save_checkpoint(directory)
    if engine.global_steps == 4 and restarts == 0 and load_tag is None:
        (out / f'at4.{rank}').write_text(json.dumps({'pid': os.getpid(), 'agent': os.getppid(), 'world': world}))
        while not (out / 'go').exists():    # the test kills the other node meanwhile
            time.sleep(0.05)
engine.close()
if rank == 0:
    result = {'start': start, 'restarts': restarts, 'world': world, 'gas': gas, 'losses': losses}
    (out / ('fresh.json' if load_tag else 'out.json')).write_text(json.dumps(result))
'''

def _agent(script, tmp_path, port, env, host: bool):
    "One node: a torchrun agent of one rank, in a process group of its own, its output in <tmp_path>/<a|b>.log"
    conf = f'is_host={int(host)},keep_alive_interval=1,keep_alive_max_attempt=2,last_call_timeout=2,join_timeout=120'
    log = open(tmp_path / ('a.log' if host else 'b.log'), 'w')
    torchrun = Path(sys.executable).parent / 'torchrun'
    return subprocess.Popen([str(torchrun), '--nnodes=1:2', '--nproc-per-node=1', '--rdzv-backend=c10d',
                             f'--rdzv-endpoint=127.0.0.1:{port}', f'--rdzv-id=flexrt-{port}', f'--rdzv-conf={conf}',
                             '--max-restarts=1', str(script), str(Path(__file__).parent), str(tmp_path)],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

def _stop(proc, workers, script):
    """SIGTERM a node's agent (it stops its worker), then SIGKILL what is left of it, and of the `workers` (pids) still
    running `script`"""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try: proc.wait(timeout=15)
        except subprocess.TimeoutExpired: os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for pid in workers:
        try:
            if str(script) in Path(f'/proc/{pid}/cmdline').read_bytes().decode(errors='replace'):
                os.kill(pid, signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError): pass

def test_torchrun_on_one_to_two_nodes_goes_on_at_one_node_through_initialize(tmp_path):
    import time
    from helpers import free_port
    script = tmp_path / 'train.py'
    script.write_text(MULTINODE_SCRIPT)
    env = {**os.environ, 'FLEXRT_CHECKPOINT_DIR': str(tmp_path / 'ckpt'), 'OMP_NUM_THREADS': '1',
           'TORCH_DISABLE_SHARE_RDZV_TCP_STORE': '1'}    # see test_torchrun_max_restarts_resumes_through_initialize
    for name in ('FLEXRT_ATTEMPT', 'FLEXRT_PREVIOUS_ATTEMPT', 'FLEXRT_MONITOR_ADDRESS'): env.pop(name, None)
    port, workers = free_port(), []
    survivor = _agent(script, tmp_path, port, env, host=True)
    victim = _agent(script, tmp_path, port, env, host=False)
    logs = lambda: '\n'.join(f'--- {n} ---\n' + (tmp_path / n).read_text()[-3000:] for n in ('a.log', 'b.log'))
    try:
        deadline = time.monotonic() + 120
        while len(marks := list(tmp_path.glob('at4.*'))) < 2:           # both ranks trained 4 steps, saved step 3
            assert survivor.poll() is None and victim.poll() is None, logs()
            assert time.monotonic() < deadline, logs()
            time.sleep(0.05)
        at4 = [json.loads(p.read_text()) for p in marks]
        workers = [m['pid'] for m in at4]
        assert sorted(m['world'] for m in at4) == [2, 2] and {m['agent'] for m in at4} == {survivor.pid, victim.pid}
        os.killpg(victim.pid, signal.SIGKILL)                          # the other node dies: its agent...
        os.kill(next(m['pid'] for m in at4 if m['agent'] == victim.pid), signal.SIGKILL)   # ...and its worker
        victim.wait()
        (tmp_path / 'go').touch()      # the survivor's worker goes on into a collective with the dead one, and fails
        assert survivor.wait(timeout=180) == 0, logs()
    finally:
        _stop(survivor, workers, script)
        _stop(victim, workers, script)
    resumed = json.loads((tmp_path / 'out.json').read_text())
    # torchrun restarted the survivor's worker once, on one node; flexrt.initialize resumed it from step 3
    assert {k: resumed[k] for k in ('start', 'restarts', 'world', 'gas')} == {'start': 3, 'restarts': 1, 'world': 1,
                                                                              'gas': 6}   # global batch 12 kept
    # a fresh 1-rank run of the same script, loading the step-3 checkpoint by hand
    fresh = subprocess.run([sys.executable, str(script), str(Path(__file__).parent), str(tmp_path), 'global_step3'],
                           env=env, capture_output=True, text=True, timeout=120)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    fresh = json.loads((tmp_path / 'fresh.json').read_text())
    assert list(resumed['losses']) == ['4', '5', '6'] and fresh['start'] == 3
    assert resumed['losses'] == fresh['losses']                                     # floats: bit-equal
