"""Every way a user starts flexrt's ranks, hammered: each launch path N times with one core kept busy, at ZeRO stages
0 and 3, counting what must never happen.

    python bench/launch_stress.py [--reps 30] [--paths launch,launch-bg,...] [--stages 0,3] [--steps 6] [--no-load]
                                  [--timeout 240] [--log-dir DIR]

The paths (2 ranks unless the name says 3):

- `launch`, `launch-bg`, `launch-stop`, `launch-3`: `flexrt.launch` in the foreground, in the background (then
  `run.wait()`), in the background and stopped midway (`run.stop()` once every rank sent its first step), and at 3
  ranks;
- `notebook_launcher`: `accelerate.notebook_launcher`;
- `torchrun`, `torchrun-3`: `torchrun --nproc_per_node N` on a script calling `flexrt.initialize`;
- `accelerate`: `accelerate launch` on the same script;
- `accelerate-ds`: `accelerate launch --use_deepspeed` in a throwaway environment where
  `python -m flexrt.deepspeed --install-alias` ran: Accelerate's DeepSpeed path, served by flexrt;
- `flexrt.deepspeed`: `torchrun -m flexrt.deepspeed` on a DeepSpeed script (`deepspeed.initialize`), unmodified.

Each run is a fresh driver process, as a fresh kernel or shell would be: it serves flexrt.monitor's hub and counts the
step records that reach it (what a dashboard counts), launches, and reports. The ranks train `--steps` steps and
exit without `engine.close()` or `destroy_process_group()` (what most scripts do); each writes how many steps it took.
Counted per path and stage:

- aborts: a rank killed by SIGABRT, or gloo's "terminate called without an active exception";
- hangs: the driver still running after `--timeout` seconds (killed with its process group);
- other failures: any other non-zero exit, with the first one's tail;
- orphans: processes of the run still alive 10 s after the launch returned;
- shared memory left: `/dev/shm` entries that name one of the run's processes, still there after it;
- lost records: step records the ranks emitted that the driver's listener did not get (the dashboard's count).

A one-core load generator (a busy-loop process) runs for the whole benchmark unless `--no-load`. The ranks run a copy
of the committed `flexrt/` (`git archive HEAD`) and of this file, so edits made to the tree while it runs do not mix in.
"""
import argparse, collections, json, os, re, shutil, signal, subprocess, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ABORT = 'terminate called without an active exception'
PATHS = ('launch', 'launch-bg', 'launch-stop', 'launch-3', 'notebook_launcher', 'torchrun', 'torchrun-3', 'accelerate',
         'accelerate-ds', 'flexrt.deepspeed')
IN_PROCESS = ('launch', 'launch-bg', 'launch-stop', 'launch-3', 'notebook_launcher')

def config(stage:int)->dict:
    return {'train_micro_batch_size_per_gpu': 4, 'gradient_accumulation_steps': 1,
            'zero_optimization': {'stage': stage}, 'steps_per_print': 10**9,
            'optimizer': {'type': 'AdamW', 'params': {'lr': 1e-3, 'torch_adam': True}}}

def num_ranks(path:str)->int: return 3 if path.endswith('-3') else 2

# ---- the ranks -----------------------------------------------------------------------------------------------------
def _model():
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))

def _train(engine, step, steps:int, out:str, stop_aware:bool=True):
    "`steps` steps of `step(x, y)` (fewer when stopped); write this rank's count to `out`"
    import torch
    from flexrt.launch import should_stop
    rank = int(os.environ.get('RANK', 0))
    g, done = torch.Generator().manual_seed(rank), 0
    for _ in range(steps):
        x = torch.randn(4, 8, generator=g)
        step(x, x.sum(1, keepdim=True).sin())
        done += 1
        if stop_aware and should_stop(): break
    Path(out, f'rank{rank}.json').write_text(json.dumps({'steps': done, 'pid': os.getpid()}))
    # no engine.close(), no destroy_process_group(): what the Trainer, Accelerate and most scripts do

