"""Cost of watching a run live: engine step time on 2 ranks with and without a dashboard, interleaved in one run.

    python bench/dashboard_overhead.py [--launcher launch|kernel|torchrun|notebook_launcher] [--rounds 3] [--blocks 6]
                                       [--steps 30] [--settle S] [--threads N] [--interval S] [--cpu-share F]
                                       [--toggle | --toggle-all | --toggle-anatomy]

A "kernel" launches the ranks and holds the dashboard: by default this process (`--launcher launch`: it calls
`flexrt.launch(rank_main, num_processes=2)` as a notebook cell would), or a real Jupyter kernel driven through nbclient
(`--launcher kernel`: each launch is a cell that builds the dashboard and calls `flexrt.launch`, the notebook user's
exact path), or this process watching ranks that `torchrun` starts (`--launcher torchrun`), or this process with
accelerate's plain `notebook_launcher` (`--launcher notebook_launcher`, how this bench ran before #35). Each round
launches the ranks twice: once with no dashboard anywhere, and once with a `TrainingDashboard` at its default settings
in the kernel (every step's record, with its memory snapshot, goes to the dashboard, which updates its texts and
redraws its plots while the ranks train). Without a dashboard, plain `notebook_launcher`'s and torchrun's ranks forward
nothing (no hub); `flexrt.launch` serves a hub either way, so its unwatched ranks still build and forward their
records: the ratio is then what a dashboard adds to what a user's launch already does. Each launch trains the
quickstart's tiny transformer with flexrt's engine and times `--blocks` blocks of `--steps` optimizer steps, after
`--settle` seconds of untimed steps (the dashboard's first look, when every panel draws its first plot at once, costs
the kernel about 0.7 s of CPU: a steady-state ratio must not depend on which block it falls in; the first look is
timed on its own line). Rounds
alternate the two (and which goes first), so drift in machine speed hits both alike. Printed: how the ranks ran (their
torch threads on entry and while timing, read in the ranks), per configuration the fastest and the median block in ms
per step, their ratios, the ratio paired by round (the median over rounds of watched / unwatched median block), and
what the kernel did (plots drawn, the kernel's CPU use).

`--toggle` measures inside launches instead: one launch per round with a dashboard, whose ranks forward their records
in every other block (a record is then built and sent, and the kernel receives and draws) and not in the others;
the ratio of each pair of neighbouring blocks cancels the launch-to-launch noise. The kernel may still be drawing
the last records in the first steps of a quiet block, which the toggled ratio then misses. `--toggle-all` also
switches off, in the quiet blocks, the rest of what watching adds on a rank: the per-layer norms, the per-bucket
probe and the blocked-time accounting, and the step anatomy (what stays: the kernel's idle threads and the ranks' idle
sender thread). `--toggle-anatomy` keeps everything on in every block but the step anatomy (`flexrt.engine.anatomy`:
the phase clocks, the per-step sums, the CPU and thread reads), which is off in every other block: its own cost.

A watched launch has every panel on, at the dashboard's defaults: each step record carries the rank's time blocked in
collectives (the ranks panel), the first non-finite value is looked for (one `isfinite` on the norm the engine already
computes, plus a sum per gradient bucket so the rank can be named), and per-layer gradient norms come every 10 steps
(the heatmap); `--layer-norms-every N` samples them every N steps instead (`diagnostics.layer_norms_every`).

Each watched launch also times the first look: from the first step record reaching the kernel to the gradient-norm
plot's first drawing (the goal: under 1 s; the browser test only checks that the plot comes).

`--interval` and `--cpu-share` set the dashboard's text interval and its plots' CPU budget (an ablation: what the
kernel's drawing costs the ranks). No launcher but `notebook_launcher` sets a thread count in the ranks: they run with
what flexrt gives a user's (cores // ranks, or the user's own choice). With `--launcher notebook_launcher`, `--threads`
sets torch's threads per rank (default cores // ranks); `--threads 0` keeps what the forked ranks inherit from this
process (every core each, oversubscribed, until flexrt's engine sizes them).
"""
import argparse, json, os, statistics, sys, time
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / 'examples'))

