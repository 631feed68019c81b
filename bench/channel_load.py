"""Load on the kernel's record hub: many ranks emitting as fast as they can, a dashboard drawing in the kernel.

    python bench/channel_load.py [--ranks 16] [--seconds 60] [--pad 0] [--no-dashboard]

This process plays the notebook kernel: it opens a `TrainingDashboard` (which serves the hub and draws while records
arrive) and forks `--ranks` processes. Each rank, for `--seconds`, calls `monitor.emit('step', ...)` in a loop as fast
as it can (or `--rate` records per second, like a training loop) with records shaped like the engine's step records
(loss, grad norm, lr, a memory snapshot), then flushes.
Each rank times every `emit` call. Printed:

- records emitted, delivered to the kernel's listeners, and dropped at the ranks (full buffers) — every record is
  one or the other: emitted = delivered + dropped is checked;
- the kernel's resident memory (RSS) at the start, its largest value while the ranks ran, and at the end, sampled
  every 0.2 s;
- the longest time one `emit` call took on any rank (what a slow kernel costs the training loop), and the 99.99th
  percentile over all calls; as a control, the same for building the same record dict in the same loop without
  emitting it: on an oversubscribed machine both include the time a rank was not scheduled at all;
- the hub's counters (malformed, oversized, refused: all 0 here) and the dashboard's plots drawn.
"""
import argparse, multiprocessing as mp, os, statistics, sys, threading, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

def rank_main(rank: int, seconds: float, pad: int, rate: float, out):
    os.environ['RANK'] = str(rank)
    from flexrt import monitor
    record = dict(loss=1.0, grad_norm=0.5, grad_norm_post_clip=0.5, lr=[1e-3], loss_scale=1.0, skipped=False,
                  samples=0, samples_per_s=100.0, memory={'allocated_bytes': 1 << 20, 'max_allocated_bytes': 2 << 20,
                                                          'process_rss_bytes': 100 << 20}, note='x' * pad)
    start = time.perf_counter(); monitor.emit('log', rank=rank, note='first'); first = time.perf_counter() - start
    worst, cpu, times, plain, step, end = 0.0, 0, [], [], 0, time.perf_counter() + seconds
    while True:
        start, start_cpu = time.perf_counter(), time.thread_time_ns()
        if start > end: break
        monitor.emit('step', rank=rank, step=step, **record)
        took, cpu = time.perf_counter() - start, max(cpu, time.thread_time_ns() - start_cpu)
        times.append(took); worst = max(worst, took); step += 1
        start = time.perf_counter()                    # the control: the same record built, not emitted
        event = {'kind': 'step', 'time': start, 'rank': rank, 'step': step, **record}
        plain.append(time.perf_counter() - start)
        if rate: time.sleep(max(0.0, step / rate - (time.perf_counter() - end + seconds)))   # paced like a training loop
    times.sort(); plain.sort()
    forwarder = monitor.forwarder._forwarder                        # attached at fork: the kernel serves
    forwarder.flush(timeout=600)
    out.put((rank, step, forwarder.num_dropped + forwarder.num_unsendable, worst, times[int(len(times) * 0.9999)],
             plain[-1], plain[int(len(plain) * 0.9999)], cpu / 1e9, first))

def rss() -> int:
    import psutil
    return psutil.Process().memory_info().rss

def main(a):
    from flexrt import monitor
    from flexrt.widgets import TrainingDashboard
    dash = TrainingDashboard() if a.dashboard else None
    hub, delivered = monitor.serve(), {}
    def count(record):
        if record.get('kind') in ('step', 'log'): delivered[record['rank']] = delivered.get(record['rank'], 0) + 1
    monitor.add_listener(count)
    rss_start, peak, running = rss(), [rss()], threading.Event()
    running.set()
    timeline, t0 = [], time.perf_counter()
    def sample():
        while running.is_set():
            peak.append(rss()); time.sleep(0.2)
            if time.perf_counter() - t0 >= len(timeline) * a.seconds / 4 and len(timeline) < 5: timeline.append(peak[-1])
    sampler = threading.Thread(target=sample, daemon=True); sampler.start()
    ctx, out = mp.get_context('fork'), mp.get_context('fork').Queue()
    cpu, wall = time.process_time(), time.perf_counter()
    procs = [ctx.Process(target=rank_main, args=(r, a.seconds, a.pad, a.rate, out)) for r in range(a.ranks)]
    for p in procs: p.start()
    results = sorted(out.get() for _ in procs)
    for p in procs: p.join()
    running.clear(); sampler.join()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    emitted, dropped = sum(r[1] for r in results) + len(results), sum(r[2] for r in results)   # + the first 'log' each
    got = sum(delivered.values())
    print(f"{a.ranks} ranks (forked processes) emitting step records {f'at {a.rate:g}/s each' if a.rate else 'as fast as they can'} for {a.seconds:g} s, "
          f"{'a TrainingDashboard drawing' if dash else 'a counting listener only'} in the kernel; {os.cpu_count()} CPU cores")
    print(f"  emitted   {emitted:>12,d}  ({emitted / a.seconds:,.0f}/s)")
    print(f"  delivered {got:>12,d}  ({got / max(emitted, 1):.1%}; hub.num_received {hub.num_received:,d})")
    print(f"  dropped   {dropped:>12,d}  at the ranks' full buffers (hub.num_dropped {hub.num_dropped:,d})")
    print(f"  emitted == delivered + dropped: {emitted == got + dropped}; per rank: "
          f"{all(delivered.get(r[0], 0) + r[2] == r[1] + 1 for r in results)}")
    print(f"  kernel RSS: start {rss_start / 2**20:.0f} MiB, peak {max(peak) / 2**20:.0f} MiB, end {rss() / 2**20:.0f} MiB "
          f"(at 0, 1/4, 1/2, 3/4 and all of the run: {', '.join(f'{x / 2**20:.0f}' for x in timeline)} MiB)"
          + (f"; the dashboard keeps up to {dash.records.capacity:,d} records per kind" if dash else ''))
    print(f"  longest emit on any rank: {max(r[3] for r in results) * 1e3:.2f} ms; per rank "
          f"{', '.join(f'{r[3] * 1e3:.1f}' for r in results)} ms; 99.99th percentile (worst rank) "
          f"{max(r[4] for r in results) * 1e6:.0f} us")
    print(f"  control, the same record built in the same loop without emitting it (the machine's scheduling noise): "
          f"longest {max(r[5] for r in results) * 1e3:.2f} ms, 99.99th percentile {max(r[6] for r in results) * 1e6:.0f} us")
    print(f"  (not counted above: the first emit of each rank starts its sender thread: up to {max(r[8] for r in results) * 1e3:.2f} ms)")
    print(f"  the most CPU time one emit call used (thread time: its own work, without waiting to be scheduled): "
          f"{max(r[7] for r in results) * 1e6:.0f} us")
    plots = sum(getattr(v, 'num_plots', 0) for v in (dash.grad_norm, dash.memory)) if dash else 0
    print(f"  hub: {hub.stats()}; kernel CPU {cpu / wall:.0%} of one core; plots drawn {plots}")
    if dash: dash.close()
    monitor.stop_serving()

if __name__ == '__main__':
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--ranks', type=int, default=16); parser.add_argument('--seconds', type=float, default=60)
    parser.add_argument('--pad', type=int, default=0, help='extra bytes of text per record')
    parser.add_argument('--rate', type=float, default=0, help='records per second per rank (0: as fast as possible)')
    parser.add_argument('--no-dashboard', dest='dashboard', action='store_false', help='count records only')
    main(parser.parse_args())
