"""Rank functions for tests/test_threads_launch.py and tests/test_launch_results.py: importable, so they survive fork
and spawn alike. Each says what the rank ran: its torch threads, and the variables its launcher set.

    torchrun --nproc_per_node 2 launch_threads_train.py OUT_DIR    # each rank writes OUT_DIR/rank{r}.json
"""
import json, os, sys
import torch
from torch import nn

CONFIG = {'train_micro_batch_size_per_gpu': 4, 'optimizer': {'type': 'SGD', 'params': {'lr': 0.1}}}

def threads_seen() -> dict:
    "This rank's torch intra-op threads now, with the launcher's variables"
    return {'rank': int(os.environ.get('RANK', 0)), 'threads': torch.get_num_threads(),
            'omp': os.environ.get('OMP_NUM_THREADS'), 'local_world_size': os.environ.get('LOCAL_WORLD_SIZE')}

def train_steps(steps: int = 2) -> dict:
    "Train a small model `steps` steps with flexrt's engine: the threads before and after `flexrt.initialize`, its plan"
    import flexrt
    from flexrt import comm
    before = threads_seen()
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    engine, _, _, _ = flexrt.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
    after = threads_seen()
    for _ in range(steps):
        engine.backward(engine(torch.randn(4, 8, device=engine.device)).square().mean())
        engine.step()
    plan = engine.threads.to_dict()
    engine.close()
    comm.destroy_process_group()
    return {'before': before, 'after': after, 'plan': plan}

def train_steps_into(out_dir: str, steps: int = 2):
    "`train_steps`, written to OUT_DIR/rank{r}.json: for launchers that hand nothing back (notebook_launcher, torchrun)"
    seen = train_steps(steps)
    with open(os.path.join(out_dir, f"rank{seen['after']['rank']}.json"), 'w') as f: json.dump(seen, f)

if __name__ == '__main__':
    train_steps_into(sys.argv[1])