def rank_flexrt(out:str, steps:int, stage:int, api:str='flexrt'):
    "`flexrt.initialize` (or `deepspeed.initialize`, flexrt aliased as deepspeed)"
    import torch.nn.functional as F
    if api == 'deepspeed': import deepspeed as api_module   # flexrt, by `python -m flexrt.deepspeed`
    else: import flexrt as api_module
    model = _model()
    engine, *_ = api_module.initialize(model=model, model_parameters=model.parameters(), config=config(stage))
    def step(x, y):
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
    _train(engine, step, steps, out)

def rank_accelerate(out:str, steps:int, stage:int):
    "Accelerate's own loop; with `--use_deepspeed` its DeepSpeed engine is flexrt's (the alias)"
    import torch, torch.nn.functional as F
    from accelerate import Accelerator
    accelerator = Accelerator()
    model = _model()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    def step(x, y):
        loss = F.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    _train(model, step, steps, out)

# ---- one run: the driver (a fresh process, as a fresh kernel or shell) --------------------------------------------
def _shm(pids:set)->list:
    "The /dev/shm entries that name one of `pids`"
    try: names = os.listdir('/dev/shm')
    except FileNotFoundError: return []
    return sorted(n for n in names if any(re.search(rf'(?<!\d){p}(?!\d)', n) for p in pids))

def _command(path:str, script:Path, out:str, steps:int, stage:int, alias_python:str|None)->list:
    "The command line a user types for a command-line path"
    from flexrt.launch import free_port
    n, port = str(num_ranks(path)), str(free_port())
    args = ['--rank-out', out, '--steps', str(steps), '--stage', str(stage)]
    torchrun = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', n, '--master_port', port]
    if path in ('torchrun', 'torchrun-3'): return torchrun + [str(script), '--rank', 'flexrt'] + args
    if path == 'flexrt.deepspeed':
        return torchrun + ['-m', 'flexrt.deepspeed', str(script), '--rank', 'deepspeed'] + args
    accelerate = ['-m', 'accelerate.commands.launch', '--num_processes', n, '--num_machines', '1', '--mixed_precision',
                  'no', '--dynamo_backend', 'no', '--main_process_port', port]
    if path == 'accelerate':   # without --multi_gpu, accelerate starts one process on a machine without a GPU
        return [sys.executable] + accelerate + ['--multi_gpu', str(script), '--rank', 'flexrt'] + args
    ds_config = Path(out) / 'ds_config.json'   # the optimizer comes from the code (Accelerate refuses both)
    ds_config.write_text(json.dumps({k: v for k, v in config(stage).items() if k != 'optimizer'}))
    return [alias_python] + accelerate + ['--use_deepspeed', '--deepspeed_config_file', str(ds_config), str(script),
                                          '--rank', 'accelerate'] + args

