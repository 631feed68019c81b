"""Cost of watching a run live: engine step time on 2 ranks with and without a dashboard, interleaved in one run.

    python bench/dashboard_overhead.py [--rounds 3] [--blocks 6] [--steps 30] [--threads N] [--interval S] [--cpu-share F] [--toggle | --toggle-all]

This process plays the notebook kernel. Each round launches the ranks twice with plain `notebook_launcher`: once with
no dashboard anywhere (no hub, so the ranks forward nothing and the engine builds no record), and once with a
`TrainingDashboard` at its default settings in the kernel (every step's record, with its memory snapshot, goes to
the dashboard, which updates its texts and redraws its plots while the ranks train). Each launch trains the
quickstart's tiny transformer with flexrt's engine and times `--blocks` blocks of `--steps` optimizer steps. Rounds
alternate the two (and which goes first), so drift in machine speed hits both alike. Printed per configuration: the
fastest and the median block in ms per step, their ratios, the ratio paired by round (the median over rounds of
watched / unwatched median block), and what the kernel did (plots drawn, the kernel's CPU use).

`--toggle` measures inside launches instead: one launch per round with a dashboard, whose ranks forward their records
in every other block (a record is then built and sent, and the kernel receives and draws) and not in the others;
the ratio of each pair of neighbouring blocks cancels the launch-to-launch noise. The kernel may still be drawing
the last records in the first steps of a quiet block, which the toggled ratio then misses. `--toggle-all` also
switches off, in the quiet blocks, the rest of what watching adds on a rank: the per-layer norms, the per-bucket
probe and the blocked-time accounting (what stays: the kernel's idle threads and the ranks' idle sender thread).

A watched launch has every panel on, at the dashboard's defaults: each step record carries the rank's time blocked in
collectives (the ranks panel), the first non-finite value is looked for (one `isfinite` on the norm the engine already
computes, plus a sum per gradient bucket so the rank can be named), and per-layer gradient norms come every 10 steps
(the heatmap); `--layer-norms-every N` samples them every N steps instead (`diagnostics.layer_norms_every`).

Each watched launch also times the first look: from the first step record reaching the kernel to the gradient-norm
plot's first drawing (the goal: under 1 s; the browser test only checks that the plot comes).

`--interval` and `--cpu-share` set the dashboard's text interval and its plots' CPU budget (an ablation: what the
kernel's drawing costs the ranks). `--threads` sets torch's threads per rank; the default, cores // ranks, is what torchrun and `accelerate launch`
give CPU ranks. Forked `notebook_launcher` ranks inherit the kernel's thread count instead (every core each), which
oversubscribes the cores: `--threads 0` keeps that, and then step times swing by tens of percent on their own.
"""
import argparse, os, statistics, sys, time
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / 'examples'))

def set_watch(engine, on: bool):
    "Switch everything watching adds on a rank (per-layer norms, the per-bucket probe, the blocked-time accounting)"
    from flexrt import comm as dist
    w = engine.watch
    w.layer_norms.every = w._every if on else 0
    probes, probe = w.nonfinite._reducer.before_reduction if w.nonfinite._reducer is not None else [], w.nonfinite._probe
    if on and probe not in probes and w.nonfinite._reducer is not None: probes.append(probe)
    if not on and probe in probes: probes.remove(probe)
    if on != w.comm_wait.on: dist.comms_logger.watch_blocked(on); w.comm_wait.on = on

