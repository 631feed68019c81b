"""Checkpoint save and load on gloo ranks: flexrt vs torch.save of the same state vs DeepSpeed, per ZeRO stage.

    python bench/checkpoint.py [--stages 0,1,2,3] [--rounds 5] [--width 1024] [--layers 12] [--dir /tmp] [--ranks 2]

The model is `--layers` Linear(width, width) layers (12 x 1024^2: 12.6M parameters, 48 MiB of fp32 weights), fp32,
torch's AdamW after one training step, so the optimizer holds two fp32 moments per parameter. Per stage, in each
round (the order alternates between rounds; round 0 only warms up the page cache and allocators):

- flexrt: engine.save_checkpoint / engine.load_checkpoint at that ZeRO stage. Every rank writes its own file at
  the same time; every file is fsync'ed, renamed into place and hashed (xxh3-128), and loading verifies every
  checksum first: the price of crash safety and corruption detection, included in the times.
- torch.save: rank 0 alone saves {'model': state_dict, 'optimizer': state_dict} of a plain torch copy (model +
  AdamW after the same step) to one file, no fsync; load is torch.load(weights_only=True) + load_state_dict on
  rank 0. This is the floor: one process serialising one replica.
- deepspeed: deepspeed.initialize with the same config, save_checkpoint / load_checkpoint (DS_ACCELERATOR=cpu).

Printed per stage: median save and load time (rank 0's clock, from a barrier to a barrier), bytes on disk, and
the paired ratios (median over rounds of flexrt's time / the peer's time in the same round; below 1: flexrt faster).

Then the asynchronous rows, per stage (skip them with --no-async; --async-only skips the table above): in each
round, a synchronous save (barrier to barrier), then an asynchronous one, then training steps while the background
write runs (the ranks agree each step, with a one-element all_reduce, whether any rank's thread still writes), then
as many steps with nothing in flight (the same all_reduce each step). The time training is blocked is, per rank, the
call's time (from the call to its return) plus the time the first optimizer step after it waited for the copies the
save left to its thread (what only the optimizer step changes: masters and optimizer state; forward and backward run
meanwhile), the slower rank's. Printed: median sync save, median blocking time (and the step's wait within it) and
its ratio to the sync save (goal <= 10 %), median step time normal and during the write (the step's wait for the
copies left out: it is counted as blocked), and the speed during the write as a share of normal.

Step speed during the write (goal >= 90 % of normal with a spare core): each rank runs torch with one thread, so
`--ranks` one below the machine's cores leaves the writer a core; on a 2-core machine:

    python bench/checkpoint.py --async-only --ranks 1 [--floor]

`--floor` adds, per stage, the steps' speed beside a process that does nothing but torch.save and fsync this rank's
state in a loop (no copies, no hashing, no Python shared with the rank): the best any background writer can do on
the machine, the reference for the goal.

The files are written by each rank's writer process (`--writer process`, the default on Linux: serialising, fsync
and xxh3 hashing in a child process at nice 10, off the rank's GIL) or by a thread of the rank (`--writer thread`,
what other platforms get); run both to compare. Without a spare core (`--ranks 2` on 2 cores, the default) the
writer takes its CPU from the ranks: the niced process mostly while they wait in communication, the thread at the
ranks' own priority.
"""
import argparse, logging, os, shutil, socket, statistics, sys, tempfile, time, warnings
os.environ.setdefault('DS_ACCELERATOR', 'cpu')
import torch
from torch import nn
import torch.nn.functional as F
import torch.distributed as tdist
import torch.multiprocessing as mp

def make_model(args):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])

def config(stage, writer='process'):
    return {'train_micro_batch_size_per_gpu': 2, 'gradient_accumulation_steps': 1, 'steps_per_print': 10 ** 9,
            'zero_optimization': {'stage': stage, 'stage3_param_persistence_threshold': 0},
            'zero_allow_untested_optimizer': True,
            'checkpoint': {'tag_validation': 'Ignore', 'async_writer': writer}}

def adamw(model): return torch.optim.AdamW(model.parameters(), lr=1e-4)

def one_step(engine, args):
    x = torch.randn(2, args.width)
    loss = F.mse_loss(engine(x), x); engine.backward(loss); engine.step()

def dir_bytes(path):
    return sum(f.stat().st_size for f in os.scandir(path) if f.is_file()) if os.path.isdir(path) else 0

class Engine:
    "An engine of either library, one step trained: its save_checkpoint / load_checkpoint under one tag"
    def __init__(self, stage, args):
        model = make_model(args)
        self.engine = self.library().initialize(model=model, optimizer=adamw(model), config=config(stage))[0]
        one_step(self.engine, args)
    def save(self, d): self.engine.save_checkpoint(d, tag='t')
    def load(self, d): self.engine.load_checkpoint(d, tag='t')
    def files(self, d): return os.path.join(d, 't')