def set_watch(engine, on: bool):
    "Switch everything watching adds on a rank (per-layer norms, the per-bucket probe, the blocked-time accounting)"
    from flexrt import comm as dist
    w = engine.watch
    w.layer_norms.every = w._every if on else 0
    nf = w.nonfinite
    if on and not nf.probing:
        nf.slot.add_reduction_hook(nf._probe)
        nf.probing = True
    if not on and nf.probing:
        nf.slot.remove_reduction_hook(nf._probe)
        nf.probing = False
    if on != w.comm_wait.on: dist.comms_logger.watch_blocked(on); w.comm_wait.on = on
    set_anatomy(engine, on)

def set_anatomy(engine, on: bool):
    "Switch a rank's step anatomy (and its own blocked-time watch) on or off; switched on, it starts afresh"
    from flexrt import comm as dist
    a = engine.anatomy
    if on == a.on: return
    dist.comms_logger.watch_blocked(on); a.on = on
    if on: a.step_start, a.idle_since, a.sums_before = None, None, dist.comms_logger.blocked_sums()

def settle(step, seconds: float) -> int:  # the steps it took
    """Warm-up steps until `seconds` have passed on rank 0 (5 at least; every rank stops at the same step): the kernel's
    first look, every panel's first plot drawn at once as its first records come, is over before the timed blocks"""
    from flexrt import comm as dist
    done, start, n = torch.zeros(1), time.perf_counter(), 0
    while not done.item():
        step(); n += 1
        done[0] = float(n >= 5 and time.perf_counter() - start >= seconds)
        dist.broadcast(done, 0)
    return n

def rank_main(blocks: int, steps: int, threads: int, toggle: bool = False, layer_norms_every: int | None = None,
              toggle_all: bool = False, toggle_anatomy: bool = False, settle_s: float = 2.0):
    import flexrt
    from flexrt import comm as dist, monitor
    from quickstart_train import tiny_transformer, CONFIG
    threads_given = torch.get_num_threads()   # what the launcher gave this rank
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
    warmup = settle(step, settle_s)
    engine.watch._every = engine.watch.layer_norms.every
    times = []
    forwarders = [fn for fn in monitor.events._listeners if isinstance(fn, monitor.Forwarder)]
    for block in range(blocks):
        if toggle:   # blocks in pairs, one forwarding and one not, the order alternating between pairs
            on = (block % 2 == 0) == (block // 2 % 2 == 0)
            if toggle_anatomy: set_anatomy(engine, on)
            else:
                for fn in forwarders: monitor.add_listener(fn) if on else monitor.remove_listener(fn)
            if toggle_all: set_watch(engine, on)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps): step()
        dist.barrier()
        times.append((time.perf_counter() - start) / steps)
    during = torch.get_num_threads()   # what the steps ran with (the engine sizes it when built)
    engine.close(); dist.destroy_process_group()
    with open(os.environ['BENCH_TIMES'], 'a') as f:   # one short line per rank: appended whole
        f.write(json.dumps(dict(rank=env.rank, times=times, threads_given=threads_given, threads=during,
                                warmup=warmup)) + '\n')

def first_look(dash)->dict:
    "Note (monotonic) when the first step record reaches the kernel and when the gradient-norm plot is first drawn"
    from flexrt import monitor
    seen = {}
    def on_record(record): record.get('kind') == 'step' and seen.setdefault('record', time.monotonic())
    dash.grad_norm.plot.observe(lambda change: seen.setdefault('plot', time.monotonic()), names='value')
    monitor.add_listener(on_record)                            # after the dashboard's store: it has the record first
    seen['stop'] = lambda: monitor.remove_listener(on_record)
    return seen

