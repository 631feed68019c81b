"""Overhead of memory monitoring on a training loop: MemorySampler, TensorMemoryTracker, both.

    python bench/memory_sampler.py [--steps 40] [--rounds 12] [--interval-ms 10]

Runs a small MLP training step (AdamW) in blocks of `--steps` steps. Every round runs one block of each
configuration, in a shuffled order (interleaved, so drift in machine speed hits all of them alike). A
configuration's time is its fastest block (as timeit does: slower blocks measure other processes, not this code),
and the ratio printed is that time over the plain loop's.
A second, larger model shows how the tracker's per-operator cost shrinks when operators do real work.
"""
import argparse, random, time
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from flexrt.memory import MemorySampler, memory_snapshot
from flexrt.memory.tracker import TensorMemoryTracker

def make_step(width:int, batch:int, depth:int=3):
    "A training step closure for an MLP `depth` layers deep"
    torch.manual_seed(0)
    layers = []
    for _ in range(depth - 1): layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    x, y = torch.randn(batch, width), torch.randint(0, 10, (batch,))
    def step():
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
    return step

def run_block(step, steps:int, config:str, interval_ms:float)->float:
    "Seconds per step for one block under `config`"
    tracker = TensorMemoryTracker() if 'tracker' in config else None
    sampler = MemorySampler(interval_ms=interval_ms, capacity=1000) if 'sampler' in config else None
    if tracker: tracker.enable()
    if sampler: sampler.start()
    try:
        start = time.perf_counter()
        for _ in range(steps): step()
        return (time.perf_counter() - start) / steps
    finally:
        if sampler: sampler.stop()
        if tracker: tracker.disable()

def compare(step, steps:int, rounds:int, interval_ms:float)->dict:
    "Median per-round ratio of each configuration's step time to the plain one, and the plain step time"
    configs = ['plain', 'sampler', 'tracker', 'tracker+sampler']
    for config in configs: run_block(step, 3, config, interval_ms)  # warm up
    times = {c: [] for c in configs}
    for _ in range(rounds):
        for config in random.sample(configs, len(configs)): times[config].append(run_block(step, steps, config, interval_ms))
    best = {c: min(t) for c, t in times.items()}  # the least-disturbed block of each (timeit's rule)
    return dict(plain_ms=best['plain'] * 1e3, **{c: best[c] / best['plain'] for c in configs[1:]})

class _CountOps(TorchDispatchMode):
    "Counts the operators that reach the dispatcher"
    def __init__(self): super().__init__(); self.count = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))

def ops_per_step(step)->int:
    "Operators one step dispatches (each is one round trip through the tracker)"
    with _CountOps() as counter: step()
    return counter.count

def snapshot_cost_us(n:int=2000)->float:
    "Microseconds per memory_snapshot() call, with a tracker enabled"
    with TensorMemoryTracker():
        start = time.perf_counter()
        for _ in range(n): memory_snapshot()
        return (time.perf_counter() - start) / n * 1e6

if __name__ == '__main__':
    parser = argparse.ArgumentParser()
    parser.add_argument('--steps', type=int, default=40)
    parser.add_argument('--rounds', type=int, default=12)
    parser.add_argument('--interval-ms', type=float, default=10.0)
    args = parser.parse_args()
    random.seed(0)
    print(f'torch {torch.__version__}, {torch.get_num_threads()} threads; sampler every {args.interval_ms:g} ms; '
          f'best of {args.rounds} interleaved rounds x {args.steps} steps')
    print(f'memory_snapshot(): {snapshot_cost_us():.0f} us per call')
    for name, width, batch, steps in (('small MLP 256x3, batch 64', 256, 64, args.steps),
                                      ('larger MLP 1024x3, batch 512', 1024, 512, max(4, args.steps // 8))):
        step = make_step(width, batch)
        r, ops = compare(step, steps, args.rounds, args.interval_ms), ops_per_step(step)
        per_op_us = (r['tracker'] - 1) * r['plain_ms'] * 1e3 / ops
        print(f'{name}: plain {r["plain_ms"]:.2f} ms/step | sampler/plain {r["sampler"]:.3f}x | '
              f'tracker/plain {r["tracker"]:.3f}x | tracker+sampler/plain {r["tracker+sampler"]:.3f}x | '
              f'{ops} ops/step, tracker ~{per_op_us:.1f} us/op')
