"""How a bench starts its 2 ranks the ways users do: `torchrun`, `flexrt.launch` from a plain Python process, and
`flexrt.launch` in a cell of a real Jupyter kernel driven through nbclient (the notebook user's path).

    from launchers import open_launcher
    with open_launcher('kernel', out_dir) as launcher:
        ranks = launcher.run(__file__, 'rank_function', (arg, ...), tag='round3')   # one {'notes', 'result'} per rank

Every launcher runs the same rank code, `rank_main(spec)`: it notes the torch threads the rank was given
(`torch.get_num_threads()` on entry and at the end, and `OMP_NUM_THREADS`), calls the function `spec['function']` of the bench file
`spec['file']` with `spec['args']`, and writes what it returns, with the notes, to `<out>/<tag>.rank<N>.json` (JSON:
nothing is pickled, and nothing depends on `flexrt.launch` handing back return values); `run` reads the files back.
No launcher sets a thread count: the ranks run with what a user's get (torchrun's OMP_NUM_THREADS=1 included, which it
sets when the environment has none). A rank's `start_s` is the time from the launch call, in the process that made it
(this one, or the kernel), to the rank entering `rank_main`.

torchrun and the kernel start without the variables a launching process hands its ranks (flexrt.monitor's hub address,
flexrt.launch's stop file), as from a shell or a fresh notebook: a `launch` run in this process serves a hub, and a
torchrun started afterwards would otherwise forward its ranks' records to it. `keep_monitor=True` keeps them (a
dashboard in this process watching torchrun's ranks).
"""
import contextlib, importlib, importlib.util, json, os, subprocess, sys, time
from pathlib import Path

NUM_PROCESSES = 2
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MONITOR_VARIABLES = ('FLEXRT_MONITOR_ADDRESS', 'FLEXRT_MONITOR_KEY', 'FLEXRT_MONITOR_OWNER', 'FLEXRT_MONITOR_WATCHED',
                     'FLEXRT_STOP_FILE')
LAUNCH_LINE = 'flexrt: launching'
TORCHRUN_SETS = 'Setting OMP_NUM_THREADS environment variable for each process to be 1'   # torchrun's warning

def to_json(value):
    "JSON's fallback for numpy and torch scalars and arrays (their Python values), else the value's text"
    tolist = getattr(value, 'tolist', None)
    return tolist() if callable(tolist) else str(value)

def bench_function(file:str, name:str):
    "The function `name` of the bench file `file`: from the module loaded from it (`__main__` too), else imported"
    path = Path(file).resolve()
    for module in (sys.modules.get('__main__'), sys.modules.get(path.stem)):
        if module is not None and getattr(module, '__file__', None) and Path(module.__file__).resolve() == path:
            return getattr(module, name)
    if str(path.parent) not in sys.path: sys.path.insert(0, str(path.parent))
    if path.stem not in sys.modules: return getattr(importlib.import_module(path.stem), name)
    spec = importlib.util.spec_from_file_location(f'bench_{path.stem}', path)   # another module holds the name
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return getattr(module, name)

def rank_main(spec:dict):
    "The rank code of every launcher: note the threads given, run the bench's function, write its result as JSON"
    import torch
    entered, threads_given = time.time(), torch.get_num_threads()
    rank = int(os.environ.get('RANK', 0))
    try: result = bench_function(spec['file'], spec['function'])(*spec['args'])
    finally:   # flexrt.comm's teardown (its state too), where the function left a process group
        import torch.distributed as tdist
        from flexrt import comm
        if tdist.is_initialized(): comm.destroy_process_group()
    notes = dict(rank=rank, start_s=entered - spec['launched_at'], seconds=time.time() - entered,
                 threads_given=threads_given, threads_at_end=torch.get_num_threads(),
                 omp_num_threads=os.environ.get('OMP_NUM_THREADS'), local_world_size=os.environ.get('LOCAL_WORLD_SIZE'))
    path = Path(spec['out']) / f"{spec['tag']}.rank{rank}.json"
    path.with_suffix('.tmp').write_text(json.dumps({'notes': notes, 'result': result}, default=to_json))
    path.with_suffix('.tmp').rename(path)

class Launcher:
    "Starts `NUM_PROCESSES` ranks running `rank_main`; `run` waits for them and returns one dict per rank"
    name = ''
    def __init__(self, out:str, keep_monitor:bool=False):
        self.out, self.keep_monitor, self.count = Path(out).resolve(), keep_monitor, 0
        self.out.mkdir(parents=True, exist_ok=True)
        self.launch_line = None   # what the launch printed about its ranks (flexrt.launch's line, torchrun's warning)

    def run(self, file:str, function:str, args=(), tag:str|None=None)->list: # [{'notes': ..., 'result': ...}] by rank
        "Run `function(*args)` of the bench file `file` on every rank; raise if the launch failed"
        self.count += 1
        tag = tag or f'{self.name}-{self.count}'
        spec = dict(file=str(Path(file).resolve()), function=function, args=list(args), out=str(self.out), tag=tag)
        for old in self.out.glob(f'{tag}.rank*.json'): old.unlink()
        self.start(spec)
        files = [self.out / f'{tag}.rank{r}.json' for r in range(NUM_PROCESSES)]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise RuntimeError(f'{self.name}: the launch ended without {", ".join(missing)} (a rank did not finish)')
        return [json.loads(f.read_text()) for f in files]

    def start(self, spec:dict): raise NotImplementedError
    def close(self): pass
    def __enter__(self): return self
    def __exit__(self, *exc): self.close()

    def environment(self)->dict:
        "This process's environment for a subprocess, without the launch variables unless `keep_monitor`"
        return {k: v for k, v in os.environ.items() if self.keep_monitor or k not in MONITOR_VARIABLES}