def drive(a)->dict:
    "Run one launch of `a.drive`; return what happened (printed as JSON for the bench)"
    import psutil
    from flexrt import monitor
    from flexrt.launch import launch
    out = tempfile.mkdtemp(prefix='stress-ranks-')
    records = collections.Counter()
    monitor.serve()   # the hub a dashboard starts; ranks launched from here forward to it (its address: os.environ)
    monitor.add_listener(lambda r: r.get('kind') == 'step' and records.update([r.get('rank')]))
    path, n, args = a.drive, num_ranks(a.drive), (out, a.steps, a.stage)
    result, me = {'path': path, 'stage': a.stage, 'error': None, 'exit': 0, 'output': ''}, psutil.Process()
    try:
        if path in ('launch', 'launch-3'): launch(rank_flexrt, args, num_processes=n)
        elif path == 'launch-bg': launch(rank_flexrt, args, num_processes=n, background=True).wait(a.timeout)
        elif path == 'launch-stop':
            run = launch(rank_flexrt, (out, 10**6, a.stage), num_processes=n, background=True)
            deadline = time.monotonic() + a.timeout
            while len(records) < n and not run.done and time.monotonic() < deadline: time.sleep(0.05)
            run.stop()
            run.wait(a.timeout)
        elif path == 'notebook_launcher':
            from accelerate import notebook_launcher
            notebook_launcher(rank_flexrt, args, num_processes=n)
        else:
            cmd = _command(path, Path(__file__).resolve(), out, a.steps, a.stage, a.alias_python)
            r = subprocess.run(cmd, capture_output=True, text=True, cwd=out)
            result.update(exit=r.returncode, output=r.stdout[-4000:] + r.stderr[-8000:])
    except BaseException as e:   # a RankError names the rank and its signal
        result.update(error=f'{type(e).__name__}: {e}', exit=1)
    launched = time.monotonic()
    ranks = {int(f.stem[4:]): json.loads(f.read_text()) for f in Path(out).glob('rank*.json')}
    expected = sum(r['steps'] for r in ranks.values())
    while sum(records.values()) < expected and time.monotonic() - launched < 10: time.sleep(0.05)   # in flight
    pids = {me.pid} | {r['pid'] for r in ranks.values()}
    while time.monotonic() - launched < 10 and any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                                                   for p in me.children(recursive=True)): time.sleep(0.1)
    orphans = [p.pid for p in me.children(recursive=True) if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    orphans += [pid for pid in pids - {me.pid} if psutil.pid_exists(pid)
                and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE and pid not in orphans]
    text = (result['error'] or '') + result['output']
    result.update(ranks_reported=len(ranks), ranks=n, steps=expected, records=sum(records.values()),
                  lost=max(expected - sum(records.values()), 0), orphans=orphans, shm=_shm(pids),
                  abort=ABORT in text or bool(re.search(r'exitcode\s*:\s*-6\b|SIGABRT|signal 6\b', text)))
    monitor.stop_serving()
    shutil.rmtree(out, ignore_errors=True)
    return result

# ---- the bench ---------------------------------------------------------------------------------------------------
def snapshot(folder:Path)->Path: # the copy of this file to run
    "The committed flexrt/ (git archive HEAD) and this file, laid out as here"
    archive = subprocess.run(['git', 'archive', 'HEAD', 'flexrt'], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(['tar', 'x', '-C', str(folder)], input=archive, check=True)
    (folder / 'bench').mkdir()
    return Path(shutil.copy(__file__, folder / 'bench'))

def classify(result:dict)->str:
    if result.get('hung'): return 'hang'
    if result['abort']: return 'abort'
    if result['exit'] != 0 or result['error'] or result['ranks_reported'] < result['ranks']: return 'failed'
    return 'ok'

def run_once(script:Path, path:str, stage:int, a, alias_python:str|None)->dict:
    env = {**os.environ, 'PYTHONPATH': str(script.parent.parent), 'DS_ACCELERATOR': 'cpu'}
    for name in ('FLEXRT_MONITOR_ADDRESS', 'FLEXRT_MONITOR_KEY', 'FLEXRT_MONITOR_OWNER', 'FLEXRT_STOP_FILE'):
        env.pop(name, None)   # a fresh shell's environment
    cmd = [sys.executable, str(script), '--drive', path, '--stage', str(stage), '--steps', str(a.steps),
           '--timeout', str(a.timeout)] + (['--alias-python', alias_python] if alias_python else [])
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    try: stdout, stderr = p.communicate(timeout=a.timeout + 30)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        stdout, stderr = p.communicate()
        said = f'hung: no exit within {a.timeout + 30:g} s\n{stdout[-3000:]}\n{stderr[-3000:]}'
        return {'hung': True, 'output': said}
    lines = [l for l in stdout.splitlines() if l.startswith('{"path"')]
    if not lines:
        return {'abort': ABORT in stderr or p.returncode == -6, 'exit': p.returncode, 'error': 'the driver died',
                'ranks_reported': 0, 'ranks': num_ranks(path), 'output': stdout[-3000:] + stderr[-5000:],
                'lost': 0, 'orphans': [], 'shm': []}
    result = json.loads(lines[-1])
    result['output'] = result['output'] + '\n--- driver stderr\n' + stderr[-4000:]
    return result

def main(a):
    paths, stages = [p for p in a.paths.split(',') if p], [int(s) for s in a.stages.split(',')]
    unknown = set(paths) - set(PATHS)
    if unknown: sys.exit(f'unknown path(s) {sorted(unknown)}; choose from {", ".join(PATHS)}')
    logs = Path(a.log_dir or tempfile.mkdtemp(prefix='launch-stress-logs-'))
    logs.mkdir(parents=True, exist_ok=True)
    work = tempfile.TemporaryDirectory(prefix='launch-stress-')
    script = snapshot(Path(work.name))
    sys.path.insert(0, str(ROOT / 'tests'))
    from helpers import alias_environment   # the one tests/test_hf_clients.py uses
    alias_python = str(alias_environment(Path(work.name) / 'alias_env')) if 'accelerate-ds' in paths else None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # stopped: still stop the load generator (below)
    load = None if a.no_load else subprocess.Popen([sys.executable, '-c', 'while True: pass'])
    cells = [(p, s) for p in paths for s in stages]
    counts = {c: collections.Counter() for c in cells}
    first_failure, start = {}, time.monotonic()
    try:
        for i in range(a.reps):   # paths and stages interleaved: a change in the machine's load hits them alike
            for p, s in cells:
                r = run_once(script, p, s, a, alias_python if p == 'accelerate-ds' else None)
                outcome, c = classify(r), counts[p, s]
                c[outcome] += 1
                c['orphans'] += len(r.get('orphans', []))
                c['shm'] += len(r.get('shm', []))
                c['lost'] += r.get('lost', 0)
                c['records'] += r.get('records', 0)
                if outcome != 'ok' or r.get('orphans') or r.get('shm') or r.get('lost'):
                    (logs / f'{p}-stage{s}-{i + 1}-{outcome}.json').write_text(json.dumps(r, indent=1))
                if outcome in ('failed', 'hang'):
                    first_failure.setdefault((p, s), (r.get('error') or '') + r['output'][-1500:])
                print(f'run {i + 1:3d} {p:18s} stage {s} {outcome}'
                      + (f" orphans {r['orphans']}" if r.get('orphans') else '')
                      + (f" shm {r['shm']}" if r.get('shm') else '')
                      + (f" lost {r['lost']} of {r['steps']}" if r.get('lost') else ''), flush=True)
    finally:
        if load is not None: load.kill(); load.wait()
        work.cleanup()
    print(f'\n{a.reps} runs per path and stage, {a.steps} steps each, {"one core busy" if load else "no load"}, '
          f'{os.cpu_count()} cores, {time.monotonic() - start:.0f} s\n')
    print('| path | ranks | stage | runs | clean | aborts | hangs | other failures | orphans | shm left | '
          'step records lost |\n|---|---|---|---|---|---|---|---|---|---|---|')
    for (p, s), c in counts.items():
        runs = c['ok'] + c['abort'] + c['hang'] + c['failed']
        print(f"| {p} | {num_ranks(p)} | {s} | {runs} | {c['ok']} | {c['abort']} | {c['hang']} | {c['failed']} | "
              f"{c['orphans']} | {c['shm']} | {c['lost']} of {c['records'] + c['lost']} |")
    for (p, s), detail in first_failure.items(): print(f'\nfirst failure of {p} at stage {s}:\n{detail}')
    print(f'\nthe details of every run with a problem: {logs}')

if __name__ == '__main__':
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--reps', type=int, default=30)
    parser.add_argument('--paths', default=','.join(PATHS), help=f'comma-separated, of {",".join(PATHS)}')
    parser.add_argument('--stages', default='0,3', help='comma-separated ZeRO stages')
    parser.add_argument('--steps', type=int, default=6)
    parser.add_argument('--timeout', type=float, default=240, help='seconds before a run counts as hung')
    parser.add_argument('--no-load', action='store_true', help='no busy-loop process')
    parser.add_argument('--log-dir', help='where the details of runs with a problem go (default: a new temporary '
                                          'folder)')
    parser.add_argument('--drive', choices=PATHS, help='run one launch of this path (what the bench starts)')
    parser.add_argument('--alias-python', help='the python of the environment with the DeepSpeed alias')
    parser.add_argument('--stage', type=int, default=0)
    parser.add_argument('--rank', choices=('flexrt', 'deepspeed', 'accelerate'),
                        help='run as a rank (launchers start these)')
    parser.add_argument('--rank-out', help="where a rank writes its step count")
    a = parser.parse_args()
    if a.rank == 'accelerate': rank_accelerate(a.rank_out, a.steps, a.stage)
    elif a.rank: rank_flexrt(a.rank_out, a.steps, a.stage, api=a.rank)
    elif a.drive: print(json.dumps(drive(a)), flush=True)
    else: main(a)
