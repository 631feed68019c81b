"""An unmodified DeepSpeed script (examples/deepspeed_unmodified.py: `import deepspeed`, DeepSpeed's submodules, its
engine accessors) runs on flexrt through `python -m flexrt.deepspeed`, under torchrun on 2 ranks, and agrees with
the same file run on DeepSpeed itself: the same losses and gradient norms, the same final weights, the same answers
from the engine's accessors (ZeRO stage 2, gradient accumulation, clipping, a warmup schedule). The norms see what the
losses cannot: Adam and clipping hide a gradient scaled by a constant (say, not divided by the world size)."""
import importlib.util, json, os, subprocess, sys
from pathlib import Path
import pytest, torch
from helpers import run_torchrun

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / 'examples' / 'deepspeed_unmodified.py'
CONFIG = {"train_batch_size": 16, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0, "steps_per_print": 100,
          "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01, "torch_adam": True}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3, "warmup_num_steps": 4}},
          "zero_optimization": {"stage": 2}}

def _free_port():
    from helpers import free_port   # this xdist worker's share of the ports
    return free_port()

def _run(tmp_path, name, flexrt_runner):
    (tmp_path / 'ds.json').write_text(json.dumps(CONFIG))
    out = tmp_path / f'{name}.json'
    runner = ['-m', 'flexrt.deepspeed'] if flexrt_runner else [str(ROOT / 'tests' / 'real_deepspeed.py')]   # DeepSpeed: its shared-memory op off
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', '2', '--master_port', str(_free_port()), *runner,
           str(SCRIPT), '--deepspeed', '--deepspeed_config', str(tmp_path / 'ds.json'), '--out', str(out)]
    env = os.environ | {'DS_ACCELERATOR': 'cpu', 'OMP_NUM_THREADS': '1', 'PYTHONPATH': str(ROOT)}
    r = run_torchrun(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert r.returncode == 0, f'{name} failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}'
    return json.loads(out.read_text())

def test_unmodified_deepspeed_script_runs_on_flexrt_as_on_deepspeed(tmp_path):
    if importlib.util.find_spec('deepspeed') is None:   # not imported here: other tests put flexrt in its place in this process
        pytest.skip('DeepSpeed is a dev requirement: pip install -e ".[dev]"')
    ours, theirs = _run(tmp_path, 'flexrt', True), _run(tmp_path, 'deepspeed', False)
    assert ours['world_size'] == theirs['world_size'] == 2
    torch.testing.assert_close(torch.tensor(ours['losses']), torch.tensor(theirs['losses']), rtol=1e-5, atol=1e-6)
    assert len(ours['norms']) == len(theirs['norms']) == 6
    torch.testing.assert_close(torch.tensor(ours['norms']), torch.tensor(theirs['norms']), rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"gradient norms {ours['norms']} vs DeepSpeed's {theirs['norms']}: {m}")
    assert ours['weights'].keys() == theirs['weights'].keys()
    for k in ours['weights']: torch.testing.assert_close(torch.tensor(ours['weights'][k]), torch.tensor(theirs['weights'][k]), rtol=1e-5, atol=1e-6)
    assert ours['applied'] == theirs['applied'] and ours['applied'].count(True) == 6    # every 2nd micro-step applies
    norm = lambda v: [norm(x) for x in v] if isinstance(v, (list, tuple)) else v
    assert {k: norm(v) for k, v in ours['accessors'].items()} == {k: norm(v) for k, v in theirs['accessors'].items()}
