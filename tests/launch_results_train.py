"""Rank functions for tests/test_launch_results.py: what ranks launched by `flexrt.launch` return. Importable, so they
survive fork and spawn alike; none needs a process group."""
import os, time
import torch
from torch import nn

def tiny_model() -> nn.Module:
    "The same small model on every rank and in the kernel (a BatchNorm brings an integer buffer)"
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))

def expected_value(rank: int) -> dict:
    "What `return_value` returns on `rank`"
    return {'rank': rank, 'w': torch.full((2, 3), float(rank)), 'half': torch.arange(4, dtype=torch.bfloat16) + rank,
            'nested': [1, [2.5, 'three', None], (True, rank)], 'model': tiny_model().state_dict()}

def return_value(delay: float = 0.0) -> dict:
    "This rank's dict with tensors, a nested list (holding a tuple) and a model's state dict, after `delay` seconds"
    time.sleep(delay)
    return expected_value(int(os.environ['RANK']))

class Tripwire:
    "An object that fails if anyone pickles it"
    def __reduce__(self): raise RuntimeError('a rank pickled its return value')

def return_unsendable_on(rank: int):
    "Rank `rank` returns a set deep inside its value (and a Tripwire); the others what `return_value` does"
    mine = int(os.environ['RANK'])
    return {'optim': [0, 1, 2, {3}], 'trap': Tripwire()} if mine == rank else expected_value(mine)

def return_on_cuda() -> dict:
    "A tensor on this rank's GPU"
    device = torch.device('cuda', int(os.environ.get('LOCAL_RANK', 0)) % torch.cuda.device_count())
    return {'w': torch.arange(3., device=device) + int(os.environ['RANK'])}
