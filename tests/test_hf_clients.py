"""Hugging Face `Trainer` and Accelerate run on flexrt as they run on DeepSpeed (issue 25).

The user code is ordinary Transformers and Accelerate code with no flexrt import (hf_trainer_train.py,
hf_accelerate_train.py); flexrt comes in only through a documented entry point:
  - `torchrun -m flexrt.deepspeed hf_trainer_train.py` (the Trainer at ZeRO stages 0, 2 and 3),
  - `accelerate launch --use_deepspeed` in an environment where `python -m flexrt.deepspeed --install-alias` was run
    (Accelerate's DeepSpeedPlugin loop at stage 2),
  - `notebook_launcher` after one `flexrt.use_as_deepspeed()` line (hf_notebook_launch.py; the same loop at stage 3).
Each is run once on real DeepSpeed too (torchrun, DS_ACCELERATOR=cpu), in this session, and the two are compared:
losses within 1e-6, gradient norms within 1e-6 (relative), the same learning rates, the same saved weights, and resumed
steps (from a Trainer checkpoint / `load_state`) repeating the first pass. Each client runs once per engine
(module-scoped fixtures) and several tests read the results. Detection (`find_spec`, `importlib.metadata`) is checked
in fresh interpreters: present while aliased, gone after, refused next to an imported DeepSpeed; and the `.pth` alias
in a throwaway virtual environment."""
import importlib.util, json, math, os, socket, subprocess, sys
from pathlib import Path
import pytest
from helpers import run_torchrun, alias_environment

ROOT, TESTS = Path(__file__).resolve().parent.parent, Path(__file__).resolve().parent
ENV = os.environ | {'DS_ACCELERATOR': 'cpu', 'OMP_NUM_THREADS': '1', 'PYTHONPATH': f'{ROOT}{os.pathsep}{TESTS}',
                    'HF_HUB_OFFLINE': '1', 'TRANSFORMERS_VERBOSITY': 'error', 'TOKENIZERS_PARALLELISM': 'false'}
pytestmark = pytest.mark.skipif(importlib.util.find_spec('transformers') is None or importlib.util.find_spec('deepspeed') is None,
                                reason='transformers and deepspeed are dev requirements: pip install -e ".[dev]"')
DS_ENGINE, FLEXRT_ENGINE = 'deepspeed.runtime.engine.DeepSpeedEngine', 'flexrt.engine.core.Engine'

def _free_port()->str:
    from helpers import free_port   # this xdist worker's share of the ports
    return str(free_port())

def _run(cmd:list, cwd:Path, name:str, env:dict=ENV):
    r = run_torchrun(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=cwd)
    assert r.returncode == 0, f'{name} failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}'

def _torchrun(*args, python=sys.executable)->list:
    return [python, '-m', 'torch.distributed.run', '--nproc_per_node', '2', '--master_port', _free_port(), *map(str, args)]

def _deepspeed(script:str, *args)->list:
    "torchrun of `script` on real DeepSpeed (tests/real_deepspeed.py: the CPU accelerator, no shared-memory op)"
    return _torchrun(TESTS / 'real_deepspeed.py', TESTS / script, *args)

# ---------------------------------------------------------------------------------------------------- the runs
@pytest.fixture(scope='module')
def trainer(tmp_path_factory):
    "hf_trainer_train.py at stages 0, 2, 3, on DeepSpeed and on flexrt: {engine: (results by stage, output folder)}"
    out = {}
    for engine in ('deepspeed', 'flexrt'):
        folder = tmp_path_factory.mktemp(f'trainer_{engine}')
        args = ('--out', folder / 'results.json', '--stages', 0, 2, 3)
        cmd = _deepspeed('hf_trainer_train.py', *args) if engine == 'deepspeed' else _torchrun('-m', 'flexrt.deepspeed', TESTS / 'hf_trainer_train.py', *args)
        _run(cmd, folder, f'the Trainer on {engine}')
        out[engine] = json.loads((folder / 'results.json').read_text()), folder
    return out

