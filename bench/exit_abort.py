"""Does a rank abort at exit? Each launch path N times under torchrun with one core kept busy; exit codes counted.

    python bench/exit_abort.py [--runs 20] [--paths flexrt,flexrt-off,torch,deepspeed] [--steps 20] [--stage 0]
                               [--no-load] [--log-dir DIR]

torch 2.13 + gloo: a process that exits without `torch.distributed.destroy_process_group()` leaves gloo's C++ worker
threads holding `AsyncWork` objects with tensors; destroying them during interpreter finalisation needs the GIL, and
the rank dies of SIGABRT ("terminate called without an active exception", pytorch/pytorch#179291). A daemon thread
inside a torch call when finalisation starts (flexrt's p2p thread) dies the same way. Under CPU load the race is lost
more often. The paths, each a 2-rank `torchrun` job training a tiny model `--steps` steps and exiting without closing
anything:

- `flexrt`: `flexrt.initialize` at ZeRO stage `--stage` (0; at 1-2 the last step leaves its parameter all-gather in
  flight on flexrt's p2p thread), no `engine.close()`, no `destroy_process_group()`;
- `flexrt-off`: the same with `FLEXRT_EXIT_TEARDOWN=0` (flexrt.comm.teardown's diagnostic switch: no teardown at exit);
- `torch`: plain torch DDP, no `destroy_process_group()` (the peer: the Trainer, Accelerate, most scripts);
- `deepspeed`: real DeepSpeed's `deepspeed.initialize` at stage `--stage` on its CPU accelerator (skipped where it is
  absent).

A one-core load generator (a busy-loop process) runs for the whole benchmark unless `--no-load`. Printed per path:
runs, clean exits, aborts (the message, or a rank killed by SIGABRT), other failures (with the first one's tail);
the whole output of every job that did not exit cleanly is kept in `--log-dir`. The ranks run a copy of `flexrt/`
and of this file taken at the start, so edits made to the working tree while it runs do not mix in.
The same file is the rank script: `python bench/exit_abort.py --rank PATH --steps N` (what torchrun runs).
"""
import argparse, collections, os, re, shutil, signal, socket, subprocess, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ABORT = 'terminate called without an active exception'
PATHS = ('flexrt', 'flexrt-off', 'torch', 'deepspeed')

def config(stage:int)->dict:
    return {'train_batch_size': 16, 'gradient_accumulation_steps': 1, 'zero_optimization': {'stage': stage},
            'optimizer': {'type': 'AdamW', 'params': {'lr': 1e-3, 'torch_adam': True}}}

def _model():
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

def _train(step_fn, steps:int):
    "Run `step_fn(x, y)` on `steps` small batches"
    import torch
    g = torch.Generator().manual_seed(int(os.environ.get('RANK', 0)))
    for _ in range(steps):
        x = torch.randn(8, 8, generator=g)
        step_fn(x, x.sum(1, keepdim=True).sin())

def rank_flexrt(steps:int, stage:int):
    import flexrt, torch.nn.functional as F
    engine, *_ = flexrt.initialize(model=_model(), config=config(stage))
    def step(x, y):
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
    _train(step, steps)   # no engine.close(), no destroy_process_group(): what most scripts do

def rank_torch(steps:int, stage:int):
    import torch, torch.distributed as dist, torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group('gloo')
    model = DDP(_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    def step(x, y):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    _train(step, steps)   # no destroy_process_group()

def rank_deepspeed(steps:int, stage:int):
    sys.path.insert(0, str(ROOT / 'tests'))
    from real_deepspeed import import_deepspeed
    import torch.nn.functional as F
    deepspeed = import_deepspeed()
    deepspeed.init_distributed(dist_backend='gloo')
    model = _model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(stage))
    def step(x, y):
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
    _train(step, steps)

RANKS = {'flexrt': rank_flexrt, 'flexrt-off': rank_flexrt, 'torch': rank_torch, 'deepspeed': rank_deepspeed}

def _free_port()->int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0)); return s.getsockname()[1]

def snapshot(folder:Path)->Path: # the copy of this file to run
    "Copy `flexrt/`, this file and tests/real_deepspeed.py into `folder`, laid out as here"
    shutil.copytree(ROOT / 'flexrt', folder / 'flexrt', ignore=shutil.ignore_patterns('__pycache__'))
    for d in ('bench', 'tests'): (folder / d).mkdir()
    shutil.copy(ROOT / 'tests' / 'real_deepspeed.py', folder / 'tests')
    return Path(shutil.copy(__file__, folder / 'bench'))

