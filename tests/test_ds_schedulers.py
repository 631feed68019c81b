"""flexrt.schedulers against DeepSpeed 0.19.8's own `deepspeed.runtime.lr_schedules`, step by step.

DeepSpeed runs in a subprocess (tests/ds_schedule_values.py), so the real `deepspeed` never enters this process.
Compared after construction, after every `step()` and after `step(k)` jumps: the learning rate the optimizer holds
and `get_lr()`, per param group; Adam's beta1 (or SGD's momentum) the optimizer holds and OneCycle's `get_mom()`;
and which parameters make construction raise (the exception type). The deliberate differences are asserted
separately below, with both libraries' values, so a change on either side shows."""
import importlib.util, json, math, os, subprocess, sys, warnings
from pathlib import Path
import pytest, torch
from ds_schedule_values import run_case
from flexrt import schedulers
from flexrt.config import load_config

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(importlib.util.find_spec('deepspeed') is None,
                                reason='DeepSpeed is not installed: `pip install -e .[dev]` installs the pinned version')

def case(cls, kwargs, groups=(0.1, 0.3), optimizer='Adam', steps=30, jumps=(3, 17, 0)):
    return {'cls': cls, 'kwargs': kwargs, 'groups': list(groups), 'optimizer': optimizer, 'steps': steps, 'jumps': list(jumps)}

CASES = {
    'warmup-log-lists': case('WarmupLR', dict(warmup_min_lr=[0., 0.01], warmup_max_lr=[0.1, 0.5], warmup_num_steps=7)),
    'warmup-linear': case('WarmupLR', dict(warmup_min_lr=0.01, warmup_max_lr=0.2, warmup_num_steps=10, warmup_type='linear')),
    'warmup-max-from-groups': case('WarmupLR', dict(warmup_num_steps=10), groups=(0.1, 0.2)),
    'warmup-one-step': case('WarmupLR', dict(warmup_num_steps=1, warmup_max_lr=0.1)),
    'warmup-unknown-type': case('WarmupLR', dict(warmup_num_steps=10, warmup_type='not_a_warmup_type')),
    'decay-log': case('WarmupDecayLR', dict(total_num_steps=20, warmup_min_lr=0.001, warmup_max_lr=[0.1, 0.2], warmup_num_steps=5)),
    'decay-linear': case('WarmupDecayLR', dict(total_num_steps=20, warmup_num_steps=5, warmup_type='linear')),
    'cosine-log': case('WarmupCosineLR', dict(total_num_steps=25, warmup_num_steps=6, cos_min_ratio=0.05)),
    'cosine-linear': case('WarmupCosineLR', dict(total_num_steps=25, warmup_num_steps=6, warmup_type='linear')),
    'cosine-unknown-type': case('WarmupCosineLR', dict(total_num_steps=25, warmup_num_steps=6, warmup_type='cosine')),
    'cosine-no-decay-window': case('WarmupCosineLR', dict(total_num_steps=10, warmup_num_steps=10, cos_min_ratio=0.1)),
    'onecycle-lists-decay': case('OneCycle', dict(cycle_min_lr=[0.01, 0.02], cycle_max_lr=[0.1, 0.4], decay_lr_rate=0.5,
                                 cycle_first_step_size=4, cycle_second_step_size=7, decay_step_size=3,
                                 cycle_min_mom=[0.85, 0.8], cycle_max_mom=[0.95, 0.9], decay_mom_rate=0.01)),
    'onecycle-symmetric': case('OneCycle', dict(cycle_min_lr=1e-3, cycle_max_lr=1e-2, cycle_first_step_size=10,
                               cycle_min_mom=0.08, cycle_max_mom=0.09, decay_mom_rate=1e-3, decay_step_size=10)),
    'onecycle-stairs': case('OneCycle', dict(cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=6,
                            cycle_second_step_size=9, cycle_first_stair_count=3)),
    'onecycle-two-stair-counts': case('OneCycle', dict(cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=8,
                                      cycle_second_step_size=8, cycle_first_stair_count=2, cycle_second_stair_count=4)),
    'onecycle-batch-aligned-stairs': case('OneCycle', dict(cycle_min_lr=0.001, cycle_max_lr=0.01, cycle_first_step_size=10,
                                          cycle_second_step_size=21, cycle_first_stair_count=10, cycle_second_stair_count=21), steps=35),
    'onecycle-rise-only': case('OneCycle', dict(cycle_min_lr=0.001, cycle_max_lr=0.1, cycle_first_step_size=10,
                               cycle_second_step_size=0, decay_step_size=2, decay_lr_rate=0.1)),
    'onecycle-no-momentum': case('OneCycle', dict(cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=5,
                                 cycle_momentum=False), optimizer='SGD'),
    'range-continuous': case('LRRangeTest', dict(lr_range_test_min_lr=[1e-3, 2e-3], lr_range_test_step_size=3,
                             lr_range_test_step_rate=0.5)),
    'range-staircase': case('LRRangeTest', dict(lr_range_test_min_lr=1e-2, lr_range_test_step_size=4,
                            lr_range_test_step_rate=2., lr_range_test_staircase=True)),
}
ERROR_CASES = {   # parameters both libraries refuse at construction (flexrt refuses more: see test_schedulers.py)
    f'{cls}-warmup_num_steps={bad!r}': case(cls, dict(warmup_num_steps=bad, **({} if cls == 'WarmupLR' else {'total_num_steps': 100})))
    for cls in ('WarmupLR', 'WarmupDecayLR', 'WarmupCosineLR') for bad in (None, -5, 0, 10.0)} | {
    'onecycle-first-0': case('OneCycle', dict(cycle_min_lr=0.001, cycle_max_lr=0.1, cycle_first_step_size=0)),
    'onecycle-second-negative': case('OneCycle', dict(cycle_min_lr=0.001, cycle_max_lr=0.1, cycle_first_step_size=100, cycle_second_step_size=-1)),
    'onecycle-3-lrs-for-2-groups': case('OneCycle', dict(cycle_min_lr=[0.001] * 3, cycle_max_lr=0.01, cycle_first_step_size=5)),
    'onecycle-3-moms-for-2-groups': case('OneCycle', dict(cycle_min_lr=0.001, cycle_max_lr=0.01, cycle_max_mom=[0.9] * 3, cycle_first_step_size=5)),
    'range-step-size-0': case('LRRangeTest', dict(lr_range_test_step_size=0)),
    'warmup-3-lrs-for-2-groups': case('WarmupLR', dict(warmup_max_lr=[0.1] * 3)),
}
DIFFERENT_START = {'cosine-min-ratio': case('WarmupCosineLR', dict(total_num_steps=25, warmup_num_steps=6, warmup_min_ratio=0.2))}
ALL = CASES | ERROR_CASES | DIFFERENT_START

