"""What DeepSpeed's tools and tests find in a flexrt checkpoint (`flexrt.checkpoint.deepspeed_view`), on 2 gloo ranks:
DeepSpeed's `mp_rank_00_model_states.pt` with the module's weights at ZeRO stages 0-2 (none at stage 3, where the
module is partitioned), which real DeepSpeed 0.19.8 loads with `load_checkpoint(load_module_only=True)`; the
`zero_to_fp32.py` written into the save directory, run with DeepSpeed's arguments; a tag mismatch under `Fail`
raised as an `AssertionError` too, as DeepSpeed's is; and consolidation of a model trained with two param groups and
frozen parameters (DeepSpeed's `TestZeroToFP32::test_2_param_groups`) equal to the trained weights."""
import importlib.util, os, subprocess, sys
from pathlib import Path
import pytest, torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import run_distributed

ROOT = Path(__file__).resolve().parents[1]
DS_FILE = 'mp_rank_00_model_states.pt'

class Net(nn.Module):
    "Two linears (the first frozen), a buffer; sizes not divisible by 2"
    def __init__(self):
        super().__init__()
        self.frozen, self.body, self.head = nn.Linear(5, 7), nn.Linear(7, 7), nn.Linear(7, 3)
        self.frozen.requires_grad_(False)
        self.register_buffer('shift', torch.linspace(-1, 1, 5))
    def forward(self, x): return self.head(torch.tanh(self.body(self.frozen(x + self.shift))))

def config(stage, **extra):
    return {'train_batch_size': 4, 'steps_per_print': 1000, 'zero_optimization': {'stage': stage, 'stage3_param_persistence_threshold': 0},
            **extra}

def trained(stage, optimizer=None, **extra):
    "An engine over `Net` trained two steps (the optimizer: the config's AdamW unless one is given)"
    import flexrt
    torch.manual_seed(0)
    model = Net()
    cfg = config(stage, **extra) if optimizer else {**config(stage, **extra), 'optimizer': {'type': 'AdamW', 'params': {'lr': 0.05}}}
    engine = flexrt.initialize(model=model, optimizer=optimizer(model) if optimizer else None, config=cfg)[0]
    for step in range(2):
        g = torch.Generator().manual_seed(10 * step + engine.global_rank)
        x, y = torch.randn(2, 5, generator=g), torch.randn(2, 3, generator=g)
        engine.backward(F.mse_loss(engine(x.to(engine.device)).float(), y)); engine.step()
    return engine

def save_rank(rank, world, root):
    "Per stage: save (all tensors, and without the frozen ones) and reload; the files, the DeepSpeed file's contents and the weights"
    out = {}
    for stage in (0, 1, 2, 3):
        e = trained(stage)
        full = {k: v.clone() for k, v in e.module_state_dict().items()}
        e.save_checkpoint(Path(root, f's{stage}'), tag='all', client_state={'epoch': 4})
        e.save_checkpoint(Path(root, f's{stage}'), tag='trainable', exclude_frozen_parameters=True, save_latest=False)
        ds = {tag: torch.load(Path(root, f's{stage}', tag, DS_FILE), weights_only=True) if Path(root, f's{stage}', tag, DS_FILE).exists() else None
              for tag in ('all', 'trainable')}
        fresh = trained(stage)   # other weights: the load must bring the saved ones back
        fresh.load_checkpoint(Path(root, f's{stage}'), tag='all')
        loaded = fresh.module_state_dict()
        out[stage] = {'full': full, 'ds': ds, 'loaded': loaded, 'files': sorted(os.listdir(Path(root, f's{stage}', 'all'))),
                      'top': sorted(os.listdir(Path(root, f's{stage}')))}
        e.close(); fresh.close()
    return out

def tag_rank(rank, world, root):
    from flexrt.checkpoint import CheckpointError
    e = trained(1, checkpoint={'tag_validation': 'Fail'})
    try: e.save_checkpoint(root, tag=f'tag-{rank}')
    except AssertionError as err: return type(err).__name__, isinstance(err, CheckpointError)
    finally: e.close()

