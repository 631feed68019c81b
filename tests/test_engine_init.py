"""initialize() rejects bad arguments with errors that say what to pass; `import flexrt` stays light; the
DeepSpeed-style example script runs on 2 ranks with `import flexrt as deepspeed` and, where DeepSpeed is installed,
trains to the same weights as DeepSpeed itself."""
import importlib.util, json, os, re, subprocess, sys
from pathlib import Path
import pytest, torch, torch.nn as nn
import flexrt
from flexrt import comm
from helpers import free_port
from helpers import run_torchrun

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / 'examples' / 'deepspeed_style.py'
SGD = {'type': 'SGD', 'params': {'lr': 0.1}}
OK = {'train_batch_size': 4, 'optimizer': SGD}

@pytest.fixture(autouse=True)
def single_process():
    yield
    comm.destroy_process_group()   # forget the single-process setup initialize() chose, for the tests after these

def model(): return nn.Linear(3, 2)
def dataset(): return torch.utils.data.TensorDataset(torch.randn(8, 3))

BAD = [  # (id, keyword arguments of initialize, exception, message fragment)
    ('no model', dict(config=OK), ValueError, 'needs model='),
    ('model not a module', dict(model=lambda x: x, config=OK), TypeError, 'model must be a torch.nn.Module'),
    ('no config', dict(model=model()), ValueError, 'needs a config'),
    ('two configs', dict(model=model(), config=OK, config_params=OK), ValueError, 'pass exactly one'),
    ('config a list', dict(model=model(), config=[OK]), TypeError, 'config must be a dict, a JSON file path or a FlexConfig'),
    ('config file missing', dict(model=model(), config='/nonexistent/ds.json'), FileNotFoundError, 'not found'),
    ('misspelt key', dict(model=model(), config={**OK, 'gradient_clip': 1.0}), ValueError, "did you mean 'gradient_clipping'"),
    ('inconsistent batch', dict(model=model(), config={'train_batch_size': 7, 'train_micro_batch_size_per_gpu': 2,
                                'gradient_accumulation_steps': 2}), ValueError, 'train_batch_size=7 is not micro (2) x accumulation (2) x world (1) = 4'),
    ('no batch size', dict(model=model(), config={'gradient_accumulation_steps': 2}), ValueError, 'give train_batch_size or train_micro_batch_size_per_gpu'),
    ('optimizer a string', dict(model=model(), optimizer='adam', config={'train_batch_size': 4}), TypeError, 'must be a torch.optim.Optimizer or a callable'),
    ('schedule without optimizer', dict(model=model(), config={'train_batch_size': 4, 'scheduler': {'type': 'WarmupLR'}}), ValueError, 'needs an optimizer'),
    ('schedule without step', dict(model=model(), lr_scheduler=3, config=OK), TypeError, 'must have a step() method'),
    ('data not a dataset', dict(model=model(), training_data=[1, 2, 3], config=OK), TypeError, 'must be a torch.utils.data.Dataset'),
    ('zero stage 2 without optimizer', dict(model=model(), config={'train_batch_size': 4, 'zero_optimization': {'stage': 2}}),
     ValueError, "ZeRO stage 2 partitions an optimizer's state: pass optimizer="),
    ('fp16 and bf16', dict(model=model(), config={**OK, 'fp16': {'enabled': True}, 'bf16': {'enabled': True}}), ValueError, 'enable one of them'),
    ('unknown optimizer', dict(model=model(), config={**OK, 'optimizer': {'type': 'OneBitAdam'}}), ValueError, 'DeepSpeed-only optimizer'),
    ('bad optimizer param', dict(model=model(), config={**OK, 'optimizer': {'type': 'SGD', 'params': {'lr': 0.1, 'beta': 0.9}}}), ValueError, "unknown key 'beta'"),
    ('Adam without bias correction', dict(model=model(), config={**OK, 'optimizer': {'type': 'Adam', 'params': {'bias_correction': False}}}),
     ValueError, 'bias_correction=false is not supported'),
]

@pytest.mark.parametrize('name,kwargs,error,message', BAD, ids=[b[0] for b in BAD])
def test_bad_arguments_raise_clear_errors(name, kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)): flexrt.initialize(**kwargs)