@pytest.fixture(scope='module')
def deepspeed_values(tmp_path_factory):
    "Every case run by DeepSpeed's own classes, in one subprocess"
    tmp = tmp_path_factory.mktemp('ds_schedules')
    (tmp / 'cases.json').write_text(json.dumps(list(ALL.values())))
    r = subprocess.run([sys.executable, str(ROOT / 'tests' / 'ds_schedule_values.py'), 'deepspeed', str(tmp / 'cases.json'), str(tmp / 'values.json')],
                       capture_output=True, text=True, timeout=300, env={**os.environ, 'DS_ACCELERATOR': 'cpu'})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return dict(zip(ALL, json.loads((tmp / 'values.json').read_text())))

def flexrt_values(name:str):
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        return run_case(schedulers, ALL[name])

def close(got, expected, what):
    assert len(got) == len(expected), what
    for g, e in zip(got, expected): assert g == pytest.approx(e, rel=1e-12, abs=1e-15), (what, got, expected)

@pytest.mark.parametrize('name', CASES)
def test_values_match_deepspeed(deepspeed_values, name):
    ours, theirs = flexrt_values(name), deepspeed_values[name]
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        where = f'{name}, record {i} (0: after construction)'
        close(a['lr'], b['lr'], f'optimizer lr, {where}')
        close(a['get_lr'], b['get_lr'], f'get_lr(), {where}')
        close(a['beta1'], b['beta1'], f'beta1, {where}')
        assert (a['mom'] is None) == (b['mom'] is None), where
        if b['mom'] is not None:
            assert all(isinstance(m, list) and len(m) == 2 for m in a['mom']), where    # (beta1, beta2) pairs, as DeepSpeed's
            close([m[0] for m in a['mom']], [m[0] for m in b['mom']], f'get_mom() beta1, {where}')