def test_deepspeed_model_states_file_and_recovery_script(tmp_path):
    results = run_distributed(save_rank, 2, args=(str(tmp_path),), timeout=120)
    got = results[0]
    for stage, r in got.items():
        where = f'stage {stage}'
        assert r['top'] == ['all', 'latest', 'trainable', 'zero_to_fp32.py'], (where, r['top'])
        for k, v in r['full'].items(): assert torch.equal(r['loaded'][k], v), (where, k)   # flexrt's own load is unchanged
        if stage == 3:   # the module is partitioned: DeepSpeed's file is not written (DeepSpeed writes per-rank placeholders there)
            assert r['ds'] == {'all': None, 'trainable': None} and DS_FILE not in r['files'], where
            continue
        assert r['files'] == ['manifest.json', 'model_states.pt', DS_FILE, 'rank_00000.pt', 'rank_00001.pt'], (where, r['files'])
        ds = r['ds']['all']
        assert list(ds['module']) == list(r['full']), where
        for k, v in r['full'].items(): assert torch.equal(ds['module'][k], v), (where, k)
        assert (ds['buffer_names'], ds['global_steps'], ds['dp_world_size'], ds['epoch'], ds['optimizer']) == (['shift'], 2, 2, 4, None), where
        assert sorted(r['ds']['trainable']['module']) == sorted(set(r['full']) - {'frozen.weight', 'frozen.bias'}), where
    script = tmp_path / 's2' / 'zero_to_fp32.py'
    assert os.access(script, os.X_OK)
    env = {**os.environ, 'PYTHONPATH': os.pathsep.join(filter(None, [str(ROOT), os.environ.get('PYTHONPATH')]))}
    frozen = {'frozen.weight', 'frozen.bias'}
    for args, out, names in [(['.', 'out/'], 'out/pytorch_model.bin', set(got[2]['full'])),   # `latest`: 'all'
                             (['.', 'one.safetensors', '-t', 'trainable'], 'one.safetensors', set(got[2]['full']) - frozen)]:
        run = subprocess.run([sys.executable, 'zero_to_fp32.py', *args], cwd=script.parent, env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-3000:]
        if out.endswith('.bin'): weights = torch.load(script.parent / out, weights_only=True)
        else: from safetensors.torch import load_file; weights = load_file(script.parent / out)
        assert sorted(weights) == sorted(names), args
        for k in names: assert torch.equal(weights[k], got[2]['full'][k]), (args, k)   # fp32 masters of the fp32 run: the trained weights

def test_tag_mismatch_under_fail_is_an_assertion_error_too(tmp_path):
    assert run_distributed(tag_rank, 2, args=(str(tmp_path),)) == [('TagMismatchError', True)] * 2

def groups_rank(rank, world, root, stage):
    "DeepSpeed's test_2_param_groups, in flexrt: weights and biases in two groups (the first layer frozen), a client SGD"
    def sgd(model):
        layers = [model.frozen, model.body, model.head]
        return torch.optim.SGD([{'params': [l.weight for l in layers], 'weight_decay': 0.01},
                                {'params': [l.bias for l in layers], 'weight_decay': 0.0}], lr=0.1)
    e = trained(stage, sgd)
    e.save_checkpoint(root)
    weights = {k: v.clone() for k, v in e.module_state_dict().items()}
    e.close()
    return weights

@pytest.mark.parametrize('stage', [2, 3])
def test_two_param_groups_consolidate_to_the_trained_weights(tmp_path, stage):
    from flexrt.checkpoint import consolidate
    weights = run_distributed(groups_rank, 2, args=(str(tmp_path), stage))[0]
    got = consolidate(tmp_path)
    assert sorted(got) == sorted(weights)
    for k, v in weights.items(): assert torch.equal(got[k], v), k

def deepspeed_rank(rank, world, root):
    "Real DeepSpeed loads the module of a flexrt checkpoint (load_module_only=True, as for warm-starting)"
    sys.path.insert(0, str(ROOT / 'tests'))
    from real_deepspeed import import_deepspeed
    deepspeed = import_deepspeed()
    torch.manual_seed(1)
    model = Net()
    cfg = {**config(2), 'train_batch_size': 1, 'optimizer': {'type': 'AdamW', 'params': {'lr': 0.05, 'torch_adam': True}}}
    engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
    path, client = engine.load_checkpoint(root, load_module_only=True)
    return path, client, {k: v.clone() for k, v in engine.module.state_dict().items()}

@pytest.mark.skipif(importlib.util.find_spec('deepspeed') is None, reason="needs DeepSpeed (`pip install -e .[dev]` installs the pinned version)")
def test_real_deepspeed_loads_the_module_of_a_flexrt_checkpoint(tmp_path):
    weights = run_distributed(groups_rank, 2, args=(str(tmp_path), 2))[0]
    path, client, loaded = run_distributed(deepspeed_rank, 1, args=(str(tmp_path),), timeout=120)[0]
    assert path == str(tmp_path / 'global_step2' / DS_FILE)
    assert sorted(loaded) == sorted(weights)
    for k, v in weights.items(): assert torch.equal(loaded[k], v), k
