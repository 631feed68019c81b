"""Checkpoints written by real DeepSpeed (0.19.8, CPU, gloo, 2 ranks; tests/ds_checkpoint_train.py) at ZeRO stages
0-3 in fp32 and bf16, with two param groups, and of a model with tied weights (`lm_head.weight` is `embed.weight`,
recorded in DeepSpeed's `shared_params`; at stage 3 the alias is an empty placeholder), loaded into flexrt at 1 and 2 ranks and another stage: the fp32 masters equal DeepSpeed's
(exactly), the global step, schedule and client state are restored, and training continues with DeepSpeed's own
continued losses and gradient norms. `python -m flexrt.checkpoint.consolidate` writes exactly what DeepSpeed's `zero_to_fp32` returns.
A checkpoint file holding any global besides DeepSpeed's data types is refused by name, and nothing in it runs.

Tolerances: fp32 runs do the same float operations as DeepSpeed up to summation order across ranks (at 1 rank the
two ranks' micro-batches are one batch), so the losses agree to 1e-6 relative (measured: 0 at 2 ranks after stages
0/1, <= 8.4e-8 otherwise). bf16 runs also round 16-bit gradients differently where DeepSpeed reduces bf16 gradients per
micro-batch (stages 2/3, see test_deepspeed_parity) or the batch is split otherwise (1 rank): 1e-4 (measured <= 2.8e-5
for the runs here). The gradient norms of the continued steps (DeepSpeed keeps none at stage 0 in fp32) agree to the
same 1e-6 in fp32; in bf16 they are norms of gradients rounded to bf16 at other points: 2**-8 relative, half a bf16 ulp
(measured <= 9.4e-4); a gradient not divided by the world size would double them. A load that drops the optimizer
state moves the losses by 2.8e-2 (checked below, > 1e-3)."""
import importlib.util, os, subprocess, sys, warnings
from pathlib import Path
import pytest, torch
from helpers import free_port, run_distributed, run_torchrun

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / 'tests' / 'ds_checkpoint_train.py'
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec('deepspeed') is None,
                                     reason="DeepSpeed is not installed, so no DeepSpeed checkpoint can be produced: "
                                            "`pip install -e .[dev]` installs the pinned version")
RUNS = ['z0_fp32', 'z1_fp32', 'z2_fp32', 'z3_fp32', 'z0_bf16', 'z2_bf16', 'z0_groups', 'z2_groups', 'z3_groups',
        'z0_tied', 'z1_tied', 'z2_tied', 'z3_tied']   # tied: lm_head.weight is embed.weight (DeepSpeed's shared_params)
TOL = {'fp32': 1e-6, 'groups': 1e-6, 'tied': 1e-6, 'bf16': 1e-4}
NORM_TOL = {**TOL, 'bf16': 2 ** -8}

def _env():
    return {**os.environ, 'DS_ACCELERATOR': 'cpu', 'PYTHONPATH': os.pathsep.join(filter(None, [str(ROOT), os.environ.get('PYTHONPATH')]))}

@pytest.fixture(scope='module')
def ds_dir(tmp_path_factory):
    "DeepSpeed's checkpoints and its continued losses, one torchrun job for all runs"
    out = tmp_path_factory.mktemp('deepspeed')
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', '2', '--master_port', str(free_port()),
           str(SCRIPT), str(out), *[f"{r[1]},{r.split('_')[1]}" for r in RUNS]]
    r = run_torchrun(cmd, capture_output=True, text=True, timeout=400, cwd=ROOT, env=_env())
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-6000:]
    return out

