"""Cost of watching a run live: engine step time on 2 ranks with and without a dashboard attached, in one run.

    python bench/dashboard_overhead.py [--blocks 8] [--steps 10]

The kernel (this process) runs a `TrainingDashboard`, which starts the monitor's hub; two ranks are started with plain
`notebook_launcher`. Each rank trains the quickstart's tiny transformer with flexrt's engine in blocks of `--steps`
optimizer steps, alternating "detached" (the rank's forwarder removed: nobody listens, so the engine builds no
record) and "attached" (every step's record, with its memory snapshot, goes to the dashboard, which redraws its
plots in the kernel). Blocks interleave, so drift in machine speed hits both alike; each configuration's time is its
fastest block (slower blocks measure other processes). Printed: ms per step and the attached/detached ratio.
"""
import argparse, os, sys, time
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / 'examples'))

def rank_main(blocks: int, steps: int):
    import flexrt
    from flexrt import comm as dist, monitor
    from quickstart_train import tiny_transformer, CONFIG
    env = dist.init_distributed()
    forwarder = monitor._forwarder
    assert forwarder is not None, 'no dashboard hub in the environment'
    torch.manual_seed(0)
    model = tiny_transformer()
    engine, *_ = flexrt.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
    tokens = torch.randint(0, 256, (engine.train_micro_batch_size_per_gpu(), 32))
    def step():
        logits = engine(tokens[:, :-1])
        engine.backward(torch.nn.functional.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1)))
        engine.step()
    monitor.remove_listener(forwarder)
    for _ in range(3): step()                                  # warm up
    times = {'detached': [], 'attached': []}
    for block in range(2 * blocks):
        mode = 'attached' if block % 2 else 'detached'
        (monitor.add_listener if mode == 'attached' else monitor.remove_listener)(forwarder)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps): step()
        dist.barrier()
        times[mode].append((time.perf_counter() - start) / steps)
    monitor.add_listener(forwarder)
    if env.rank == 0: monitor.emit('bench', **{k: min(v) for k, v in times.items()})
    engine.close(); dist.destroy_process_group()

if __name__ == '__main__':
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--blocks', type=int, default=8); parser.add_argument('--steps', type=int, default=10)
    a = parser.parse_args()
    from accelerate import notebook_launcher
    from flexrt.widgets import TrainingDashboard
    from flexrt.launch import free_port
    from flexrt import monitor
    dash = TrainingDashboard(interval=float(os.environ.get("REDRAW_S", 0.5)))
    notebook_launcher(rank_main, (a.blocks, a.steps), num_processes=2, use_port=str(free_port()))
    result = dash.history.frame('bench').iloc[-1]
    steps = dash.history.frame('step')
    print(f"engine step on 2 CPU ranks, fastest of {a.blocks} blocks x {a.steps} steps each:")
    print(f"  detached (nobody listening): {result['detached'] * 1e3:8.2f} ms/step")
    print(f"  dashboard attached:          {result['attached'] * 1e3:8.2f} ms/step   ratio {result['attached'] / result['detached']:.3f}")
    print(f"  the dashboard received {len(steps)} step records "
          f"(expected {a.blocks * a.steps * 2}: attached blocks x 2 ranks), ranks dropped {monitor._hub.num_dropped}")
    dash.close()
