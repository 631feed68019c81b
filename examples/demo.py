"""`make demo`: train a small model on 2 CPU ranks with flexrt's foundation and print a grad-norm / memory report.

The ranks are started by `accelerate.notebook_launcher`, exactly as a notebook cell would start them, so the same
`train` function runs from Jupyter (`notebook_launcher(train, (steps, out_dir), num_processes=2)`) or from here.
Until the engine lands, data parallelism is done by hand with `flexrt.comm`: average the gradients with one
all_reduce over a flat buffer, clip them with `flexrt.utils.clip_grad_norm_`, step. Every collective is profiled.
Writes `steps.csv` and `memory.csv` to $OUT (default `demo_out/`).
"""
import os, socket, sys, time
from pathlib import Path
import torch
from torch import nn

def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]

def tiny_transformer(vocab=256, dim=64, layers=2, heads=4):
    "A small GPT-style model: embedding, two transformer blocks, a head"
    block = lambda: nn.TransformerEncoderLayer(dim, heads, dim_feedforward=4 * dim, batch_first=True, norm_first=True)
    return nn.Sequential(nn.Embedding(vocab, dim), *[block() for _ in range(layers)], nn.LayerNorm(dim), nn.Linear(dim, vocab))

def average_gradients(model):
    "Data parallelism by hand: one all_reduce over all gradients, flattened, then divided by the world size"
    from flexrt import comm as dist
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g)); offset += g.numel()

def train(steps: int, out_dir: str):
    from flexrt import comm as dist
    from flexrt.utils import set_random_seed, clip_grad_norm_, CheckOverflow
    from flexrt.memory import MemorySampler, see_memory_usage, memory_snapshot
    from flexrt.memory_tracker import TensorMemoryTracker

    env = dist.init_distributed(config={'comms_logger': {'enabled': True}})
    rank, world = dist.get_rank(), dist.get_world_size()
    tracker = TensorMemoryTracker().enable()               # exact bytes of live CPU tensors on this rank
    sampler = MemorySampler(interval_ms=20).start()        # background thread, ring buffer
    set_random_seed(1234)                                  # same initial weights on every rank
    model = tiny_transformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    overflow = CheckOverflow(list(model.parameters()))
    set_random_seed(1234 + rank)                           # each rank draws its own data
    rows = []
    for step in range(steps):
        tokens = torch.randint(0, 256, (8, 32))
        t0 = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
        loss.backward()
        average_gradients(model)
        skipped = overflow.check()                         # every rank agrees on overflow
        norm = clip_grad_norm_(model.parameters(), max_norm=1.0)
        if not skipped: optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean_loss = loss.detach().clone(); dist.all_reduce(mean_loss); mean_loss /= world
        rows.append(dict(step=step, loss=mean_loss.item(), grad_norm=norm.item(), skipped=bool(skipped),
                         step_ms=1e3 * (time.perf_counter() - t0), tensor_mb=tracker.allocated_bytes / 2**20))
    sampler.stop()
    see_memory_usage(f'after {steps} steps', force=True)   # one line, rank 0
    peaks = [None] * world
    dist.all_gather_object(peaks, (rank, memory_snapshot().max_allocated_bytes, sampler.to_dataframe()))
    comm = dist.log_summary()                              # collective: every rank calls it, rank 0 prints
    tracker.disable()
    if rank == 0: report(rows, peaks, comm, Path(out_dir), env)
    dist.destroy_process_group()

def report(rows, peaks, comm, out: Path, env):
    import pandas as pd
    out.mkdir(parents=True, exist_ok=True)
    steps = pd.DataFrame(rows)
    memory = pd.concat([frame.assign(rank=r) for r, _, frame in peaks], ignore_index=True)
    steps.to_csv(out / 'steps.csv', index=False); memory.to_csv(out / 'memory.csv', index=False)
    print(f'\n== flexrt demo: {env.world_size} ranks ({env.source}), {len(steps)} steps ==')
    print(steps.iloc[[0, 1, 2, len(steps) // 2, -1]].to_string(index=False, float_format='%.3f'))
    for r, peak, frame in peaks:
        print(f'rank {r}: peak live tensor bytes {peak / 2**20:.1f} MiB, {len(frame)} memory samples, '
              f'RSS {frame.process_rss_bytes.max() / 2**20:.0f} MiB max')
    first, last = steps.loss.iloc[:3].mean(), steps.loss.iloc[-3:].mean()
    print(f'loss {first:.3f} -> {last:.3f}; grad norm before clipping {steps.grad_norm.iloc[0]:.2f} -> '
          f'{steps.grad_norm.iloc[-1]:.2f}; outputs in {out}/')
    if not last < first: sys.exit('demo failed: the loss did not go down')

if __name__ == '__main__':
    from accelerate import notebook_launcher
    steps, out_dir = int(os.environ.get('STEPS', 60)), os.environ.get('OUT', 'demo_out')
    notebook_launcher(train, (steps, out_dir), num_processes=2, use_port=str(free_port()))
