"""flexrt.comm vs torch.distributed on 2 gloo ranks (CPU), in one run (about a minute):

1. per-call time of a 1-element all_reduce: raw torch.distributed, flexrt.comm with logging off, and with logging on.
   a) across the 2 ranks: the three run in interleaved blocks; figures are medians over blocks, and "added" is the
      median of the per-round differences. Scheduling noise between two processes on shared cores is tens of us, far
      above the overhead, so (b) is the precise figure.
   b) on a 1-rank subgroup of each rank (same gloo backend, same dispatch, no peer to wait for): the added cost of
      flexrt.comm's dispatch itself; median of blocks, "added" = median of per-round differences.
   c) flexrt.comm's own layers (timed_op's flag check, the backend lookup, the call into the backend) against calling a
      backend directly, in one process with the single-process backend, so no transport noise: best of many repeats.
2. all_reduce bandwidth (nccl-tests busbw) for 1 KiB - 64 MiB: raw torch.distributed vs flexrt.comm (logging off),
   in blocks whose order alternates per round. Bandwidth from each side's median block; ratio = median over rounds of
   (torch time / flexrt time) in the same round, which cancels drift that hits both (target >= 0.98).

Run: .venv/bin/python bench/comm_overhead.py
"""
import os, socket, statistics, sys, time, timeit
from datetime import timedelta
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

CALL_BLOCK, CALL_ROUNDS = 200, 50           # 1-element all_reduce across ranks: calls per block, rounds
SOLO_BLOCK, SOLO_ROUNDS = 200, 151          # same on a 1-rank subgroup, one rank at a time
SIZES = [2 ** k for k in range(10, 27, 2)]  # 1 KiB .. 64 MiB
BW_BLOCK_S, BW_ROUNDS = 0.005, 120          # bandwidth: seconds per block (at least one op), rounds per size

def _free_port():
    with socket.socket() as s: s.bind(('127.0.0.1', 0)); return s.getsockname()[1]

def _block(fn, t, iters, group=None):
    "Seconds per call of `fn(t)` over `iters` calls; on the world group, started and ended together on all ranks"
    if group is None: tdist.barrier()
    start = time.perf_counter()
    for _ in range(iters): fn(t)
    if group is None: tdist.barrier()
    return (time.perf_counter() - start) / iters

def _three_ways(dist, t, block, rounds, group=None):
    "Per-call seconds of raw torch, flexrt logging off, flexrt logging on: lists over rounds, order rotating per round"
    ours = lambda x: dist.all_reduce(x, group=group)
    runs = {'raw': (lambda x: tdist.all_reduce(x, group=group), False), 'off': (ours, False), 'on': (ours, True)}
    times = {k: [] for k in runs}
    for i in range(rounds):
        for k in list(runs)[i % 3:] + list(runs)[:i % 3]:
            fn, logging = runs[k]
            dist.configure(enabled=logging)
            times[k].append(_block(fn, t, block, group))
        dist.configure(enabled=False); dist.reset_log()
    return times['raw'], times['off'], times['on']

def _call_overhead(dist):
    t, med = torch.ones(1), statistics.median
    raw, off, on = _three_ways(dist, t, CALL_BLOCK, CALL_ROUNDS)
    cross = [med(raw), med(off), med(on), med([o - r for o, r in zip(off, raw)]), med([o - r for o, r in zip(on, raw)])]
    solo_groups = [tdist.new_group([r]) for r in range(tdist.get_world_size())]  # every rank creates every group
    for r in range(tdist.get_world_size()):  # one rank measures while the others wait, so they do not compete for cores
        if r == tdist.get_rank(): raw, off, on = _three_ways(dist, t, SOLO_BLOCK, SOLO_ROUNDS, solo_groups[r])
        tdist.barrier()
    solo = [med(raw), med(off), med(on), med([o - r for o, r in zip(off, raw)]), med([o - r for o, r in zip(on, raw)])]
    return [x * 1e6 for x in cross], [x * 1e6 for x in solo]

