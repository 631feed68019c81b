"""Run a function on N real gloo ranks (forked processes) and collect each rank's return value.

    results = run_distributed(fn, world_size=2, args=(...))   # results[r] is fn(rank=r, world_size=N, *args)

Each rank gets the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT on a free port).
With `init=True` (default) the rank calls `torch.distributed.init_process_group('gloo')` before `fn` and destroys
the group after; pass `init=False` to test initialisation itself. An exception on any rank fails the call with
every rank's traceback; results may hold tensors (they are pickled by value).

A rank that does not finish within `timeout` seconds fails the call too (all ranks are killed), so a hang never stalls
the suite, and the error shows where every silent rank was (Python's `faulthandler` dumps each rank's threads at
the deadline). When no rank reported anything, the ranks are started once more, with a warning carrying those
stacks: a child forked from a pytest worker can wait for good in code that is not the test's (a finaliser of the
worker's garbage, a lock another of its threads held at the fork). A hang the test itself causes hangs again and
fails with its stacks.
"""
import contextlib, faulthandler, gc, os, pickle, signal, socket, tempfile, threading, traceback, time, warnings
import queue as queue_mod
from datetime import timedelta
import multiprocessing as mp

from flexrt.launch import ports


def worker_share() -> tuple:
    "(this pytest-xdist worker's index, the workers' count): the share of ports it draws from; (0, 1) without xdist"
    workers = int(os.environ.get('PYTEST_XDIST_WORKER_COUNT', '1'))
    return int(os.environ.get('PYTEST_XDIST_WORKER', 'gw0')[2:]), workers


def free_port() -> int:
    """A TCP port nobody listens on now, for a rank to bind a moment later: flexrt.launch's draw below the kernel's
    ephemeral range, from this worker's share (`port % workers`), so two workers never pick alike (tests/conftest.py
    gives flexrt.launch's own draws the same share)"""
    return ports.free_port(share=worker_share())