class Torchrun(Launcher):
    "`python -m torch.distributed.run --nproc_per_node 2 bench/launchers.py SPEC` (torchrun), from this process"
    name = 'torchrun'
    def start(self, spec:dict):
        from flexrt.launch import free_port
        path = self.out / f"{spec['tag']}.spec.json"
        command = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', str(NUM_PROCESSES),
                   '--master_addr', '127.0.0.1', '--master_port', str(free_port()), __file__, str(path)]
        path.write_text(json.dumps({**spec, 'launched_at': time.time()}, default=to_json))
        done = subprocess.run(command, env=self.environment(), cwd=ROOT, capture_output=True, text=True)
        omp = os.environ.get('OMP_NUM_THREADS')
        sets = TORCHRUN_SETS in done.stderr + done.stdout
        self.launch_line = ('torchrun set OMP_NUM_THREADS=1 for each rank (it was unset)' if sets
                            else f'torchrun kept OMP_NUM_THREADS={omp}')
        if done.returncode:
            raise RuntimeError(f'torchrun exited with {done.returncode}:\n{(done.stdout + done.stderr)[-4000:]}')

class KeptOutput:
    "A stream that keeps what is written to it (a launch's own lines), passing on only what `keep` rejects"
    def __init__(self, stream, keep): self.stream, self.keep, self.text = stream, keep, []
    def write(self, text:str)->int:
        if not self.keep(text): return self.stream.write(text)
        self.text.append(text)
        return len(text)
    def __getattr__(self, name): return getattr(self.stream, name)

def launch_here(fn, args=())->str|None: # what flexrt.launch said about the ranks
    "`flexrt.launch(fn, args=args, num_processes=2)` from this process; its launch line kept for a report, not printed"
    import flexrt
    stdout = sys.stdout
    sys.stdout = kept = KeptOutput(stdout, lambda text: text.startswith(LAUNCH_LINE) or text == '\n')
    try: flexrt.launch(fn, args=args, num_processes=NUM_PROCESSES)
    finally:
        if sys.stdout is kept: sys.stdout = stdout
    lines = [l for l in ''.join(kept.text).splitlines() if l.startswith(LAUNCH_LINE)]
    return lines[0] if lines else None

class Launch(Launcher):
    "`flexrt.launch(rank_main, args=(spec,), num_processes=2)` from this (plain Python) process"
    name = 'launch'
    def start(self, spec:dict): self.launch_line = launch_here(rank_main, ({**spec, 'launched_at': time.time()},))

KERNEL_SETUP = f'''import json, sys, time
sys.path.insert(0, {str(HERE)!r})
import flexrt
from launchers import rank_main'''

KERNEL_CELL = '''spec = json.loads({spec!r})
spec['launched_at'] = time.time()
flexrt.launch(rank_main, args=(spec,), num_processes={num_processes})'''

class Kernel(Launcher):
    "A real Jupyter kernel (nbclient), started once; each run is a cell calling `flexrt.launch(rank_main, ...)`"
    name = 'kernel'
    def __init__(self, out:str, keep_monitor:bool=False, timeout:int=3600):
        import nbformat
        from nbclient import NotebookClient
        super().__init__(out, keep_monitor)
        self.nb = nbformat.v4.new_notebook()
        self.client = NotebookClient(self.nb, timeout=timeout, kernel_name='python3',
                                     resources={'metadata': {'path': str(ROOT)}})
        self.stack = contextlib.ExitStack()
        started = time.perf_counter()
        try:
            self.stack.enter_context(self.client.setup_kernel(env=self.environment()))
            self.execute(KERNEL_SETUP)
        except BaseException:
            self.stack.close()   # no kernel left running
            raise
        self.start_seconds = time.perf_counter() - started   # the kernel's start and the first cell's imports

    def execute(self, source:str)->str: # the text the cell printed
        "Run `source` as the next cell of the kernel's notebook (nbclient raises CellExecutionError if it fails)"
        import nbformat
        cell = nbformat.v4.new_code_cell(source)
        self.nb.cells.append(cell)
        self.client.execute_cell(cell, len(self.nb.cells) - 1)
        return ''.join(o.get('text', '') for o in cell.outputs if o.get('output_type') == 'stream')

    def start(self, spec:dict):
        printed = self.execute(KERNEL_CELL.format(spec=json.dumps(spec, default=to_json), num_processes=NUM_PROCESSES))
        lines = [l for l in printed.splitlines() if l.startswith(LAUNCH_LINE)]
        self.launch_line = lines[0] if lines else None

    def close(self):
        "Shut the kernel down; keep its notebook (every cell it ran, with outputs) as `<out>/kernel.ipynb`"
        import nbformat
        self.stack.close()
        nbformat.write(self.nb, self.out / 'kernel.ipynb')

def open_launcher(name:str, out:str, **kwargs)->Launcher:
    "The launcher called `name` ('torchrun', 'launch' or 'kernel'), writing its ranks' files to `out`"
    kinds = {k.name: k for k in (Torchrun, Launch, Kernel)}
    if name not in kinds: raise ValueError(f'launcher {name!r}: choose one of {", ".join(kinds)}')
    return kinds[name](out, **kwargs)

if __name__ == '__main__':   # a rank under torchrun: bench/launchers.py SPEC.json
    if len(sys.argv) == 2: rank_main(json.loads(Path(sys.argv[1]).read_text()))
    else: print('bench/launchers.py starts the benches\' ranks (torchrun runs it with a spec): no bench of its own')
