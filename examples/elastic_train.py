"""A training function for `flexrt.launch(..., max_restarts=1)`: rank 2 SIGKILLs itself after step 7 of the first
attempt; the restarted attempt (2 ranks) resumes from the checkpoint of step 5 and finishes."""
import os, signal
import torch, flexrt
from flexrt import comm as dist


def train(checkpoint_dir, steps=10, save_every=5, die_at=7):
    "Regress 12 samples a step (the same at any world size); save every `save_every` steps; lose rank 2 at `die_at`"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    config = {
        'train_batch_size': 12,
        'train_micro_batch_size_per_gpu': 2,
        'zero_optimization': {'stage': 3},
        'optimizer': {'type': 'Adam', 'params': {'lr': 0.01}},
        'steps_per_print': 5,
    }
    engine, *_ = flexrt.initialize(model=model, config=config)  # a restarted attempt resumes here
    rank, gas = dist.get_rank(), engine.gradient_accumulation_steps()
    for step in range(engine.global_steps, steps):
        x = torch.randn(12, 8, generator=torch.Generator().manual_seed(step))
        y = x.sum(1, keepdim=True).sin()
        for k in range(gas):
            at = (rank * gas + k) * 2  # this rank's share of the step's 12 samples
            loss = ((engine(x[at : at + 2]) - y[at : at + 2]) ** 2).mean()
            engine.backward(loss)
            engine.step()
        if engine.global_steps % save_every == 0:
            engine.save_checkpoint(checkpoint_dir)
        if rank == 2 and engine.global_steps == die_at:
            os.kill(os.getpid(), signal.SIGKILL)  # a lost rank: no exception, no goodbye
    return {'step': engine.global_steps, 'world_size': dist.get_world_size(), 'loss': loss.item()}