@pytest.fixture(scope='module')
def accelerate(tmp_path_factory):
    "hf_accelerate_train.py at stages 2 and 3 on DeepSpeed; on flexrt, stage 2 by `accelerate launch --use_deepspeed` with the alias installed, stage 3 by `notebook_launcher`: {stage: {engine: results}}"
    theirs, ours = tmp_path_factory.mktemp('accelerate_deepspeed'), tmp_path_factory.mktemp('accelerate_flexrt')
    for stage in (2, 3):
        _run(_deepspeed('hf_accelerate_train.py', '--stage', stage, '--out', theirs / f'{stage}.json'), theirs, f'Accelerate stage {stage} on DeepSpeed')
    python = alias_environment(tmp_path_factory.mktemp('alias_env') / 'venv', ENV)
    launch = [python, '-m', 'accelerate.commands.launch', '--use_deepspeed', '--num_processes', '2', '--num_machines', '1', '--mixed_precision', 'no',
              '--dynamo_backend', 'no', '--main_process_port', _free_port(), TESTS / 'hf_accelerate_train.py', '--stage', 2, '--out', ours / '2.json']
    _run(list(map(str, launch)), ours, 'accelerate launch --use_deepspeed with the alias installed')
    _run([sys.executable, str(TESTS / 'hf_notebook_launch.py'), '3', str(ours / '3.json')], ours, 'notebook_launcher after flexrt.use_as_deepspeed()')
    return {stage: {e: json.loads((d / f'{stage}.json').read_text()) for e, d in (('deepspeed', theirs), ('flexrt', ours))} for stage in (2, 3)}

# ---------------------------------------------------------------------------------------------------- comparisons
def _close(ours:float, theirs:float, what:str, tolerance:float=1e-6):
    assert abs(ours - theirs) <= tolerance * max(1., abs(theirs)), f'{what}: flexrt {ours!r}, DeepSpeed {theirs!r}'

def _same_steps(ours:list, theirs:list, what:str, norms_of:list|None=None):
    "Step by step: losses within 1e-6, learning rates equal, gradient norms within 1e-6 (of `norms_of`, when DeepSpeed logged none)"
    assert len(ours) == len(theirs) > 0, f'{what}: {len(ours)} steps on flexrt, {len(theirs)} on DeepSpeed'
    for i, (a, b) in enumerate(zip(ours, theirs)):
        _close(a['loss'], b['loss'], f'{what} step {i + 1} loss')
        assert math.isclose(a['learning_rate'], b['learning_rate'], rel_tol=1e-9, abs_tol=1e-12), f"{what} step {i + 1}: lr {a['learning_rate']} vs {b['learning_rate']}"
        norm = b['grad_norm'] if norms_of is None else norms_of[i]['grad_norm']
        assert a['grad_norm'] is not None, f'{what} step {i + 1}: flexrt logged no gradient norm'
        _close(a['grad_norm'], norm, f'{what} step {i + 1} gradient norm')

def test_trainer_trains_as_on_deepspeed(trainer):
    (ours, _), (theirs, _) = trainer['flexrt'], trainer['deepspeed']
    assert sorted(ours) == sorted(theirs) == ['0', '2', '3']
    for stage in ours:
        assert (ours[stage]['engine'], theirs[stage]['engine']) == (FLEXRT_ENGINE, DS_ENGINE)
        assert ours[stage]['partitioned'] == theirs[stage]['partitioned'] == (stage == '3')   # from_config under zero.Init, 'auto' still in the config
        assert [s['step'] for s in ours[stage]['first']] == list(range(1, 11))
        # DeepSpeed's fp32 stage 0 records no global norm (get_global_grad_norm() is None): its stage 2, same gradients, has them
        no_norms = all(s['grad_norm'] is None for s in theirs[stage]['first'])
        _same_steps(ours[stage]['first'], theirs[stage]['first'], f'Trainer stage {stage}', theirs['2']['first'] if no_norms else None)

def test_trainer_resume_repeats_the_first_pass(trainer):
    (ours, _), (theirs, _) = trainer['flexrt'], trainer['deepspeed']
    for stage in ours:
        first, resumed = ours[stage]['first'], ours[stage]['resumed']
        assert [s['step'] for s in resumed] == list(range(1, 11))         # steps 1-5 come from the checkpoint's trainer_state.json
        assert resumed[5:] == first[5:], f'stage {stage}: resumed from checkpoint-5, steps 6-10 differ from the first pass'
        assert theirs[stage]['resumed'][5:] == theirs[stage]['first'][5:]   # DeepSpeed repeats them too

def test_trainer_saved_model_matches_deepspeed(trainer):
    """`trainer.save_model()`: clone_tensors_for_torch_save at stages 0 and 2, _zero3_consolidated_16bit_state_dict at stage 3
    (after 10 AdamW steps, float rounding moves weights by ~1e-6; a lost update or a wrong tensor moves them by ~1e-3)"""
    import torch
    from safetensors.torch import load_file
    (ours, our_dir), (theirs, their_dir) = trainer['flexrt'], trainer['deepspeed']
    for stage in ours:
        assert ours[stage]['saved'] == theirs[stage]['saved'] and 'model.safetensors' in ours[stage]['saved']
        a, b = (load_file(d / f'stage{stage}' / 'final' / 'model.safetensors') for d in (our_dir, their_dir))
        assert sorted(a) == sorted(b), f'stage {stage}: saved names differ: {sorted(set(a) ^ set(b))}'
        for name in a: torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5, msg=lambda m: f'stage {stage} {name}: {m}')