@pytest.mark.parametrize('name', ERROR_CASES)
def test_refuses_what_deepspeed_refuses(deepspeed_values, name):
    assert deepspeed_values[name] == {'error': 'ValueError'}
    assert flexrt_values(name) == {'error': 'ValueError'}

# ---------------------------------------------------------------- deliberate differences, pinned on both sides

def test_warmup_cosine_starts_at_warmup_min_ratio_where_deepspeed_starts_at_0(deepspeed_values):
    ours, theirs = flexrt_values('cosine-min-ratio'), deepspeed_values['cosine-min-ratio']
    assert theirs[0]['lr'] == [0., 0.] and ours[0]['lr'] == pytest.approx([0.2 * 0.1, 0.2 * 0.3])   # before the first step()
    for i, (a, b) in enumerate(zip(ours[1:], theirs[1:]), 1): close(a['lr'], b['lr'], f'record {i}')   # then the same

def test_warmup_decay_lr_default_peak_is_deepspeeds_0_001(deepspeed_values):
    "Left out, warmup_max_lr is 0.001 in both (not the optimizer's lr), and flexrt says so"
    assert max(r['lr'][1] for r in deepspeed_values['decay-linear']) == pytest.approx(0.001)
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=0.3)
    with pytest.warns(UserWarning, match=r"warms up to warmup_max_lr=0.001 \(DeepSpeed's default\), not to the optimizer's lr \[0.3\]"):
        assert schedulers.WarmupDecayLR(opt, total_num_steps=10, warmup_num_steps=2).max_lrs == [0.001]

def test_one_cycle_keeps_beta2_where_deepspeed_sets_0_99(deepspeed_values):
    theirs, ours = deepspeed_values['onecycle-lists-decay'], flexrt_values('onecycle-lists-decay')
    assert {m[1] for r in theirs for m in r['mom']} == {0.99}     # DeepSpeed replaces Adam's beta2 by 0.99
    assert {m[1] for r in ours for m in r['mom']} == {0.999}      # flexrt keeps the optimizer's own

def test_unknown_warmup_type_warns_and_uses_log():
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=0.001)
    with pytest.warns(UserWarning, match=r"warmup_type 'not_a_warmup_type' is not one of \('log', 'linear'\): using 'log'"):
        s = schedulers.WarmupCosineLR(opt, total_num_steps=100, warmup_num_steps=10, warmup_type='not_a_warmup_type')
    assert s.warmup_type == 'log'

def test_config_with_null_warmup_num_steps_loads_and_building_it_raises_as_deepspeed():
    "DeepSpeed's config takes `warmup_num_steps: null`; its WarmupLR then raises ValueError: the same here"
    block = {'type': 'WarmupLR', 'params': {'warmup_num_steps': None}}
    config = load_config({'train_batch_size': 2, 'scheduler': block})
    assert config.scheduler.params == {'warmup_num_steps': None}
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=0.001)
    with pytest.raises(ValueError, match='warmup_num_steps must be a positive int, got None'):
        schedulers.build_scheduler(config.scheduler.type, opt, config.scheduler.params)

def test_one_cycle_starts_at_cycle_min_mom_as_deepspeed(deepspeed_values):
    "Both set cycle_min_mom at construction, though get_mom() there reports cycle_max_mom"
    for values in (deepspeed_values['onecycle-lists-decay'], flexrt_values('onecycle-lists-decay')):
        assert values[0]['beta1'] == [0.85, 0.8] and [m[0] for m in values[0]['mom']] == [0.95, 0.9]
        assert values[1]['beta1'] == pytest.approx([0.95 - 0.1 / 4, 0.9 - 0.1 / 4])
