"""DeepSpeed parity: one training script (tests/parity_train.py) run under `import deepspeed` and under
`import flexrt as deepspeed`, each in its own `torch.distributed.run` job on 2 gloo ranks, at ZeRO stages 0-3 in fp32
and bf16, with 2 micro-batches per step and active gradient clipping. Compared: the loss of every micro-step, the
model's weights after training, and the checkpoints read back per parameter with each library's own tools (fp32
masters and AdamW moments: DeepSpeed's zero_to_fp32 functions vs flexrt's `consolidate` and fragment index).

Tolerance: `ulps` below, |a - b| <= n * eps(fp32) * max|b| over the tensor (4 ulps at the tensor's scale). Both runs do
the same float operations in nearly the same order; what is left is summation order inside norms and reductions, which
moves a result by an ulp or two. A skipped step, a different clip coefficient or a different accumulation dtype moves
weights by 1e-4 or more (see the xfails), far outside this.

Differences found (DeepSpeed 0.19.8, CPU, gloo) are marked `xfail(strict=True)` with the measured numbers, so a change
on either side shows up. The main runs start from weights bf16 holds exactly, so that the first difference (how fp32
masters start, `test_bf16_masters_start_from_the_bf16_model`) does not hide the others.
"""
import importlib.util, os, subprocess, sys
from pathlib import Path
import pytest, torch
from helpers import free_port
from helpers import run_torchrun

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / 'tests' / 'parity_train.py'
pytestmark = pytest.mark.skipif(importlib.util.find_spec('deepspeed') is None,
                                reason='DeepSpeed is not installed: `pip install -e .[dev]` installs the pinned version')
EPS32 = torch.finfo(torch.float32).eps

def _run(impl, out, *extra):
    "One 2-rank job of the script; rank 0's results"
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', '2', '--master_port', str(free_port()),
           str(SCRIPT), '--impl', impl, '--out', str(out), *extra]
    env = {**os.environ, 'DS_ACCELERATOR': 'cpu', 'PYTHONPATH': os.pathsep.join(filter(None, [str(ROOT), os.environ.get('PYTHONPATH')]))}
    r = run_torchrun(cmd, capture_output=True, text=True, timeout=540, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-6000:]
    return torch.load(out / f'{impl}.pt', weights_only=False)

@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp('parity')
    return _run('deepspeed', out), _run('flexrt', out)

def ulps(a, b, n=4):
    "True when |a - b| <= n fp32 ulps at the scale of b (its largest magnitude)"
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return bool(((a - b).abs() <= n * EPS32 * b.abs().max()).all())

def differences(ds, fx, n=4)->list:
    "What differs between DeepSpeed's and flexrt's results of one run, beyond n ulps"
    bad = [] if ulps(ds['losses'], fx['losses'], n) else [f"losses {ds['losses']} vs {fx['losses']}"]
    for name in ds['weights']:
        a, b = ds['weights'][name], fx['weights'][name]
        if a.dtype != b.dtype or not ulps(a.float(), b.float(), n): bad.append(f'weight {name}: max |diff| {(a.float() - b.float()).abs().max():.3g}')
    for field in ('masters', 'exp_avg', 'exp_avg_sq'):
        a, b = ds['checkpoint'][field], fx['checkpoint'][field]
        if sorted(a) != sorted(b): bad.append(f'checkpoint {field}: names {sorted(a)} vs {sorted(b)}'); continue
        for name in a:
            if not ulps(a[name].float(), b[name].float(), n): bad.append(f'checkpoint {field} {name}: max |diff| {(a[name].float() - b[name].float()).abs().max():.3g}')
    norms = [(x, y) for x, y in zip(ds['grad_norms'], fx['grad_norms']) if x is not None]
    if norms and not ulps([x for x, _ in norms], [y for _, y in norms], n): bad.append(f"grad norms {ds['grad_norms']} vs {fx['grad_norms']}")
    return bad

@pytest.mark.parametrize('stage', [0, 1, 2, 3])
def test_fp32_same_losses_weights_and_checkpoint(runs, stage):
    ds, fx = (r[(stage, 'fp32')] for r in runs)
    assert ds['global_steps'] == fx['global_steps'] == 3
    assert differences(ds, fx) == []
    if stage == 0: assert ds['grad_norms'] == [None] * 3   # DeepSpeed reports no norm for fp32 stage 0; flexrt does

BF16_XFAIL = {
    0: "DeepSpeed 0.19.8 stage 0 bf16 wraps torch AdamW in FP16_Optimizer, whose __init__ calls "
       "initialize_optimizer_states(): one optimizer.step() with zero gradients. AdamW's 'step' is then 1 before training "
       "(2 after the first real step; stage 1: 1) and weight decay has been applied once; the moments stay those of the "
       "real steps (they match flexrt's), but bias correction uses t+1, so the first update is 0.744*lr instead of lr. "
       "Weights differ by 1e-2 after 3 steps, and DeepSpeed stage 0 differs from its own stage 1 by as much; flexrt "
       "stage 0 equals DeepSpeed stage 1 exactly. A DeepSpeed behaviour (bug), not flexrt's",
    2: "DeepSpeed stage 2 bf16 reduces gradients at every micro-batch (its backward hooks partition them) and sums the "
       "reduced bf16 gradients; flexrt stage 2 sums the micro-batches locally and reduces once at the boundary (as both "
       "do at stage 1): the step-1 norms differ "
       "(DeepSpeed 0.9838440, flexrt 0.9837799 = both stage 1), masters by <= 1.8e-4 after 3 steps",
    3: "stage 3 bf16: both reduce-scatter every micro-batch, but the accumulated gradient shards differ: step-1 norms "
       "DeepSpeed 0.9838440 (= its stage 2) vs flexrt 0.9838680; masters by <= 9.2e-5 after 3 steps. flexrt adds each "
       "micro-batch's reduced bf16 pieces into fp32 shards; the likely cause (not isolated) is that DeepSpeed accumulates "
       "them in bf16 (its grad_accum_dtype defaults to the model dtype)",
}

@pytest.mark.parametrize('stage', [pytest.param(s, marks=pytest.mark.xfail(strict=True, reason=BF16_XFAIL[s])) if s in BF16_XFAIL else s
                                   for s in (0, 1, 2, 3)])
def test_bf16_same_losses_weights_and_checkpoint(runs, stage):
    "bf16 working weights equal bit for bit; fp32 masters and moments within 4 ulps"
    ds, fx = (r[(stage, 'bf16')] for r in runs)
    assert ds['global_steps'] == fx['global_steps'] == 3
    assert differences(ds, fx) == []
    assert all(torch.equal(ds['weights'][n], fx['weights'][n]) for n in ds['weights'])

@pytest.mark.xfail(strict=True, reason="fp32 masters start differently: flexrt copies the fp32 weights the model had before "
                   "the cast to bf16 (Precision.setup builds MasterWeights, then casts the model); DeepSpeed casts the model "
                   "first and builds its masters from the bf16 weights. With initial weights bf16 cannot hold, the masters "
                   "differ by up to 9.4e-4 after 3 steps (one bf16 rounding of the initial weights) and the losses from the "
                   "second step on (1.22537 vs 1.22572). Small fix in flexrt if DeepSpeed's behaviour is wanted: build the "
                   "masters from the cast model")
def test_bf16_masters_start_from_the_bf16_model(tmp_path):
    ds, fx = (_run(impl, tmp_path, '--only', '1,bf16', '--fp32-init')[(1, 'bf16')] for impl in ('deepspeed', 'flexrt'))
    assert differences(ds, fx) == []