def test_accelerate_trains_as_on_deepspeed(accelerate):
    for stage, runs in accelerate.items():
        ours, theirs = runs['flexrt'], runs['deepspeed']
        assert (ours['engine'], theirs['engine']) == (FLEXRT_ENGINE, DS_ENGINE), f'stage {stage}'
        assert len(ours['first']) == 8
        _same_steps(ours['first'], theirs['first'], f'Accelerate stage {stage}')
        assert list(ours['weights']) == list(theirs['weights']), f'stage {stage}: get_state_dict names differ'   # tied lm_head.weight too
        for name, (total, size) in ours['weights'].items():
            _close(total, theirs['weights'][name][0], f'stage {stage} {name} sum', 1e-4); _close(size, theirs['weights'][name][1], f'stage {stage} {name} abs sum', 1e-4)

def test_accelerate_load_state_repeats_the_first_pass(accelerate):
    for stage, runs in accelerate.items():
        for engine, run in runs.items():
            assert run['resumed'] == run['first'][4:], f'{engine}, stage {stage}: after load_state the last 4 steps differ from the first pass'

# ---------------------------------------------------------------------------------------------------- detection
PROBE = r'''
import importlib.util, importlib.metadata, json, sys
def seen():
    spec = importlib.util.find_spec('deepspeed')
    try: d = importlib.metadata.distribution('deepspeed'); found = [d.version, d.read_text('INSTALLER')]
    except importlib.metadata.PackageNotFoundError: found = None
    return {'origin': spec and spec.origin, 'distribution': found}
import flexrt
out = {'before': seen()}
flexrt.use_as_deepspeed()
from accelerate.utils import compare_versions, is_deepspeed_available      # Accelerate asks as Transformers does
out['aliased'] = dict(seen(), accelerate=[is_deepspeed_available(), compare_versions('deepspeed', '>=', '0.9.3')])
from flexrt.deepspeed import stop_using_as_deepspeed
stop_using_as_deepspeed()
out['stopped'] = seen()
import deepspeed                                                            # the real one
try: flexrt.use_as_deepspeed(); out['refused'] = None
except RuntimeError as e: out['refused'] = str(e)
out['after_refusal'] = dict(seen(), module=deepspeed.__file__)
print(json.dumps(out))
'''

def test_detection_follows_the_alias():
    r = subprocess.run([sys.executable, '-c', PROBE], capture_output=True, text=True, env=ENV, timeout=120)
    assert r.returncode == 0, r.stderr[-4000:]
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    real = seen['before']   # DeepSpeed is installed here (a dev requirement): this is its answer
    assert real['origin'].endswith('deepspeed/__init__.py') and real['distribution'][1] != 'flexrt\n'
    assert seen['aliased'] == {'origin': 'flexrt shim for deepspeed', 'distribution': ['0.19.8', 'flexrt\n'], 'accelerate': [True, True]}
    assert seen['stopped'] == real                     # the alias removed: the installed DeepSpeed is found again
    assert 'the real deepspeed is already imported' in seen['refused']
    assert seen['after_refusal'] == dict(real, module=real['origin'])   # refused: nothing of flexrt's left behind

def test_install_alias_and_remove_alias(tmp_path):
    "`python -m flexrt.deepspeed --install-alias` in a fresh environment (next to an installed DeepSpeed), then `--remove-alias`"
    python = alias_environment(tmp_path / 'venv', ENV)
    probe = ('import json, sys, importlib.util, importlib.metadata; started = "deepspeed" in sys.modules; s = importlib.util.find_spec("deepspeed"); '
             'print(json.dumps([started, s.origin, importlib.metadata.distribution("deepspeed").read_text("INSTALLER").strip()]))')
    def look(**env)->list: # [deepspeed imported at start, the spec's origin, the distribution's INSTALLER]
        return json.loads(subprocess.run([python, '-c', probe], capture_output=True, text=True, env=ENV | env, check=True).stdout)
    assert look() == [False, 'flexrt shim for deepspeed', 'flexrt']     # nothing imported at start; the first look-up aliases
    started, origin, installer = real = look(FLEXRT_DEEPSPEED_ALIAS='0')  # switched off for one process: the installed one
    assert started is False and origin.endswith('deepspeed/__init__.py') and installer != 'flexrt'
    r = subprocess.run([python, '-m', 'flexrt.deepspeed', '--remove-alias'], capture_output=True, text=True, env=ENV, check=True)
    assert r.stdout.startswith('removed ') and 'flexrt_deepspeed_alias.pth' in r.stdout
    assert look() == real                                                  # the installed DeepSpeed again
    r = subprocess.run([python, '-m', 'flexrt.deepspeed', '--remove-alias'], capture_output=True, text=True, env=ENV, check=True)
    assert r.stdout.strip() == 'no alias was installed here'