def start_ranks(options: dict, rank_args: tuple)->str | None: # what the launcher said about the ranks
    "Start the 2 ranks of one launch from this process as `options['launcher']` says; wait for them"
    from launchers import Torchrun, launch_here
    if options['launcher'] == 'notebook_launcher':
        from accelerate import notebook_launcher
        from flexrt.launch import free_port
        notebook_launcher(rank_main, rank_args, num_processes=2, use_port=str(free_port()))
        return None
    if options['launcher'] == 'torchrun':   # with this process's hub when it serves one: a dashboard here watches them
        ran = Torchrun(options['out'], keep_monitor=True)
        ran.run(__file__, 'rank_main', rank_args)
        return ran.launch_line
    return launch_here(rank_main, rank_args)   # 'launch', and 'kernel' (this process is then the kernel)

def watch_once(options: dict, watched: bool, result_file: str | None = None)->dict:
    "One launch from this process, which plays the kernel, with a dashboard here or none; what it measured"
    from flexrt.widgets import TrainingDashboard
    from flexrt import monitor
    monitor.stop_serving()   # no hub: notebook_launcher's and torchrun's ranks forward nothing (flexrt.launch serves)
    chosen = {k: options[k] for k in ('interval', 'cpu_share') if options[k] is not None}
    dash = TrainingDashboard(**chosen) if watched else None
    seen = first_look(dash) if dash is not None else None
    times_file = Path(options['times_file'])
    times_file.write_text('')
    os.environ['BENCH_TIMES'] = str(times_file)
    rank_args = tuple(options[k] for k in ('blocks', 'steps', 'threads', 'toggle', 'layer_norms_every', 'toggle_all',
                                           'toggle_anatomy', 'settle'))
    wall, cpu = time.perf_counter(), time.process_time()
    said = start_ranks(options, rank_args)
    got = dict(kernel_cpu=time.process_time() - cpu, kernel_wall=time.perf_counter() - wall, launch_line=said)
    ranks = sorted((json.loads(line) for line in times_file.read_text().splitlines()), key=lambda r: r['rank'])
    got.update(times=ranks[0]['times'], warmup=ranks[0]['warmup'], threads_given=[r['threads_given'] for r in ranks],
               threads=[r['threads'] for r in ranks])
    if dash is not None:
        dash.close(); seen['stop']()
        got.update(first_look_s=seen['plot'] - seen['record'] if {'plot', 'record'} <= seen.keys() else float('nan'),
                   step_records=len(dash.records.frame('step')), interval=dash.interval,
                   cpu_share=getattr(dash, 'cpu_share', 1),
                   plots=sum(getattr(v, 'num_plots', 0) for v in (dash.grad_norm, dash.memory)))
    if result_file: Path(result_file).write_text(json.dumps(got))
    return got

class InKernel:
    "Each launch from a cell of one real Jupyter kernel (nbclient): the dashboard and the launch call live there"
    def __init__(self, out: str):
        from launchers import Kernel
        self.kernel, self.out, self.count = Kernel(out), Path(out), 0
        self.kernel.execute('import dashboard_overhead as bench')

    def __call__(self, options: dict, watched: bool)->dict:
        self.count += 1
        path = self.out / f'watch{self.count}.json'
        self.kernel.execute(f'got = bench.watch_once(json.loads({json.dumps(options)!r}), {watched}, {str(path)!r})')
        return json.loads(path.read_text())

    def close(self): self.kernel.close()

def launching(a):
    "The launches' options, and the callable that runs one (`watch(options, watched) -> dict`) where --launcher says"
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    toggle = a.toggle or a.toggle_all or a.toggle_anatomy
    options = dict(blocks=a.blocks, steps=a.steps, threads=a.threads, toggle=toggle,
                   layer_norms_every=a.layer_norms_every, toggle_all=a.toggle_all, toggle_anatomy=a.toggle_anatomy,
                   interval=a.interval, settle=a.settle,
                   cpu_share=a.cpu_share, launcher=a.launcher, out=str(out), times_file=str(out / 'times.jsonl'))
    return options, (InKernel(str(out)) if a.launcher == 'kernel' else watch_once)