def rank_main(blocks: int, steps: int, threads: int, toggle: bool = False, layer_norms_every: int | None = None,
              toggle_all: bool = False):
    import flexrt
    from flexrt import comm as dist, monitor
    from quickstart_train import tiny_transformer, CONFIG
    if threads: torch.set_num_threads(threads)
    env = dist.init_distributed()
    torch.manual_seed(0)
    model = tiny_transformer()
    config = CONFIG if layer_norms_every is None else {**CONFIG, 'diagnostics': {'layer_norms_every': layer_norms_every}}
    engine, *_ = flexrt.initialize(model=model, model_parameters=model.parameters(), config=config)
    tokens = torch.randint(0, 256, (engine.train_micro_batch_size_per_gpu(), 32))
    def step():
        logits = engine(tokens[:, :-1])
        engine.backward(torch.nn.functional.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1)))
        engine.step()
    for _ in range(5): step()                                  # warm up
    engine.watch._every = engine.watch.layer_norms.every
    times = []
    forwarders = [fn for fn in monitor.events._listeners if isinstance(fn, monitor.Forwarder)]
    for block in range(blocks):
        if toggle:   # blocks in pairs, one forwarding and one not, the order alternating between pairs
            on = (block % 2 == 0) == (block // 2 % 2 == 0)
            for fn in forwarders: monitor.add_listener(fn) if on else monitor.remove_listener(fn)
            if toggle_all: set_watch(engine, on)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps): step()
        dist.barrier()
        times.append((time.perf_counter() - start) / steps)
    engine.close(); dist.destroy_process_group()
    if env.rank == 0:
        with open(os.environ['BENCH_TIMES'], 'a') as f: f.write(' '.join(map(str, times)) + '\n')

def first_look(dash)->dict:
    "Note (monotonic) when the first step record reaches the kernel and when the gradient-norm plot is first drawn"
    from flexrt import monitor
    seen = {}
    def on_record(record): record.get('kind') == 'step' and seen.setdefault('record', time.monotonic())
    dash.grad_norm.plot.observe(lambda change: seen.setdefault('plot', time.monotonic()), names='value')
    monitor.add_listener(on_record)                            # after the dashboard's store: it has the record first
    seen['stop'] = lambda: monitor.remove_listener(on_record)
    return seen

def launch_once(a, watched: bool, times_file: Path):
    "One launch; returns its block times and, when watched, the dashboard (closed) with `first_look_s` set"
    from accelerate import notebook_launcher
    from flexrt.widgets import TrainingDashboard
    from flexrt.launch import free_port
    from flexrt import monitor
    monitor.stop_serving()                                     # no hub: the ranks forward nothing
    options = {k: v for k, v in (('interval', a.interval), ('cpu_share', a.cpu_share)) if v is not None}
    dash = TrainingDashboard(**options) if watched else None
    seen = first_look(dash) if dash is not None else None
    times_file.write_text('')
    notebook_launcher(rank_main, (a.blocks, a.steps, a.threads, a.toggle or a.toggle_all, a.layer_norms_every, a.toggle_all),
                      num_processes=2, use_port=str(free_port()))
    if dash is not None:
        dash.close(); seen['stop']()
        dash.first_look_s = seen['plot'] - seen['record'] if {'plot', 'record'} <= seen.keys() else float('nan')
    return [float(t) for t in times_file.read_text().split()], dash