def test_a_passed_optimizer_and_schedule_win_over_the_config_blocks():
    "As in DeepSpeed: the script's optimizer and schedule train, the config's blocks are ignored, and a warning says so"
    m = model(); adam = torch.optim.Adam(m.parameters(), lr=0.5)
    step_lr = torch.optim.lr_scheduler.StepLR(adam, step_size=1, gamma=0.5)
    config = {**OK, 'scheduler': {'type': 'WarmupLR', 'params': {'warmup_num_steps': 10}}}
    with pytest.warns(UserWarning) as caught:
        engine, optimizer, _, scheduler = flexrt.initialize(model=m, optimizer=adam, lr_scheduler=step_lr, config=config)
    said = ' '.join(str(w.message) for w in caught)
    assert "'optimizer' block (SGD): the passed one trains" in said and "'scheduler' block (WarmupLR): the passed one is used" in said
    assert isinstance(engine.basic_optimizer, torch.optim.Adam) and scheduler is step_lr
    engine.backward(engine(torch.randn(4, 3)).sum()); engine.step()
    assert engine.get_lr() == [0.25]   # the passed StepLR halved Adam's 0.5 (the config's SGD would say 0.1)
    engine.close()

def test_bad_calls_on_the_engine():
    engine, optimizer, loader, scheduler = flexrt.initialize(model=model(), config={'train_batch_size': 4})
    assert (optimizer, loader, scheduler) == (None, None, None)
    loss = engine(torch.randn(4, 3)).sum()
    with pytest.raises(TypeError, match='scalar tensor'): engine.backward(engine(torch.randn(4, 3)))
    engine.backward(loss)
    with pytest.raises(ValueError, match='needs an optimizer'): engine.step()
    with pytest.raises(ValueError, match=re.escape('must be a positive multiple of micro (4) x world (1) = 4')): engine.set_train_batch_size(6)
    engine.set_train_batch_size(12)
    assert engine.get_batch_info() == (12, 4, 3)
    with engine.no_sync():
        with pytest.raises(RuntimeError, match='cannot be nested'):
            with engine.no_sync(): pass
    engine.close()

def test_moe_group_name_must_say_its_size(monkeypatch):
    from flexrt.engine.parts import ExpertGroups
    p = nn.Parameter(torch.ones(2)); p.allreduce, p.group_name = False, 'my_experts'
    monkeypatch.setattr(comm, 'get_world_size', lambda group=None: 2)
    with pytest.raises(ValueError, match=re.escape("name the group 'ep_size_<n>'")): ExpertGroups([p])

def test_import_flexrt_is_light():
    probe = "import sys, flexrt; assert 'torch' not in sys.modules; print(flexrt.__version__); print(flexrt.initialize.__module__)"
    out = subprocess.run([sys.executable, '-c', probe], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [flexrt.__version__, 'flexrt.engine.build']

def _torchrun(script, env=None, runner=()):
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', '2', '--master_port', str(free_port()),
           *runner, str(script), '--deepspeed']
    out = run_torchrun(cmd, capture_output=True, text=True, timeout=150, cwd=ROOT, env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout

def _result(stdout):
    lines = [l for l in stdout.splitlines() if l.startswith('RESULT')]
    assert len(lines) == 1, stdout
    return re.match(r'RESULT steps (\d+) samples (\d+) lr (\S+) loss (\S+) checksum (\S+) grad_norm (\S+)', lines[0]).groups()

@pytest.fixture(scope='module')
def flexrt_run(): return _torchrun(SCRIPT)

def test_example_runs_on_two_ranks(flexrt_run):
    steps, samples, lr, loss, checksum, norm = _result(flexrt_run)
    assert (int(steps), int(samples), float(lr)) == (32, 512, 3e-3)   # 2 epochs of 256 samples, 16 per step; warmed up
    assert 0 < float(norm) and float(loss) < 1.0
    assert len([l for l in flexrt_run.splitlines() if l.startswith('[flexrt] step=')]) == 8   # rank 0, every 4 steps

@pytest.mark.skipif(importlib.util.find_spec('deepspeed') is None, reason='DeepSpeed is not installed (pip install .[bench])')
def test_example_matches_deepspeed(flexrt_run, tmp_path):
    text = SCRIPT.read_text()
    assert text.count('import flexrt as deepspeed\n') == 1
    original = tmp_path / 'deepspeed_style_ds.py'
    original.write_text(text.replace('import flexrt as deepspeed\n', 'import deepspeed\n'))   # the only change
    real = [str(ROOT / 'tests' / 'real_deepspeed.py')]   # the script unchanged, DeepSpeed's shared-memory op off
    theirs, ours = _result(_torchrun(original, env={'DS_ACCELERATOR': 'cpu'}, runner=real)), _result(flexrt_run)
    assert theirs[:3] == ours[:3] and theirs[5] == 'None'   # DeepSpeed reports no norm for fp32 without ZeRO
    for a, b in zip(theirs[3:5], ours[3:5]): assert float(a) == pytest.approx(float(b), rel=1e-5, abs=1e-6)