class Flexrt(Engine):
    name = 'flexrt'
    def library(self):
        import flexrt
        return flexrt

class DeepSpeed(Engine):
    name = 'deepspeed'
    def library(self):
        import deepspeed
        deepspeed.utils.logger.setLevel(logging.ERROR)
        return deepspeed

class TorchSave:
    name = 'torch.save'
    def __init__(self, stage, args):
        self.model = make_model(args); self.opt = adamw(self.model)
        x = torch.randn(2, args.width); F.mse_loss(self.model(x), x).backward(); self.opt.step(); self.opt.zero_grad()
    def save(self, d):
        if tdist.get_rank() == 0:
            os.makedirs(d, exist_ok=True)
            torch.save({'model': self.model.state_dict(), 'optimizer': self.opt.state_dict()}, os.path.join(d, 'state.pt'))
    def load(self, d):
        if tdist.get_rank() == 0:
            state = torch.load(os.path.join(d, 'state.pt'), weights_only=True)
            self.model.load_state_dict(state['model']); self.opt.load_state_dict(state['optimizer'])
    def files(self, d): return d

def timed(fn, d):
    tdist.barrier(); start = time.perf_counter()
    fn(d)
    tdist.barrier()
    return time.perf_counter() - start

def worker(rank, world, port, args, stages):
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    warnings.filterwarnings('ignore'); logging.disable(logging.WARNING)
    tdist.init_process_group('gloo', rank=rank, world_size=world)
    root = args.dir
    for stage in stages if not args.async_only else []:
        impls = [cls(stage, args) for cls in (Flexrt, TorchSave, DeepSpeed) if cls is not DeepSpeed or args.deepspeed]
        save, load, size = ({i.name: [] for i in impls} for _ in range(3))
        for r in range(args.rounds + 1):
            for impl in (impls if r % 2 == 0 else impls[::-1]):
                d = os.path.join(root, f'{impl.name}-{stage}')
                if rank == 0: shutil.rmtree(d, ignore_errors=True)
                s, l = timed(impl.save, d), timed(impl.load, d)
                if r: save[impl.name].append(s); load[impl.name].append(l); size[impl.name] = dir_bytes(impl.files(d))
        if rank == 0: report(stage, save, load, size, args)
        for impl in impls:
            if hasattr(impl, 'engine') and hasattr(impl.engine, 'close'): impl.engine.close()
    for stage in stages if args.run_async else []:
        rows = async_rounds(stage, args)
        if rank == 0: report_async(stage, rows)
    tdist.destroy_process_group()

def steps_while(engine, args, busy, most=None) -> tuple:
    "Train while `busy()` is true on any rank (at least one step), or `most` steps; (steps, seconds)"
    n, start = 0, time.perf_counter()
    while True:
        flag = torch.tensor([float(n == 0 or busy()) if most is None else float(n < most)])
        tdist.all_reduce(flag, op=tdist.ReduceOp.MAX)
        if not flag.item(): break
        one_step(engine, args); n += 1
    return n, time.perf_counter() - start

def async_rounds(stage, args) -> list:
    """Per round (after one warm-up): (sync save s, blocked s, of which the first step waited s, normal step s, step s
    during the background write)"""
    import flexrt
    from flexrt.checkpoint.async_save import CheckpointWriter
    model = make_model(args)
    engine = flexrt.initialize(model=model, optimizer=adamw(model), config=config(stage, args.writer))[0]
    writer, d, rows = CheckpointWriter(engine), os.path.join(args.dir, f'async-{stage}'), []
    one_step(engine, args)
    for r in range(args.rounds + 1):
        sync = timed(lambda d: writer.save(d, tag='t', async_save=False), d)
        tdist.barrier(); start = time.perf_counter()
        job = writer.save(d, tag='t', async_save=True)
        returned = time.perf_counter() - start
        n, during = steps_while(engine, args, job.thread.is_alive)
        writer.wait()
        # training waits for the slower rank: its call, and its first step's wait for the copies left to the thread
        blocked = torch.tensor([returned + job.step_wait_seconds, job.step_wait_seconds])
        tdist.all_reduce(blocked, op=tdist.ReduceOp.MAX)
        _, normal = steps_while(engine, args, None, most=n)
        waited = blocked[1].item()
        if r: rows.append((sync, blocked[0].item(), waited, normal / n, (during - job.step_wait_seconds) / n))
    writer.close()
    if args.floor:
        floor = floor_rounds(engine, args, os.path.join(args.dir, f'floor-{stage}-{tdist.get_rank()}.pt'))
        rows = [row + (f,) for row, f in zip(rows, floor)]
    engine.close()
    return rows