def resume_rank(rank, world, ds_dir, cases, out_dir):
    "Load each DeepSpeed checkpoint into flexrt at its target stage, save it as flexrt, train on; what each case saw"
    import flexrt
    from ds_checkpoint_train import make_model, parameters, config, train_steps, STEPS, MORE, MICRO
    results = {}
    for name, stage, load_optimizer in cases:
        dtype = name.split('_')[1]
        model = make_model(dtype)
        engine = flexrt.initialize(model=model, model_parameters=parameters(model, dtype),
                                   config=config(stage, dtype, micro=MICRO * 2 // world))[0]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            path, client = engine.load_checkpoint(Path(ds_dir, name), load_optimizer_states=load_optimizer)
        lr, steps = engine.get_lr()[0], engine.global_steps
        save = Path(out_dir, f'{name}_{stage}_{world}_{load_optimizer}')
        engine.save_checkpoint(save, tag='again')
        losses, norms = train_steps(engine, MORE, STEPS, rank, world, dtype)
        tied = getattr(engine.module, 'lm_head', None)
        tied = None if tied is None else tied.weight is engine.module.embed.weight
        results[(name, stage, load_optimizer)] = {'tied': tied, 'path': path, 'client': client, 'lr': lr, 'global_steps': steps, 'losses': losses,
                                                  'norms': norms, 'saved': str(save), 'warnings': [str(w.message) for w in caught]}
    return results

def _rel(a, b): return max(abs(x - y) / abs(y) for x, y in zip(a, b))

def _reference(ds_dir, name): return torch.load(Path(ds_dir, name, 'reference.pt'), weights_only=False)

@needs_deepspeed
@pytest.mark.parametrize('world', [2, 1])
def test_deepspeed_checkpoint_resumes_in_flexrt(ds_dir, tmp_path, world):
    from flexrt.checkpoint import consolidate
    ds_stage = {n: int(n[1]) for n in RUNS}
    target = {n: (s + 1) % 4 if world == 2 else 3 - s for n, s in ds_stage.items()}   # another stage, every stage covered
    cases = [(n, target[n], True) for n in RUNS] + ([('z2_fp32', 2, False)] if world == 2 else [])
    results = run_distributed(resume_rank, world, args=(str(ds_dir), cases, str(tmp_path)), timeout=240)[0]
    for (name, stage, load_optimizer), got in results.items():
        ref, dtype = _reference(ds_dir, name), name.split('_')[1]
        where = f'{name} loaded at stage {stage} on {world} rank(s)'
        assert got['path'] == str(Path(ds_dir, name, 'ckpt')), where
        assert got['client'] == {'epoch': 7, 'note': 'from deepspeed'}, where
        assert got['global_steps'] == ref['global_steps'] == 3, where
        assert got['lr'] == pytest.approx(ref['lr'], rel=1e-12), where
        assert got['warnings'] == [], (where, got['warnings'])
        assert got['tied'] is (True if dtype == 'tied' else None), (where, 'the tie survives the load')
        masters = consolidate(got['saved'], tag='again')   # flexrt's own checkpoint of the loaded engine
        assert sorted(masters) == sorted(ref['fp32']), where   # zero_to_fp32 orders by param group, flexrt as the module
        for k, t in ref['fp32'].items():   # flexrt's bf16 engines hold buffers in bf16, DeepSpeed's in fp32
            assert torch.equal(masters[k], t.to(masters[k].dtype)), (where, k, (masters[k] - t).abs().max())
        if load_optimizer: assert _rel(got['losses'], ref['losses']) <= TOL[dtype], (where, got['losses'], ref['losses'])
        else: assert _rel(got['losses'], ref['losses']) > 1e-3, (where, 'the optimizer state must matter')
        assert len(ref['norms']) == len(got['norms']) and (None in ref['norms']) == (name in ('z0_fp32', 'z0_groups', 'z0_tied')), (where, ref['norms'])
        if load_optimizer and None not in ref['norms']:
            assert _rel(got['norms'], ref['norms']) <= NORM_TOL[dtype], (where, 'gradient norms', got['norms'], ref['norms'])

@needs_deepspeed
def test_consolidate_cli_equals_zero_to_fp32(ds_dir, tmp_path):
    from safetensors.torch import load_file
    from flexrt.checkpoint.consolidate import main
    for name in RUNS:   # in process, every run
        ref = _reference(ds_dir, name)['fp32']
        assert main([str(ds_dir / name), str(tmp_path / f'{name}.safetensors')]) == 0
        got = load_file(tmp_path / f'{name}.safetensors')
        assert sorted(got) == sorted(ref), name
        for k, t in ref.items(): assert got[k].dtype == t.dtype and torch.equal(got[k], t), (name, k)
    from flexrt.deepspeed.compat import get_fp32_state_dict_from_zero_checkpoint   # the drop-in's zero_to_fp32
    got, ref = get_fp32_state_dict_from_zero_checkpoint(ds_dir / 'z2_bf16', tag='ckpt'), _reference(ds_dir, 'z2_bf16')['fp32']
    assert sorted(got) == sorted(ref) and all(torch.equal(got[k], t) for k, t in ref.items())
    for name, extra, out in [('z2_bf16', ['--format', 'torch', '--tag', 'ckpt'], 'z2.bin')]:   # the command itself, once
        r = subprocess.run([sys.executable, '-m', 'flexrt.checkpoint.consolidate', str(ds_dir / name), str(tmp_path / out), *extra],
                           capture_output=True, text=True, timeout=120, env=_env(), cwd=ROOT)
        assert r.returncode == 0, r.stderr[-3000:]
        got = load_file(tmp_path / out) if out.endswith('.safetensors') else torch.load(tmp_path / out, weights_only=True)
        ref = _reference(ds_dir, name)['fp32']
        assert sorted(got) == sorted(ref), name
        for k, t in ref.items(): assert torch.equal(got[k], t), (name, k)

class _Evil:
    "Unpickling this calls os.system: a checkpoint holding it must be refused before anything runs"
    def __init__(self, marker): self.marker = marker
    def __reduce__(self): return (os.system, (f'touch {self.marker}',))

def test_forbidden_global_is_refused_by_name(tmp_path):
    import flexrt, torch.nn as nn
    from flexrt.checkpoint import CheckpointError, consolidate
    from flexrt.checkpoint.consolidate import main
    marker, ck = tmp_path / 'ran', tmp_path / 'save' / 'ckpt'
    ck.mkdir(parents=True)
    states = {'module': {'weight': torch.ones(2, 3), 'bias': torch.zeros(2)}, 'buffer_names': [], 'optimizer': None,
              'global_steps': 1, 'dp_world_size': 1, 'lr_scheduler': None}
    torch.save(states, ck / 'mp_rank_00_model_states.pt')
    torch.save({'optimizer_state_dict': {'zero_stage': 1, 'hook': _Evil(marker)}}, ck / 'zero_pp_rank_0_mp_rank_00_optim_states.pt')
    (tmp_path / 'save' / 'latest').write_text('ckpt')
    engine = flexrt.initialize(model=nn.Linear(3, 2), config={'train_batch_size': 1, 'steps_per_print': 10**6,
                                                               'optimizer': {'type': 'AdamW', 'params': {'lr': 0.1}}})[0]
    before = engine.module.weight.detach().clone()
    with pytest.raises(CheckpointError, match=r'the global posix\.system'): engine.load_checkpoint(tmp_path / 'save')
    with pytest.raises(CheckpointError, match=r'the global posix\.system'): consolidate(ck)
    assert main([str(tmp_path / 'save'), str(tmp_path / 'out.safetensors')]) == 1
    assert not marker.exists() and not (tmp_path / 'out.safetensors').exists()
    assert torch.equal(engine.module.weight.detach(), before)
    # the same file without the foreign global loads
    torch.save({'optimizer_state_dict': {'zero_stage': 1}}, ck / 'zero_pp_rank_0_mp_rank_00_optim_states.pt')
    with pytest.raises(CheckpointError, match="a field is missing"): consolidate(ck)   # incomplete, but not refused as unsafe
