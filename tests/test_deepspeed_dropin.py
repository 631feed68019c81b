"""DeepSpeed drop-in, configs and module tree: every key the installed DeepSpeed's config reads loads in flexrt (implemented,
or warned once naming it); DeepSpeed's config objects under its names; expert groups; the DeepSpeed test runner's parsing."""
import json, os, subprocess, sys, warnings
from pathlib import Path
import pytest, torch
from flexrt.config import FlexConfig, ZeroConfig, BATCH_KEYS, load_config, NoEffectWarning
from flexrt.config.compat import no_effect_entry, is_field, field_at, default_of
from tests.helpers import run_distributed

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = {'optimizer.type': 'Adam', 'scheduler.type': 'WarmupLR'}   # keys whose DeepSpeed default (null) means "no block"

def _has_deepspeed()->bool:
    code = 'import importlib.util, sys; sys.exit(0 if importlib.util.find_spec("deepspeed") else 1)'
    return subprocess.run([sys.executable, '-c', code], cwd='/').returncode == 0

@pytest.fixture(scope='module')
def deepspeed_keys()->dict:
    "{key path: DeepSpeed's default}, generated from the installed DeepSpeed's config code (tests/ds_config_keys.py)"
    if not _has_deepspeed(): pytest.skip('deepspeed is not installed (the bench extra): its config keys cannot be listed')
    out = subprocess.run([sys.executable, str(ROOT / 'tests' / 'ds_config_keys.py')], env={**os.environ, 'DS_ACCELERATOR': 'cpu'},
                         capture_output=True, text=True, timeout=300, check=True, cwd='/')
    keys = json.loads(out.stdout)
    assert len(keys) > 200 and 'zero_optimization.stage' in keys and 'activation_checkpointing.cpu_checkpointing' in keys
    return keys

def nested(path:str, value)->dict:
    cfg = {'train_batch_size': 8}
    node, parts = cfg, path.split('.')
    for p in parts[:-1]: node = node.setdefault(p, {'type': EXAMPLE[f'{p}.type']} if f'{p}.type' in EXAMPLE else {})
    node[parts[-1]] = value
    return cfg

def canonical(path:str)->str:
    "`path` with the legacy block and key names flexrt renames (bfloat16 -> bf16, ...)"
    first, _, rest = path.partition('.')
    first = FlexConfig.renamed.get(first, first)
    if first == 'zero_optimization' and rest: rest = ZeroConfig.renamed.get(rest, rest)
    return f'{first}.{rest}' if rest else first

def other_value(value):
    "A valid value different from `value` (for a key that warns only away from its default)"
    if isinstance(value, bool): return not value
    return value + 1 if isinstance(value, int) else value

def load_warned(cfg:dict)->tuple:
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter('always')
        c = load_config(cfg)
    return c, [str(w.message) for w in got if issubclass(w.category, NoEffectWarning)]

def test_every_key_deepspeed_reads_loads_implemented_or_warned_once(deepspeed_keys):
    problems = []
    for key, default in sorted(deepspeed_keys.items()):
        path, entry = canonical(key), no_effect_entry(key)
        value = EXAMPLE.get(key, default)
        if entry is not None and (f := field_at(FlexConfig, canonical(key))) is not None and value == default_of(f): value = other_value(value)
        try: c, warned = load_warned(nested(key, value))
        except (TypeError, ValueError) as e:
            problems.append(f'{key}={value!r}: {e}'); continue
        naming = [w for w in warned if key in w.split(' has no effect')[0] or path in w.split(' has no effect')[0]]
        translated = path in BATCH_KEYS or path.split('.')[-1] in ZeroConfig.legacy   # batch triangle; cpu_offload* become offload blocks
        if entry is None:
            if not (translated or is_field(FlexConfig, path)): problems.append(f'{key}: neither implemented nor in NO_EFFECT')
            elif naming: problems.append(f'{key}: implemented but warned: {naming}')
        elif len(naming) != 1: problems.append(f'{key}={value!r}: {len(naming)} warnings name it: {warned}')
        elif load_warned(c.to_dict())[0] != c: problems.append(f'{key}: to_dict does not round-trip')
    assert not problems, f'{len(problems)} of {len(deepspeed_keys)} keys:\n' + '\n'.join(problems)

def test_a_key_without_effect_keeps_its_value_for_to_dict():
    c, warned = load_warned({'train_batch_size': 8, 'comet': {'enabled': True, 'project': 'p'}, 'compile': {'deepcompile': True},
                             'zero_optimization': {'stage': 2, 'zeropp_loco_param': {'err_beta': 0.8}}})
    assert len(warned) == 3 and 'comet.enabled, comet.project has no effect in flexrt: flexrt has no Comet sink' in warned[0]
    d = c.to_dict()
    assert (d['comet'], d['compile'], d['zero_optimization']['zeropp_loco_param']) == ({'enabled': True, 'project': 'p'}, {'deepcompile': True}, {'err_beta': 0.8})
    assert load_warned(d)[0] == c

def test_values_deepspeed_takes_load():
    c, warned = load_warned({'train_batch_size': 8, 'zero_allow_untested_optimizer': 1, 'steps_per_print': None,
                             'scheduler': {'type': 'WarmupLR', 'params': {'warmup_num_steps': None}}, 'gradient_allreduce_op': 'MEAN'})
    assert (c.zero_allow_untested_optimizer, c.steps_per_print > 10**12, c.gradient_allreduce_op, warned) == (True, True, 'mean', [])
    c, warned = load_warned({'gradient_allreduce_op': 'sum', 'zero_optimization': {'stage': 1, 'mics_shard_size': -1, 'zero_hpz_partition_size': 1}})
    assert (c.gradient_allreduce_op, warned) == ('sum', [])   # 'sum' takes effect; the zero keys at their defaults: silent