def toggled(a):
    "Launches with a dashboard whose ranks forward every other block: paired blocks inside one launch"
    times_file = Path(os.environ.setdefault('BENCH_TIMES', f'/tmp/flexrt-dashboard-bench-{os.getpid()}.txt'))
    a.blocks += a.blocks % 4   # whole (on, off) + (off, on) quartets
    ratios, fast = [], {True: [], False: []}
    for round in range(a.rounds):
        block_times, dash = launch_once(a, True, times_file)
        ons = [t for b, t in enumerate(block_times) if (b % 2 == 0) == (b // 2 % 2 == 0)]
        offs = [t for b, t in enumerate(block_times) if (b % 2 == 0) != (b // 2 % 2 == 0)]
        ratios += [x / y for x, y in zip(ons, offs)]; fast[True] += ons; fast[False] += offs
    times_file.unlink()
    what = 'forward their records and do all watching work' if a.toggle_all else 'forward their records'
    print(f"engine step on 2 CPU ranks, {a.rounds} launches x {a.blocks} blocks x {a.steps} steps, a dashboard in the kernel; "
          f"the ranks {what} in every other block (pairs inside one launch):")
    print(f"  forwarding / not, paired blocks: median {statistics.median(ratios):.3f} over {len(ratios)} pairs "
          f"(quartiles {statistics.quantiles(ratios, n=4)[0]:.3f}-{statistics.quantiles(ratios, n=4)[2]:.3f}); "
          f"fastest blocks {min(fast[True]) * 1e3:.2f} vs {min(fast[False]) * 1e3:.2f} ms/step")

if __name__ == '__main__':
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--rounds', type=int, default=3); parser.add_argument('--blocks', type=int, default=6)
    parser.add_argument('--steps', type=int, default=30)
    parser.add_argument('--threads', type=int, default=max(1, (os.cpu_count() or 2) // 2),
                        help="torch threads per rank; 0: inherit the kernel's (oversubscribed)")
    parser.add_argument('--interval', type=float, default=None, help="the dashboard's interval (default: its own)")
    parser.add_argument('--cpu-share', type=float, default=None, help="the share of a core the dashboard's plots may use (default: its own, 0.05)")
    parser.add_argument('--layer-norms-every', type=int, default=None, help="per-layer norms every N steps (default: the dashboard's, 10)")
    parser.add_argument('--toggle', action='store_true',
                        help="one watched launch per round whose blocks alternate forwarding on and off (pairs within a launch)")
    parser.add_argument('--toggle-all', action='store_true',
                        help="as --toggle, and the off blocks also skip the layer norms, the per-bucket probe and the blocked-time accounting")
    a = parser.parse_args()
    if a.toggle or a.toggle_all: sys.exit(toggled(a))
    times_file = Path(os.environ.setdefault('BENCH_TIMES', f'/tmp/flexrt-dashboard-bench-{os.getpid()}.txt'))
    times, kernel, dashboards = {'no dashboard': [], 'dashboard': []}, {'cpu': 0.0, 'wall': 0.0}, []
    paired = []   # per round: median block watched / median block unwatched (cancels drift between rounds)
    for round in range(a.rounds):
        medians = {}
        for watched in ((False, True) if round % 2 == 0 else (True, False)):
            wall, cpu = time.perf_counter(), time.process_time()
            block_times, dash = launch_once(a, watched, times_file)
            times['dashboard' if watched else 'no dashboard'] += block_times
            medians[watched] = statistics.median(block_times)
            if watched:
                dashboards.append(dash)
                kernel['cpu'] += time.process_time() - cpu; kernel['wall'] += time.perf_counter() - wall
        paired.append(medians[True] / medians[False])
    times_file.unlink()
    fast = {k: min(v) for k, v in times.items()}
    mid = {k: statistics.median(v) for k, v in times.items()}
    dash = dashboards[-1]
    print(f"engine step on 2 CPU ranks ({a.threads or torch.get_num_threads()} torch threads each), {a.rounds} rounds "
          f"x {a.blocks} blocks x {a.steps} steps per configuration, launches interleaved; dashboard interval "
          f"{dash.interval} s, plots within {getattr(dash, 'cpu_share', 1):.0%} of a core while one is idle:")
    print(f"                               fastest block   median block")
    for k in times: print(f"  {k + ':':28s} {fast[k] * 1e3:8.2f} ms/step {mid[k] * 1e3:9.2f} ms/step")
    print(f"  ratio dashboard / none:      {fast['dashboard'] / fast['no dashboard']:8.3f}         "
          f"{mid['dashboard'] / mid['no dashboard']:9.3f}")
    print(f"  paired by round (median over rounds of watched / unwatched median block): {statistics.median(paired):.3f} "
          f"(rounds: {', '.join(f'{r:.3f}' for r in paired)})")
    steps = [len(d.records.frame('step')) for d in dashboards]
    plots = [sum(getattr(v, 'num_plots', 0) for v in (d.grad_norm, d.memory)) for d in dashboards]
    looks = [d.first_look_s * 1e3 for d in dashboards]
    print(f"  first look: the gradient-norm plot drawn {statistics.median(looks):.0f} ms (median; launches: "
          f"{', '.join(f'{x:.0f}' for x in looks)}) after the first step record reached the kernel (goal: under 1000 ms)")
    print(f"  each dashboard received {steps} step records (expected {a.blocks * a.steps * 2 + 10}: blocks and warm-up "
          f"x 2 ranks) and drew {plots} plots; while watching, the kernel used {kernel['cpu'] / kernel['wall']:.1%} "
          f"of one core (launching included)")