def run_once(script:Path, path:str, steps:int, stage:int, timeout:float)->tuple: # (outcome, the whole output)
    "One 2-rank torchrun job of `path`: 'ok', 'abort' or 'failed'"
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONPATH': str(script.parent.parent), 'DS_ACCELERATOR': 'cpu',
           'FLEXRT_EXIT_TEARDOWN': '0' if path == 'flexrt-off' else '1'}
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', '2', '--master_port', str(_free_port()),
           str(script), '--rank', path, '--steps', str(steps), '--stage', str(stage)]
    try: r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=script.parent.parent)
    except subprocess.TimeoutExpired as e:
        return 'failed', f'hung: no exit within {timeout:g} s\n{e.stdout}\n{e.stderr}'
    out = f'exit code {r.returncode}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}'
    if r.returncode == 0: return 'ok', out
    codes = [int(c) for c in re.findall(r'exitcode\s*:\s*(-?\d+)', out)]
    return ('abort' if ABORT in out or -6 in codes else 'failed'), out

def start_load():
    "A busy loop on one core, at normal priority"
    return subprocess.Popen([sys.executable, '-c', 'while True: pass'])

def main(a):
    paths = [p for p in a.paths.split(',') if p]
    unknown = set(paths) - set(PATHS)
    if unknown: sys.exit(f'unknown path(s) {sorted(unknown)}; choose from {PATHS}')
    if 'deepspeed' in paths:
        import importlib.util
        if importlib.util.find_spec('deepspeed') is None:
            print('deepspeed is not installed: its path is skipped'); paths.remove('deepspeed')
    logs = Path(a.log_dir or tempfile.mkdtemp(prefix='exit-abort-logs-'))
    logs.mkdir(parents=True, exist_ok=True)
    work = tempfile.TemporaryDirectory(prefix='exit-abort-')
    script = snapshot(Path(work.name))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # stopped: still stop the load generator (below)
    load = None if a.no_load else start_load()
    counts, first_failure = {p: collections.Counter() for p in paths}, {}
    start = time.monotonic()
    try:
        for i in range(a.runs):   # the paths interleaved: a change in the machine's load hits them alike
            for p in paths:
                outcome, out = run_once(script, p, a.steps, a.stage, a.timeout)
                counts[p][outcome] += 1
                if outcome != 'ok': (logs / f'{p}-{i + 1}-{outcome}.txt').write_text(out)
                if outcome == 'failed': first_failure.setdefault(p, out[-800:])
                print(f'run {i + 1:3d} {p:11s} {outcome}', flush=True)
    finally:
        if load is not None: load.kill(); load.wait()
        work.cleanup()
    print(f'\n{a.runs} runs per path, {a.steps} steps at ZeRO stage {a.stage}, 2 ranks under torchrun, '
          f'{"one core busy" if load else "no load"}, {os.cpu_count()} cores, {time.monotonic() - start:.0f} s\n')
    print('| path | runs | clean exits | aborts at exit | other failures |\n|---|---|---|---|---|')
    for p in paths:
        c = counts[p]
        print(f"| {p} | {sum(c.values())} | {c['ok']} | {c['abort']} | {c['failed']} |")
    for p, detail in first_failure.items(): print(f'\nfirst other failure of {p}:\n{detail}')
    if any(c['ok'] < sum(c.values()) for c in counts.values()): print(f'\nthe output of each failed job: {logs}')

if __name__ == '__main__':
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--runs', type=int, default=20)
    parser.add_argument('--paths', default=','.join(PATHS), help=f'comma-separated, of {",".join(PATHS)}')
    parser.add_argument('--steps', type=int, default=20)
    parser.add_argument('--stage', type=int, default=0, choices=(0, 1, 2, 3), help='ZeRO stage of flexrt and DeepSpeed')
    parser.add_argument('--timeout', type=float, default=300, help='seconds before a job counts as hung')
    parser.add_argument('--no-load', action='store_true', help='no busy-loop process')
    parser.add_argument('--log-dir', help='where the output of failed jobs goes (default: a new temporary folder)')
    parser.add_argument('--rank', choices=PATHS, help='run as a rank of PATH (torchrun starts these)')
    a = parser.parse_args()
    if a.rank: RANKS[a.rank](a.steps, a.stage)
    else: main(a)