@pytest.mark.parametrize('cfg,fragment', [
    ({'gradient_allreduce_op': 'max'}, "gradient_allreduce_op must be one of 'mean', 'sum', got 'max'"),
    ({'activation_checkpointing': {'number_checkpoints': 0}}, 'activation_checkpointing.number_checkpoints must be a positive int, got 0'),
    ({'activation_checkpointing': {'cpu_checkpoint': True}}, "unknown key 'cpu_checkpoint' in activation_checkpointing (did you mean 'cpu_checkpointing'?)"),
    ({'steps_per_print': 0}, 'steps_per_print must be a positive int'), ({'not_applied': {}}, "unknown key 'not_applied' at the top level"),
    ({'bf16': {'enabled': 'yes'}}, 'bf16.enabled must be true or false')])
def test_really_wrong_values_still_fail_naming_the_key(cfg, fragment):
    with pytest.raises((TypeError, ValueError), match=None) as e: load_warned(cfg)
    assert fragment in str(e.value)

@pytest.fixture
def deepspeed_tree():
    import flexrt.deepspeed as fd
    yield fd.use_as_deepspeed()
    fd.stop_using_as_deepspeed()

def test_deepspeed_config_objects_have_deepspeeds_names_and_can_be_changed(deepspeed_tree):
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig, DeepSpeedZeroOffloadParamConfig, DeepSpeedZeroOffloadOptimizerConfig
    c = DeepSpeedConfig({'train_batch_size': 8, 'gradient_accumulation_steps': 4, 'zero_optimization': {'stage': 3, 'stage3_max_reuse_distance': 7}})
    assert (c.train_micro_batch_size_per_gpu, c.zero_optimization_stage, c.zero_config.max_reuse_distance, c.zero_config.overlap_comm) == (2, 3, 7, True)
    c.train_batch_size = 16   # DeepSpeed code assigns to its config
    assert c.train_batch_size == 16
    z = DeepSpeedZeroConfig(**{'offload_param': {}, 'offload_optimizer': None, 'stage3_gather_fp16_weights_on_model_save': True})
    assert isinstance(z.offload_param, DeepSpeedZeroOffloadParamConfig) and z.offload_optimizer is None and z.gather_16bit_weights_on_model_save
    assert DeepSpeedZeroOffloadOptimizerConfig(pipeline_read=True).pipeline
    with pytest.raises(ValueError, match='zero_optimization.stage must be an int from 0 to 3'): DeepSpeedZeroConfig(stage=5)

def test_deepspeed_names_flexrt_lacks_import_and_say_why(deepspeed_tree):
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.pipe import PipelineModule
    from deepspeed.ops.op_builder import FusedAdamBuilder
    import deepspeed
    assert not isinstance(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1), FP16_Optimizer)
    class Pipe(PipelineModule): pass
    with pytest.raises(NotImplementedError, match='deepspeed.pipe.PipelineModule: flexrt has no equivalent'): Pipe()
    assert deepspeed.ops.__compatible_ops__[FusedAdamBuilder.NAME] and not deepspeed.ops.__compatible_ops__['inference_core_ops']

def test_initialize_configures_activation_checkpointing_from_the_config(deepspeed_tree):
    import deepspeed
    from flexrt.deepspeed import compat
    compat.reset()
    model = torch.nn.Linear(4, 2)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), dist_init_required=False,
                                      config={'train_batch_size': 2, 'optimizer': {'type': 'SGD', 'params': {'lr': 0.1}},
                                              'activation_checkpointing': {'cpu_checkpointing': True}})
    assert compat.is_configured() and compat.SETTINGS['cpu']
    compat.reset()

def _expert_clip(rank, world):
    from flexrt.deepspeed import groups, compat
    groups._create_expert_and_data_parallel(2)
    dense, expert = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    dense.grad, expert.grad, expert.allreduce = torch.ones(1), torch.tensor([rank + 1.]), False
    norm = float(compat.clip_grad_norm_([dense, expert], max_norm=0.1))
    return norm, groups._get_expert_parallel_world_size('ep_size_2'), groups._get_expert_data_parallel_world_size('ep_size_2')

def test_expert_groups_and_clip_agree_across_ranks():
    out = run_distributed(_expert_clip, 2)
    assert out[0] == out[1] and out[0][1:] == (2, 1)
    assert abs(out[0][0] - (1 + 1 + 4) ** 0.5) < 1e-5   # dense once, both ranks' expert gradients

def test_ds_tests_counts_a_junit_report(tmp_path):
    sys.path.insert(0, str(ROOT / 'tools'))
    import ds_tests
    (tmp_path / 'j.xml').write_text('<testsuites><testsuite><testcase name="a"/><testcase name="b"><failure/></testcase>'
                                    '<testcase name="c"><skipped/></testcase><testcase name="d"><error/></testcase></testsuite></testsuites>')
    got = ds_tests.outcomes(tmp_path / 'j.xml')
    assert got == {'a': 'passed', 'b': 'failed', 'c': 'skipped', 'd': 'failed'}
    assert ds_tests.counts(got) == {'passed': 1, 'failed': 2, 'skipped': 1}
    real = {'f.py': {'tests': {'a': 'passed', 'b': 'passed', 'c': 'skipped', 'd': 'failed'}}}   # --compare's table: b passes on DeepSpeed only
    assert ds_tests.markdown(['f.py'], real, {'f.py': {'tests': got}}, 2).splitlines()[2] == '| `f.py` | 2 / 1 / 1 | 1 / 2 / 1 | 1 |'
    with pytest.raises(SystemExit): ds_tests.main([str(tmp_path)])   # not a DeepSpeed checkout
