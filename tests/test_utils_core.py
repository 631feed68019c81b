"""flexrt.utils.core: the mpu adapter on real process groups (old and new Megatron names), seeds, device moves."""
import random
import numpy as np
import pytest, torch
from helpers import run_distributed
from flexrt import comm as dist
from flexrt.utils import (MpuAdapter, bwc_tensor_model_parallel_rank, set_random_seed, move_to_device,
                          copy_to_device, get_only_unique_item, call_to_str, DummyOptim, ensure_directory_exists)

class TensorOnlyMpu:
    "new Megatron names, no world-size method: the adapter asks the group"
    def __init__(self, group): self.group = group
    def get_tensor_model_parallel_group(self): return self.group
    def get_tensor_model_parallel_rank(self): return dist.get_rank(self.group)

class SliceMpu:
    "a fork with get_slice_parallel_rank and the old group name"
    def __init__(self, group): self.group = group
    def get_model_parallel_group(self): return self.group
    def get_slice_parallel_rank(self): return dist.get_rank(self.group)
    def get_model_parallel_world_size(self): return dist.get_world_size(self.group)

def _adapter(rank, world_size):
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    g = pairs[rank // 2]
    a, b = MpuAdapter(TensorOnlyMpu(g)), MpuAdapter(SliceMpu(g))
    split, replicated = torch.ones(1), torch.ones(1)
    split.model_parallel = True
    return (a.world_size, a.tensor_rank, b.world_size, b.tensor_rank, bwc_tensor_model_parallel_rank(SliceMpu(g)),
            a.counts(split), a.counts(replicated))

def test_mpu_adapter_on_real_groups():
    results = run_distributed(_adapter, 4)
    assert results == [(2, r % 2, 2, r % 2, r % 2, True, r % 2 == 0) for r in range(4)]

def test_mpu_adapter_rejects_objects_without_megatron_methods():
    with pytest.raises(TypeError, match='neither get_model_parallel_group nor get_tensor_model_parallel_group'):
        MpuAdapter(object())

def test_seed_reproduces_all_generators():
    set_random_seed(2**40 + 3)
    a = (random.random(), np.random.rand(), torch.rand(3))
    set_random_seed(2**40 + 3)
    b = (random.random(), np.random.rand(), torch.rand(3))
    assert a[:2] == b[:2] and torch.equal(a[2], b[2])
    with pytest.raises(TypeError, match='seed must be an int'): set_random_seed('7')

@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a second device (CUDA)')
def test_move_to_device_keeps_tensor_identity_cuda():
    t = torch.ones(3)
    out = move_to_device({'x': [t]}, 'cuda')
    assert out['x'][0] is t and t.is_cuda

def test_copy_and_move_nested():
    t = torch.ones(2)
    copied = copy_to_device({'a': (t, 'k')}, 'meta')
    assert copied['a'][0].is_meta and not t.is_meta and copied['a'][1] == 'k'
    held = torch.nn.Parameter(torch.ones(3)); held.group_name = 'ep'
    out = move_to_device({'x': [held, 'k'], 'y': (t,)}, 'meta')   # a real move to another device, on any machine
    assert out['x'][0] is held and out['y'][0] is t and out['x'][1] == 'k'
    assert held.is_meta and t.is_meta and isinstance(held, torch.nn.Parameter) and held.group_name == 'ep'
    assert held.shape == (3,) and held.requires_grad

def test_small_helpers():
    assert call_to_str('hello', 1138, val=3) == 'hello(1138, val=3)'
    assert get_only_unique_item(['a', 'a']) == 'a'
    with pytest.raises(RuntimeError, match='expected exactly one unique element'): get_only_unique_item([1, 2])
    with pytest.raises(RuntimeError, match='DummyOptim cannot step'): DummyOptim([torch.nn.Parameter(torch.ones(1))]).step()

def test_ensure_directory_exists(tmp_path):
    ensure_directory_exists(tmp_path / 'x' / 'y' / 'file.bin')
    assert (tmp_path / 'x' / 'y').is_dir()