def _save_loop(state, path, stop):
    torch.set_num_threads(1)
    while not stop.is_set():
        torch.save(state, path)
        fd = os.open(path, os.O_RDONLY); os.fsync(fd); os.close(fd)

def floor_rounds(engine, args, path) -> list:
    """The floor for step speed during a write: per round, 20 steps alone, then 20 beside a process that does nothing
    but torch.save + fsync this rank's state (module and optimizer) in a loop; normal / beside, per round"""
    import multiprocessing
    state = {'module': {k: v.clone() for k, v in engine.module.state_dict().items()},
             'optimizer': engine.basic_optimizer.state_dict()}
    out, ctx = [], multiprocessing.get_context('fork')
    for _ in range(args.rounds):
        _, alone = steps_while(engine, args, None, most=20)
        stop = ctx.Event(); proc = ctx.Process(target=_save_loop, args=(state, path, stop), daemon=True); proc.start()
        time.sleep(0.3)
        _, beside = steps_while(engine, args, None, most=20)
        stop.set(); proc.join()
        out.append(alone / beside)
    os.unlink(path)
    return out

def report_async(stage, rows):
    med = statistics.median
    sync, blocked, waited, normal, during = (med(col) for col in list(zip(*rows))[:5])
    share = paired([b for _, b, *_ in rows], [s for s, *_ in rows])
    speed = paired([r[3] for r in rows], [r[4] for r in rows])
    print(f"stage {stage} async: sync save {sync * 1e3:6.0f} ms, blocked {blocked * 1e3:5.0f} ms "
          f"(step waited {waited * 1e3:4.0f} ms; {share:6.1%} of sync); "
          f"step {normal * 1e3:5.0f} ms normal, {during * 1e3:5.0f} ms during the write ({speed:4.0%} speed)", flush=True)
    if len(rows[0]) > 5:
        print(f"stage {stage} floor: steps beside a process that only saves and fsyncs this rank's state in a loop: "
              f"{med(r[5] for r in rows):4.0%} speed", flush=True)

def paired(xs, ys): return statistics.median(x / y for x, y in zip(xs, ys))

def report(stage, save, load, size, args):
    med = statistics.median
    print(f"stage {stage}:  {'save':>9s} {'load':>9s} {'MiB on disk':>12s}   flexrt/this: save   load   bytes")
    for name in save:
        print(f"  {name:11s} {med(save[name]) * 1e3:7.0f} ms {med(load[name]) * 1e3:6.0f} ms {size[name] / 2**20:10.1f}     "
              f"{paired(save['flexrt'], save[name]):10.2f}x {paired(load['flexrt'], load[name]):5.2f}x {size['flexrt'] / size[name]:6.2f}x")

def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--stages', default='0,1,2,3')
    ap.add_argument('--rounds', type=int, default=5)
    ap.add_argument('--width', type=int, default=1024)
    ap.add_argument('--layers', type=int, default=12)
    ap.add_argument('--dir', default=None, help='where to write (default: a temporary directory under /tmp)')
    ap.add_argument('--ranks', type=int, default=2,
                    help='gloo ranks, one torch thread each (1 on a 2-core machine: the writing thread has a core)')
    ap.add_argument('--no-async', dest='run_async', action='store_false', help='skip the asynchronous rows')
    ap.add_argument('--async-only', action='store_true', help='only the asynchronous rows')
    ap.add_argument('--writer', choices=['process', 'thread'], default='process',
                    help="who writes an asynchronous save: a writer process per rank (the default), or a thread")
    ap.add_argument('--floor', action='store_true',
                    help="also the steps' speed beside a process that only saves and fsyncs the rank's state in a loop")
    args = ap.parse_args()
    try:
        import deepspeed  # noqa: F401
        args.deepspeed = True
    except ImportError:
        print("deepspeed: skipped, not installed (pip install deepspeed)"); args.deepspeed = False
    numel = args.layers * (args.width ** 2 + args.width)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()
    print(f"{args.layers} x Linear({args.width}, {args.width}): {numel / 1e6:.1f}M parameters, fp32, AdamW; "
          f"{args.ranks} gloo rank{'s' if args.ranks > 1 else ''} on {cores} cores; {args.rounds} rounds, "
          "order alternating")
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        args.dir = d
        with socket.socket() as s: s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]
        mp.spawn(worker, args=(args.ranks, port, args, [int(s) for s in args.stages.split(',')]), nprocs=args.ranks)

if __name__ == '__main__':
    sys.exit(main())
