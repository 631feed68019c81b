"""Training functions the quickstart notebook hands to `notebook_launcher` / `flexrt.launch.launch`.

They live in a module, not in the notebook, so they survive spawned ranks as well as forked ones.
"""
import os, time
import torch
from torch import nn

CONFIG = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "steps_per_print": 1000,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3, "warmup_num_steps": 10}},
    "comms_logger": {"enabled": True},
}

def tiny_transformer(vocab=256, dim=64, layers=2, heads=4):
    "A small GPT-style model: embedding, transformer blocks, a head"
    block = lambda: nn.TransformerEncoderLayer(dim, heads, dim_feedforward=4 * dim, batch_first=True, norm_first=True)
    return nn.Sequential(nn.Embedding(vocab, dim), *[block() for _ in range(layers)], nn.LayerNorm(dim), nn.Linear(dim, vocab))

def train(steps: int = 40, step_delay: float = 0.0, track_memory: bool = True, config: dict | None = None):
    "Train the tiny transformer with flexrt's engine (`config`: keys put over `CONFIG`); stops early (all ranks together) when asked"
    import flexrt
    from flexrt import comm as dist, monitor
    from flexrt.launch import should_stop
    from flexrt.memory.tracker import TensorMemoryTracker
    env = dist.init_distributed()
    tracker = TensorMemoryTracker().enable() if track_memory else None   # exact live CPU tensor bytes (CUDA has its own)
    torch.manual_seed(1234)
    model = tiny_transformer()
    engine, _, _, _ = flexrt.initialize(model=model, model_parameters=model.parameters(), config={**CONFIG, **(config or {})})
    torch.manual_seed(1234 + env.rank)
    with monitor.sample_memory(interval_ms=100):    # 'memory' records between the steps' own snapshots
        for step in range(steps):
            tokens = torch.randint(0, 256, (engine.train_micro_batch_size_per_gpu(), 32))
            logits = engine(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
            engine.backward(loss)
            engine.step()                            # emits one 'step' record per optimizer step
            if step_delay: time.sleep(step_delay)
            if (step + 1) % 10 == 0 or step + 1 == steps:
                monitor.emit('comm', total_steps=steps, rows=dist.comms_logger.summary().to_dict('records'))
            if should_stop(): break
    engine.close()
    if tracker is not None: tracker.disable()
    dist.destroy_process_group()

def count_until_stopped(max_steps: int, step_delay: float = 0.02):
    "A training loop without a model: log the step until stopped (for launch tests)"
    from flexrt import comm as dist, monitor
    from flexrt.launch import should_stop
    dist.init_distributed()
    for step in range(max_steps):
        monitor.log(step=step)
        time.sleep(step_delay)
        if should_stop(): break
    dist.destroy_process_group()

def fail_on_rank(rank: int, after: int = 2):
    "Raise on `rank` after `after` steps; the others wait in a collective (for crash tests)"
    from flexrt import comm as dist, monitor
    dist.init_distributed()
    for step in range(100):
        monitor.log(step=step)
        if step == after and dist.get_rank() == rank: raise ValueError(f'bad batch at step {step}')
        dist.all_reduce(torch.ones(1))
    dist.destroy_process_group()