def _bandwidth(dist):
    n, rows = tdist.get_world_size(), []
    for size in SIZES:
        t = torch.ones(size // 4)
        one = torch.tensor([_block(tdist.all_reduce, t, 2)], dtype=torch.float64)  # warm-up, and seconds per op
        tdist.broadcast(one, 0)  # every rank must run the same number of ops: use rank 0's estimate
        one = max(one.item(), 1e-6)
        iters = max(1, int(BW_BLOCK_S / one))  # short blocks, many rounds: the median of many pairs is steady
        rounds = BW_ROUNDS
        raw, ours = [], []
        for i in range(rounds):  # alternate which side goes first
            pair = [(raw, tdist.all_reduce), (ours, dist.all_reduce)][::1 if i % 2 else -1]
            for times, fn in pair: times.append(_block(fn, t, iters))
        bus = lambda s: size / s * 2 * (n - 1) / n * 8 / 1e9
        med = statistics.median
        rows.append((size, bus(med(raw)), bus(med(ours)), med([r / o for r, o in zip(raw, ours)])))
    return rows

def _rank(rank, world_size, port, queue):
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from flexrt import comm as dist
    dist.init_distributed(backend='gloo', timeout=timedelta(seconds=60))
    calls, bw = _call_overhead(dist), _bandwidth(dist)
    if rank == 0: queue.put((calls, bw))
    tdist.barrier()
    dist.destroy_process_group()

def _own_layers():
    "ns per call that flexrt.comm adds above its backend, logging off and on (single process, no transport)"
    from flexrt import comm as dist
    from flexrt.comm.backends import SingleProcessBackend
    backend, t = SingleProcessBackend(), torch.ones(1)
    before = dist.set_comm_backend(backend)
    runs = {'direct': (lambda: backend.all_reduce(t), False), 'off': (lambda: dist.all_reduce(t), False),
            'on': (lambda: dist.all_reduce(t), True)}
    best = {k: float('inf') for k in runs}
    for _ in range(15):
        for k, (fn, logging) in runs.items():
            dist.configure(enabled=logging)
            best[k] = min(best[k], timeit.timeit(fn, number=20000) / 20000)
            dist.configure(enabled=False); dist.reset_log()
    dist.set_comm_backend(before)
    return (best['off'] - best['direct']) * 1e9, (best['on'] - best['direct']) * 1e9

def main():
    ctx = mp.get_context('spawn')
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs: p.start()
    (cross, solo), bw = queue.get(timeout=240)
    for p in procs: p.join(timeout=60)
    layers_off, layers_on = _own_layers()
    print(f"torch {torch.__version__}, 2 gloo ranks on {os.cpu_count()} CPU cores, python {sys.version.split()[0]}")
    for title, (raw, off, on, d_off, d_on) in (("a) across 2 ranks, median of blocks", cross),
                                                ("b) 1-rank subgroup (dispatch cost), median of blocks", solo)):
        print(f"\n1-element all_reduce per call, {title} (us):")
        print(f"  torch.distributed        {raw:8.2f}")
        print(f"  flexrt.comm, logging off {off:8.2f}   added {d_off:+7.2f} us (target <= 1 us)")
        print(f"  flexrt.comm, logging on  {on:8.2f}   added {d_on:+7.2f} us")
    print(f"\nc) flexrt.comm's own layers above the backend (ns per call, best of 15 x 20000):")
    print(f"  logging off {layers_off:8.0f} ns   logging on {layers_on:8.0f} ns")
    print("\nall_reduce bus bandwidth, logging off (Gbps, median block; ratio = median per-round flexrt/torch bandwidth):")
    print(f"  {'size':>9} {'torch':>9} {'flexrt':>9} {'ratio':>7}")
    for size, raw_bw, ours_bw, ratio in bw:
        label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        print(f"  {label:>9} {raw_bw:9.3f} {ours_bw:9.3f} {ratio:7.3f}")
    ratios = [r[3] for r in bw]
    print(f"  ratio: min {min(ratios):.3f}, geometric mean {statistics.geometric_mean(ratios):.3f} (target >= 0.98)")

if __name__ == '__main__':
    main()