def _rank_main(fn, rank, world_size, port, args, kwargs, init, env, results, stacks_file):
    # where every thread of this rank is, written when the parent gives up on it
    faulthandler.register(STACK_SIGNAL, file=open(stacks_file, 'a'), all_threads=True)
    import torch, torch.distributed as tdist
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK='0')
    os.environ.update(env or {})
    torch.set_num_threads(1)
    try:
        if init:
            tdist.init_process_group('gloo', rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
        # plain pickle: torch's multiprocessing reducers would pass tensors as shared-memory handles that vanish
        # when the rank exits, so results are sent as bytes
        results.put((rank, 'ok', pickle.dumps(fn(rank, world_size, *args, **kwargs))))
    except BaseException:
        results.put((rank, 'error', traceback.format_exc()))
    finally:
        if init and tdist.is_initialized():
            tdist.destroy_process_group()

def run_distributed(fn, world_size=2, args=(), kwargs=None, init=True, timeout=90, env=None, start_method='fork'):
    "Run `fn(rank, world_size, *args, **kwargs)` on `world_size` ranks; return the list of results by rank."
    try: return _run_ranks(fn, world_size, args, kwargs, init, timeout, env, start_method)
    except _SilentRanks as hang:
        warnings.warn(f'{hang} [started once more]', RuntimeWarning, stacklevel=2)
    try: return _run_ranks(fn, world_size, args, kwargs, init, timeout, env, start_method)
    except _SilentRanks as hang: raise TimeoutError(f'{hang} [the second start too]') from None


class _SilentRanks(TimeoutError):
    "Every rank was still running at the deadline and none had reported"


def _run_ranks(fn, world_size, args, kwargs, init, timeout, env, start_method):
    "One start of `run_distributed`'s ranks"
    # Finalise garbage here, where its threads are: a forked rank that collects it (see_memory_usage does) would run
    # the finalisers without them, and one waits for good. CI's stacks showed both ranks of test_memory's gloo test
    # "Garbage-collecting" there, twice, and the second start (after one more collection here) passing. A finaliser
    # can leave more garbage, new objects: the young generations are collected until none is left, 3 rounds at most
    # (a full collection of a worker's heap takes 0.1-0.3 s, about 400 times a run; a young one, milliseconds).
    # (Freezing what a rank inherits, gc.freeze(), ends it too, but made the autotuner's search-path test 37 % slower,
    # 81 s against 59: not analysed further.)
    if gc.collect():
        for _ in range(3):
            if not gc.collect(1): break
    ctx = mp.get_context(start_method)
    results, port = ctx.Queue(), free_port()
    with tempfile.TemporaryDirectory(prefix='flexrt-ranks-') as folder:
        stacks = [os.path.join(folder, f'rank{r}.stacks') for r in range(world_size)]
        for path in stacks: open(path, 'w').close()   # there, empty, even for a rank that never reaches its entry
        procs = [ctx.Process(target=_rank_main, daemon=True,
                             args=(fn, r, world_size, port, args, kwargs or {}, init, env, results, stacks[r]))
                 for r in range(world_size)]
        threads = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
        for p in procs: p.start()
        out, errors, deadline = {}, {}, time.monotonic() + timeout
        try:
            while len(out) + len(errors) < world_size:
                try: rank, status, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
                except queue_mod.Empty:
                    missing = sorted(set(range(world_size)) - out.keys() - errors.keys())
                    where = ''.join(f'\n--- rank {r}: its threads at the deadline ---\n{text}'
                                    for r, text in zip(missing, _stacks([procs[r] for r in missing],
                                                                        [stacks[r] for r in missing])))
                    reported = ''.join(f'\n--- rank {r} ---\n{tb}' for r, tb in errors.items())
                    error = _SilentRanks if not out and not errors else TimeoutError
                    raise error(f'ranks {missing} did not finish within {timeout}s (the parent had threads '
                                f'{threads} at the fork){reported}{where}')
                if status == 'ok': out[rank] = pickle.loads(value)
                else: errors[rank] = value
                if errors:  # the other ranks may be blocked in a collective with the failed one: stop waiting soon
                    deadline = min(deadline, time.monotonic() + 5)
        finally:
            if errors or len(out) < world_size:  # ranks still running are blocked or hung: do not wait for them
                for p in procs: p.kill()
            for p in procs: p.join(timeout=10)
    if errors:
        raise RuntimeError('failure on ranks ' + ', '.join(map(str, sorted(errors))) +
                           ''.join(f'\n--- rank {r} ---\n{tb}' for r, tb in sorted(errors.items())))
    return [out[r] for r in range(world_size)]


STACK_SIGNAL = signal.SIGUSR2   # a rank dumps its threads' stacks on it (flexrt.launch's ranks use SIGUSR1)


def _stacks(procs, paths, frames=12, wait=2.0) -> list:
    "Each process's threads' innermost `frames` frames, asked for now (its stack goes on into the forking pytest)"
    for p in procs:
        try: os.kill(p.pid, STACK_SIGNAL)
        except OSError: pass
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and not all(os.path.getsize(path) for path in paths): time.sleep(0.05)
    return [_trimmed(path, frames) for path in paths]


def _trimmed(path, frames) -> str:
    try:
        with open(path) as f: text = f.read().strip()
    except OSError as e: return f'(not readable: {e})'
    out, kept = [], 0
    for line in text.splitlines():
        kept = 0 if not line.startswith('  ') else kept + 1
        if kept <= frames: out.append(line)
        elif kept == frames + 1: out.append('  ...')
    return '\n'.join(out) or "(none written: the rank had not reached run_distributed's entry, where it learns to)"

# torch 2.13 + gloo: under CPU contention a rank that exits without destroy_process_group() sometimes aborts at
# interpreter exit, after its work is done ("terminate called without an active exception", SIGABRT;
# pytorch/pytorch#179291). flexrt's own ranks no longer do: flexrt.comm.teardown ends the groups flexrt started or
# adopted while Python is alive (tests/test_exit_teardown.py; bench/exit_abort.py with one core busy: 0 aborts in 50
# flexrt jobs, against 22 in 50 with the teardown off). What remains is code flexrt does not end: real DeepSpeed (4 in
# 70 jobs; the parity, checkpoint and HF tests run it next to flexrt) and plain torch scripts (DDP without
# destroy_process_group: 6 in 50), so a job failing with exactly that is run once more.
TORCH_EXIT_ABORT = 'terminate called without an active exception'


def train_on_slices(engine, data, batch:int, rank:int, world:int, steps:int, start:int=0) -> list:
    "Steps `start`..`start+steps` of `engine` (MSE) on this rank's slice of each global batch of `data = (X, Y)`: its losses"
    import torch.nn.functional as F
    X, Y = data
    micro, losses = batch // world, []
    for s in range(start, start + steps):
        rows = slice(s * batch + rank * micro, s * batch + (rank + 1) * micro)
        loss = F.mse_loss(engine(X[rows]), Y[rows])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses

@contextlib.contextmanager
def pending_finalisers(depth:int=1):
    """Inside the block garbage collection is off and an unreachable reference cycle is pending, whose finaliser writes
    the pid of the process that runs it and, with `depth` > 1, leaves a new such cycle behind (one collection is then
    not enough). Yields a list that holds those pids, in order, once the block is left (every cycle finalised then)"""
    read, write = os.pipe()
    class Finalised:
        def __init__(self, depth): self.me, self.depth = self, depth
        def __del__(self):
            os.write(write, b'%d ' % os.getpid())
            if self.depth > 1: Finalised(self.depth - 1)
    pids = []
    gc.disable()
    try:
        Finalised(depth)
        yield pids
    finally:
        gc.enable()
        while gc.collect(): pass                                     # what is left, each cycle's successors too
        os.close(write)
        with os.fdopen(read) as f: pids += [int(p) for p in f.read().split()]

def run_torchrun(cmd, **kwargs):
    "`subprocess.run(cmd, **kwargs)` for a torchrun job; once more when it failed only by torch's abort at a rank's exit"
    import subprocess
    r = subprocess.run(cmd, **kwargs)
    if r.returncode != 0 and TORCH_EXIT_ABORT in (r.stdout or '') + (r.stderr or ''): r = subprocess.run(cmd, **kwargs)
    return r

def torch_records(path) -> dict:
    """A torch file's records by name, without what differs between any two saves of the same object: the archive's
    folder (named after the temporary file, which has a random suffix) and torch's random `serialization_id`"""
    import zipfile
    with zipfile.ZipFile(path) as z:
        return {n.split('/', 1)[1]: z.read(n) for n in z.namelist() if not n.endswith('serialization_id')}

def checkpoint_tree(d) -> dict:
    """Every file under checkpoint directory `d`: torch files as their records, the manifest with each file's size
    (checksums cover the random parts `torch_records` leaves out), other files' bytes"""
    import json
    from pathlib import Path
    out = {}
    for p in sorted(Path(d).rglob('*')):
        name = str(p.relative_to(d))
        if p.suffix == '.pt': out[name] = torch_records(p)
        elif p.name == 'manifest.json':
            m = json.loads(p.read_text())
            out[name] = {**m, 'files': {n: f['size'] for n, f in m['files'].items()}}
        elif p.is_file(): out[name] = p.read_bytes()
    return out

def alias_environment(folder, env=None):  # the environment's python (a Path)
    "A throwaway virtual environment that sees this one's packages, with flexrt's DeepSpeed alias installed by its CLI"
    import subprocess, sys
    from pathlib import Path
    subprocess.run([sys.executable, '-m', 'venv', '--without-pip', str(folder)], check=True)
    python = Path(folder) / 'bin' / 'python'
    purelib = lambda py: subprocess.run([py, '-c', 'import sysconfig; print(sysconfig.get_paths()["purelib"])'],
                                        capture_output=True, text=True, check=True).stdout.strip()
    ours = purelib(sys.executable)   # torch, accelerate, deepspeed ...
    (Path(purelib(python)) / '_dev_packages.pth').write_text(f'import site; site.addsitedir({ours!r})\n')
    r = subprocess.run([python, '-m', 'flexrt.deepspeed', '--install-alias'], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and 'flexrt_deepspeed_alias.pth' in r.stdout, r.stdout + r.stderr
    return python
