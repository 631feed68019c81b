"""Cost of watching a run live: engine step time on 2 ranks with and without a dashboard, interleaved in one run.

    python bench/dashboard_overhead.py [--rounds 3] [--blocks 6] [--steps 30] [--threads N] [--interval S]

This process plays the notebook kernel. Each round launches the ranks twice with plain `notebook_launcher`: once with
no dashboard anywhere (no hub, so the ranks forward nothing and the engine builds no record), and once with a
`TrainingDashboard` at its default settings in the kernel (every step's record, with its memory snapshot, goes to
the dashboard, which updates its texts and redraws its plots while the ranks train). Each launch trains the
quickstart's tiny transformer with flexrt's engine and times `--blocks` blocks of `--steps` optimizer steps. Rounds
alternate the two, so drift in machine speed hits both alike. Printed per configuration: the fastest and the median
block in ms per step, the ratios, and what the kernel did (plots drawn, their CPU cost, the kernel's CPU use).

`--threads` sets torch's threads per rank; the default, cores // ranks, is what torchrun and `accelerate launch`
give CPU ranks. Forked `notebook_launcher` ranks inherit the kernel's thread count instead (every core each), which
oversubscribes the cores: `--threads 0` keeps that, and then step times swing by tens of percent on their own.
"""
import argparse, os, statistics, sys, time
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / 'examples'))

def rank_main(blocks: int, steps: int, threads: int):
    import flexrt
    from flexrt import comm as dist, monitor
    from quickstart_train import tiny_transformer, CONFIG
    if threads: torch.set_num_threads(threads)
    env = dist.init_distributed()
    torch.manual_seed(0)
    model = tiny_transformer()
    engine, *_ = flexrt.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
    tokens = torch.randint(0, 256, (engine.train_micro_batch_size_per_gpu(), 32))
    def step():
        logits = engine(tokens[:, :-1])
        engine.backward(torch.nn.functional.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1)))
        engine.step()
    for _ in range(5): step()                                  # warm up
    times = []
    for block in range(blocks):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps): step()
        dist.barrier()
        times.append((time.perf_counter() - start) / steps)
    engine.close(); dist.destroy_process_group()
    if env.rank == 0:
        with open(os.environ['BENCH_TIMES'], 'a') as f: f.write(' '.join(map(str, times)) + '\n')

def launch_once(a, watched: bool, times_file: Path):
    "One launch; returns its block times and, when watched, the dashboard (closed)"
    from accelerate import notebook_launcher
    from flexrt.widgets import TrainingDashboard
    from flexrt.launch import free_port
    from flexrt import monitor
    monitor.stop_serving()                                     # no hub: the ranks forward nothing
    dash = (TrainingDashboard() if a.interval is None else TrainingDashboard(interval=a.interval)) if watched else None
    times_file.write_text('')
    notebook_launcher(rank_main, (a.blocks, a.steps, a.threads), num_processes=2, use_port=str(free_port()))
    if dash is not None: dash.close()
    return [float(t) for t in times_file.read_text().split()], dash

if __name__ == '__main__':
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--rounds', type=int, default=3); parser.add_argument('--blocks', type=int, default=6)
    parser.add_argument('--steps', type=int, default=30)
    parser.add_argument('--threads', type=int, default=max(1, (os.cpu_count() or 2) // 2),
                        help="torch threads per rank; 0: inherit the kernel's (oversubscribed)")
    parser.add_argument('--interval', type=float, default=None, help="the dashboard's interval (default: its own)")
    a = parser.parse_args()
    times_file = Path(os.environ.setdefault('BENCH_TIMES', f'/tmp/flexrt-dashboard-bench-{os.getpid()}.txt'))
    times, kernel, dashboards = {'no dashboard': [], 'dashboard': []}, {'cpu': 0.0, 'wall': 0.0}, []
    for round in range(a.rounds):
        for watched in (False, True):
            wall, cpu = time.perf_counter(), time.process_time()
            block_times, dash = launch_once(a, watched, times_file)
            times['dashboard' if watched else 'no dashboard'] += block_times
            if watched:
                dashboards.append(dash)
                kernel['cpu'] += time.process_time() - cpu; kernel['wall'] += time.perf_counter() - wall
    times_file.unlink()
    fast = {k: min(v) for k, v in times.items()}
    mid = {k: statistics.median(v) for k, v in times.items()}
    dash = dashboards[-1]
    print(f"engine step on 2 CPU ranks ({a.threads or torch.get_num_threads()} torch threads each), {a.rounds} rounds "
          f"x {a.blocks} blocks x {a.steps} steps per configuration, launches interleaved; dashboard interval "
          f"{dash.interval} s, plots within {getattr(dash, 'cpu_share', 1):.0%} of a core:")
    print(f"                               fastest block   median block")
    for k in times: print(f"  {k + ':':28s} {fast[k] * 1e3:8.2f} ms/step {mid[k] * 1e3:9.2f} ms/step")
    print(f"  ratio dashboard / none:      {fast['dashboard'] / fast['no dashboard']:8.3f}         "
          f"{mid['dashboard'] / mid['no dashboard']:9.3f}")
    steps = [len(d.history.frame('step')) for d in dashboards]
    plots = [sum(getattr(v, 'num_plots', 0) for v in (d.grad_norm, d.memory)) for d in dashboards]
    print(f"  each dashboard received {steps} step records (expected {a.blocks * a.steps * 2 + 10}: blocks and warm-up "
          f"x 2 ranks) and drew {plots} plots; while watching, the kernel used {kernel['cpu'] / kernel['wall']:.1%} "
          f"of one core (launching included)")
