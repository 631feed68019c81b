"""`make demo`: train a small GPT-style model on 2 CPU ranks with flexrt's engine and print a training report.

The ranks are started by `accelerate.notebook_launcher`, exactly as a notebook cell starts them, so the same `train`
function runs from Jupyter (`notebook_launcher(train, (steps, out_dir), num_processes=2)`) or from here.
Each rank records the engine's per-step events (loss, gradient norm before and after clipping, learning rate,
memory) through `flexrt.monitor`, counts its live tensor bytes exactly with a `TensorMemoryTracker`, and samples
memory in the background with a `MemorySampler`; every collective is profiled by `flexrt.comm`.
Writes `steps.csv` (every rank's step events) and `memory.csv` (the samples) to $OUT (default `demo_out/`).
"""
import os, socket, sys
from pathlib import Path
import torch
from torch import nn

CONFIG = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 2,            # train_batch_size = 8 x 2 x 2 ranks = 32
    "gradient_clipping": 1.0,
    "steps_per_print": 10,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3, "warmup_num_steps": 10}},
    "comms_logger": {"enabled": True},
}

def free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]

def tiny_transformer(vocab=256, dim=64, layers=2, heads=4):
    "A small GPT-style model: embedding, transformer blocks, a head"
    block = lambda: nn.TransformerEncoderLayer(dim, heads, dim_feedforward=4 * dim, batch_first=True, norm_first=True)
    return nn.Sequential(nn.Embedding(vocab, dim), *[block() for _ in range(layers)], nn.LayerNorm(dim), nn.Linear(dim, vocab))

def train(steps: int, out_dir: str):
    import flexrt
    from flexrt import comm as dist, monitor
    from flexrt.memory import MemorySampler, see_memory_usage
    from flexrt.memory.tracker import TensorMemoryTracker

    env = dist.init_distributed()
    tracker = TensorMemoryTracker().enable()               # exact bytes of live CPU tensors on this rank
    sampler = MemorySampler(interval_ms=20, device='cpu').start()
    events = []
    monitor.add_listener(events.append)                    # one 'step' record per optimizer step (rank 0 also emits a 'run' record first)
    torch.manual_seed(1234)                                # the engine also broadcasts rank 0's weights
    model = tiny_transformer()
    engine, _, _, _ = flexrt.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
    torch.manual_seed(1234 + env.rank)                     # each rank draws its own data
    for _ in range(steps * engine.gradient_accumulation_steps()):
        tokens = torch.randint(0, 256, (engine.train_micro_batch_size_per_gpu(), 32))
        logits = engine(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()                                      # the optimizer steps at accumulation boundaries only
    sampler.stop()
    see_memory_usage(f'after {engine.global_steps} steps', force=True)   # one line, rank 0
    comm = dist.log_summary()                              # collective: every rank calls it, rank 0 prints
    gathered = [None] * env.world_size
    steps_frame = [{k: v for k, v in e.items() if k != 'memory'} | {'tensor_bytes': e['memory']['allocated_bytes']}
                   for e in events if e['kind'] == 'step']
    dist.all_gather_object(gathered, (steps_frame, sampler.to_dataframe().assign(rank=env.rank)))
    monitor.remove_listener(events.append)
    engine.close(); tracker.disable()
    if env.rank == 0: report(gathered, Path(out_dir), env)
    dist.destroy_process_group()

def report(gathered, out: Path, env):
    import pandas as pd
    out.mkdir(parents=True, exist_ok=True)
    steps = pd.DataFrame([row for rows, _ in gathered for row in rows])
    memory = pd.concat([frame for _, frame in gathered], ignore_index=True)
    steps.to_csv(out / 'steps.csv', index=False); memory.to_csv(out / 'memory.csv', index=False)
    rank0 = steps[steps['rank'] == 0].reset_index(drop=True)
    print(f'\n== flexrt demo: {env.world_size} ranks ({env.source}), {len(rank0)} optimizer steps ==')
    columns = ['step', 'loss', 'grad_norm', 'grad_norm_post_clip', 'lr', 'step_time', 'samples_per_s']
    print(rank0.iloc[[0, 1, 2, len(rank0) // 2, -1]][columns].to_string(index=False, float_format='%.4g'))
    for r, frame in memory.groupby('rank'):
        print(f'rank {r}: peak live tensor bytes {frame.max_allocated_bytes.max() / 2**20:.2f} MiB, '
              f'{len(frame)} memory samples, RSS {frame.process_rss_bytes.max() / 2**20:.0f} MiB max')
    first, last = rank0.loss.iloc[:3].mean(), rank0.loss.iloc[-3:].mean()
    print(f'loss {first:.3f} -> {last:.3f}; outputs in {out}/')
    if not last < first: sys.exit('demo failed: the loss did not go down')

if __name__ == '__main__':
    from accelerate import notebook_launcher
    steps, out_dir = int(os.environ.get('STEPS', 40)), os.environ.get('OUT', 'demo_out')
    notebook_launcher(train, (steps, out_dir), num_processes=2, use_port=str(free_port()))