def ranks_words(a, got: dict)->str:
    "How the ranks ran: launcher, torch threads on entry and while timing (read in the ranks)"
    chosen = f' (--threads {a.threads}, set in the rank)' if a.threads else ''
    said = f"; it said: {got['launch_line']}" if got['launch_line'] else ''
    return (f"ranks started by {a.launcher}{chosen}: torch threads per rank {','.join(map(str, got['threads_given']))} "
            f"on entry, {','.join(map(str, got['threads']))} while timing{said}")

def toggled(a):
    "Launches with a dashboard whose ranks forward every other block: paired blocks inside one launch"
    a.blocks += a.blocks % 4   # whole (on, off) + (off, on) quartets
    options, watch = launching(a)
    ratios, fast = [], {True: [], False: []}
    try:
        for round in range(a.rounds):
            got = watch(options, True)
            block_times = got['times']
            ons = [t for b, t in enumerate(block_times) if (b % 2 == 0) == (b // 2 % 2 == 0)]
            offs = [t for b, t in enumerate(block_times) if (b % 2 == 0) != (b // 2 % 2 == 0)]
            ratios += [x / y for x, y in zip(ons, offs)]; fast[True] += ons; fast[False] += offs
    finally:
        if watch is not watch_once: watch.close()
    what = ('forward their records and do all watching work' if a.toggle_all else
            'record the step anatomy (all else on throughout)' if a.toggle_anatomy else 'forward their records')
    print(f"engine step on 2 CPU ranks, {a.rounds} launches x {a.blocks} blocks x {a.steps} steps, a dashboard in the kernel; "
          f"the ranks {what} in every other block (pairs inside one launch); {ranks_words(a, got)}:")
    print(f"  {'anatomy on / off' if a.toggle_anatomy else 'forwarding / not'}, paired blocks: median {statistics.median(ratios):.3f} over {len(ratios)} pairs "
          f"(quartiles {statistics.quantiles(ratios, n=4)[0]:.3f}-{statistics.quantiles(ratios, n=4)[2]:.3f}); "
          f"fastest blocks {min(fast[True]) * 1e3:.2f} vs {min(fast[False]) * 1e3:.2f} ms/step")

def interleaved(a):
    "Rounds of two launches, one watched and one not, the order alternating; the table"
    options, watch = launching(a)
    times, kernel, watches = {'no dashboard': [], 'dashboard': []}, {'cpu': 0.0, 'wall': 0.0}, []
    paired = []   # per round: median block watched / median block unwatched (cancels drift between rounds)
    try:
        for round in range(a.rounds):
            medians = {}
            for watched in ((False, True) if round % 2 == 0 else (True, False)):
                got = watch(options, watched)
                times['dashboard' if watched else 'no dashboard'] += got['times']
                medians[watched] = statistics.median(got['times'])
                if watched:
                    watches.append(got)
                    kernel['cpu'] += got['kernel_cpu']; kernel['wall'] += got['kernel_wall']
            paired.append(medians[True] / medians[False])
    finally:
        if watch is not watch_once: watch.close()
    fast = {k: min(v) for k, v in times.items()}
    mid = {k: statistics.median(v) for k, v in times.items()}
    last = watches[-1]
    unwatched = ('flexrt.launch serves a hub either way: unwatched ranks still forward their records'
                 if a.launcher in ('launch', 'kernel') else 'unwatched ranks forward nothing (no hub)')
    print(f"engine step on 2 CPU ranks, {a.rounds} rounds x {a.blocks} blocks x {a.steps} steps per configuration, "
          f"launches interleaved; {ranks_words(a, last)}; {unwatched}; dashboard interval {last['interval']} s, plots "
          f"within {last['cpu_share']:.0%} of a core while one is idle:")
    print(f"                               fastest block   median block")
    for k in times: print(f"  {k + ':':28s} {fast[k] * 1e3:8.2f} ms/step {mid[k] * 1e3:9.2f} ms/step")
    print(f"  ratio dashboard / none:      {fast['dashboard'] / fast['no dashboard']:8.3f}         "
          f"{mid['dashboard'] / mid['no dashboard']:9.3f}")
    print(f"  paired by round (median over rounds of watched / unwatched median block): "
          f"{statistics.median(paired):.3f} (rounds: {', '.join(f'{r:.3f}' for r in paired)})")
    looks = [w['first_look_s'] * 1e3 for w in watches]
    print(f"  first look: the gradient-norm plot drawn {statistics.median(looks):.0f} ms (median; launches: "
          f"{', '.join(f'{x:.0f}' for x in looks)}) after the first step record reached the kernel "
          f"(goal: under 1000 ms)")
    expected = [(a.blocks * a.steps + w['warmup']) * 2 for w in watches]
    print(f"  each dashboard received {[w['step_records'] for w in watches]} step records (expected {expected}: "
          f"blocks and warm-up x 2 ranks) and drew {[w['plots'] for w in watches]} plots; while watching, "
          f"the kernel used {kernel['cpu'] / kernel['wall']:.1%} of one core (launches too)")

if __name__ == '__main__':
    sys.path.insert(0, str(Path(__file__).resolve().parent))   # bench/launchers.py
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--rounds', type=int, default=3); parser.add_argument('--blocks', type=int, default=6)
    parser.add_argument('--steps', type=int, default=30)
    parser.add_argument('--launcher', default='launch', choices=['launch', 'kernel', 'torchrun', 'notebook_launcher'],
                        help="how the ranks start: flexrt.launch from this process (default), flexrt.launch from a "
                             "cell of a Jupyter kernel (the dashboard lives there too), torchrun (the dashboard here "
                             "watches it), or accelerate's notebook_launcher from this process (--threads in ranks)")
    parser.add_argument('--threads', type=int, default=None,
                        help="--launcher notebook_launcher only: torch threads per rank (default cores // ranks; "
                             "0: inherit this process's, oversubscribed)")
    parser.add_argument('--out', default='bench_out/dashboard_overhead',
                        help="the ranks' timing files (and the kernel's notebook)")
    parser.add_argument('--settle', type=float, default=2.0,
                        help="seconds of untimed warm-up steps before the blocks (default 2): the dashboard's first "
                             "look, every panel's first plot drawn at once, falls there and not in a timed block")
    parser.add_argument('--interval', type=float, default=None, help="the dashboard's interval (default: its own)")
    parser.add_argument('--cpu-share', type=float, default=None, help="the share of a core the dashboard's plots may use (default: its own, 0.05)")
    parser.add_argument('--layer-norms-every', type=int, default=None, help="per-layer norms every N steps (default: the dashboard's, 10)")
    parser.add_argument('--toggle', action='store_true',
                        help="one watched launch per round whose blocks alternate forwarding on and off (pairs within a launch)")
    parser.add_argument('--toggle-all', action='store_true',
                        help="as --toggle, and the off blocks also skip the layer norms, the per-bucket probe and the blocked-time accounting")
    parser.add_argument('--toggle-anatomy', action='store_true',
                        help="one watched launch per round whose blocks alternate the step anatomy on and off (all else on)")
    a = parser.parse_args()
    if a.launcher != 'notebook_launcher' and a.threads is not None:
        parser.error('--threads sets the count in the ranks, which only --launcher notebook_launcher does: the other '
                     'launchers measure the threads users get')
    if a.threads is None: a.threads = max(1, (os.cpu_count() or 2) // 2) if a.launcher == 'notebook_launcher' else 0
    sys.exit(toggled(a) if a.toggle or a.toggle_all or a.toggle_anatomy else interleaved(a))
