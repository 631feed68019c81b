"""flexrt.schedulers: values against DeepSpeed's formulas (computed here, independently), param groups, exact resume, config errors."""
import copy, math, warnings
import pytest
import torch
from torch.optim.lr_scheduler import LRScheduler
from flexrt.schedulers import (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest, BatchLRScheduler,
                               build_scheduler, SCHEDULERS)


def two_groups(opt_cls=torch.optim.SGD, lrs=(0.1, 0.3), **kw):
    "An optimizer with two param groups of different learning rates"
    groups = [{'params': [torch.nn.Parameter(torch.zeros(2))], 'lr': lrs[0]},
              {'params': [torch.nn.Parameter(torch.zeros(3))], 'lr': lrs[1]}]
    return opt_cls(groups, lr=lrs[0], **kw)

def run(scheduler, steps):
    "Learning rates per group: after construction, then after each step (also checks the optimizer holds them)"
    out = [scheduler.get_last_lr()]
    for _ in range(steps):
        scheduler.step()
        assert [g['lr'] for g in scheduler.optimizer.param_groups] == scheduler.get_last_lr()
        out.append(scheduler.get_last_lr())
    return out

def close(got, expected, tol=1e-12):
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g == pytest.approx(e, rel=tol, abs=tol), (got, expected)

# ---------------------------------------------------------------- reference formulas (DeepSpeed's documented semantics)
# i is the batch index `last_batch_iteration`: -1 right after construction, then 0, 1, 2, ...

def ref_warmup(i, n, kind):
    "Warmup progress at batch i; DeepSpeed uses at least 2 warmup steps and the start value before the first step"
    n = max(n, 2)
    if i <= 0: return 0.0
    if i >= n: return 1.0
    return math.log(i + 1) / math.log(n) if kind == 'log' else i / n

def ref_warmup_lr(i, lo, hi, n, kind): return lo + (hi - lo) * ref_warmup(i, n, kind)

def ref_warmup_decay_lr(i, lo, hi, n, total, kind):
    if i < max(n, 2): return ref_warmup_lr(i, lo, hi, n, kind)
    return lo + (hi - lo) * max(0.0, (total - i) / max(1, total - max(n, 2)))

def ref_cosine_lr(i, base, total, n, wmin, cmin, kind):
    n = max(n, 2)
    if i < n: return base * (wmin + (1 - wmin) * ref_warmup(i, n, kind))
    t = min(1.0, (i - n + 1) / max(1, total - n))
    return base * (cmin + (1 - cmin) * 0.5 * (1 + math.cos(math.pi * t)))

def ref_one_cycle_scale(i, first, second, stairs1, stairs2):
    "DeepSpeed's 1cycle scale factor (x / step_ratio rising, (x-1)/(step_ratio-1) falling), with stairs"
    total, b = first + second, i + 1
    ratio = first / total
    x = 1. + b / total - math.floor(1 + b / total)
    if x <= ratio:
        scale, stairs, offset, size = x / ratio, stairs1, b % total, first
    else:
        scale, stairs, offset, size = (x - 1) / (ratio - 1), stairs2, total - b % total, second
    if stairs > 0: scale = math.floor(offset / (size / stairs) + 1e-9) / stairs
    return scale

def ref_one_cycle(i, lo, hi, mlo, mhi, first, second, stairs1, stairs2, decay_step, lr_rate, mom_rate):
    total = first + second
    if i < total:
        s = ref_one_cycle_scale(i, first, second, stairs1, stairs2)
        return lo + (hi - lo) * s, mhi - (mhi - mlo) * s
    k = (i - total + 1) / decay_step if decay_step else 0.
    return lo / (1 + lr_rate * k), mhi * (1 + mom_rate * k)

def ref_range_test(i, lo, size, rate, staircase):
    interval = (i + 1) / size
    return lo * (1 + rate * (math.floor(interval) if staircase else interval))

# ---------------------------------------------------------------- values

@pytest.mark.parametrize('kind', ['log', 'linear'])
def test_warmup_lr(kind):
    s = WarmupLR(two_groups(), warmup_min_lr=[0.0, 0.01], warmup_max_lr=[0.1, 0.5], warmup_num_steps=7, warmup_type=kind)
    got = run(s, 12)
    for step, lrs in enumerate(got):
        close(lrs, [ref_warmup_lr(step - 1, 0.0, 0.1, 7, kind), ref_warmup_lr(step - 1, 0.01, 0.5, 7, kind)])
    assert got[-1] == [0.1, 0.5] and got[0] == got[1] == [0.0, 0.01]

def test_warmup_lr_known_values():
    "Hand-computed: log warmup over 10 steps from 0 to 1"
    got = [lrs[0] for lrs in run(WarmupLR(torch.optim.SGD([torch.zeros(1)], lr=1.), warmup_num_steps=10), 11)]
    close(got, [0., 0., math.log10(2), math.log10(3), math.log10(4), math.log10(5), math.log10(6), math.log10(7),
                math.log10(8), math.log10(9), 1.0, 1.0])

def test_warmup_max_lr_defaults_to_each_groups_lr():
    s = WarmupLR(two_groups(lrs=(0.2, 0.4)), warmup_num_steps=3, warmup_type='linear')
    close(run(s, 4)[-1], [0.2, 0.4])

@pytest.mark.parametrize('kind', ['log', 'linear'])
def test_warmup_decay_lr(kind):
    s = WarmupDecayLR(two_groups(), total_num_steps=20, warmup_min_lr=0.001, warmup_max_lr=[0.1, 0.2],
                      warmup_num_steps=5, warmup_type=kind)
    for step, lrs in enumerate(run(s, 25)):
        i = step - 1
        close(lrs, [ref_warmup_decay_lr(i, 0.001, 0.1, 5, 20, kind), ref_warmup_decay_lr(i, 0.001, 0.2, 5, 20, kind)])
    assert s.get_last_lr() == [0.001, 0.001]       # decayed back to warmup_min_lr at total_num_steps, and held

@pytest.mark.parametrize('kind', ['log', 'linear'])
def test_warmup_cosine_lr(kind):
    s = WarmupCosineLR(two_groups(lrs=(0.1, 0.3)), total_num_steps=30, warmup_min_ratio=0.1, warmup_num_steps=6,
                       cos_min_ratio=0.05, warmup_type=kind)
    for step, lrs in enumerate(run(s, 36)):
        i = step - 1
        close(lrs, [ref_cosine_lr(i, 0.1, 30, 6, 0.1, 0.05, kind), ref_cosine_lr(i, 0.3, 30, 6, 0.1, 0.05, kind)])
    close(s.get_last_lr(), [0.1 * 0.05, 0.3 * 0.05])

@pytest.mark.parametrize('first, second, stairs1, stairs2', [(5, None, 0, None), (4, 7, 0, None), (6, 9, 3, None), (6, 8, 2, 4)])
def test_one_cycle(first, second, stairs1, stairs2):
    opt = two_groups(torch.optim.AdamW, betas=(0.5, 0.95))
    s = OneCycle(opt, cycle_min_lr=[0.01, 0.02], cycle_max_lr=[0.1, 0.4], decay_lr_rate=0.5,
                 cycle_first_step_size=first, cycle_second_step_size=second, cycle_first_stair_count=stairs1,
                 cycle_second_stair_count=stairs2, decay_step_size=3, cycle_min_mom=0.85, cycle_max_mom=0.95,
                 decay_mom_rate=0.01)
    second_ = first if second is None else second
    stairs2_ = stairs1 if stairs2 is None else stairs2
    for step in range(first + second_ + 8):
        i = s.last_batch_iteration
        for g, lo, hi in zip(opt.param_groups, (0.01, 0.02), (0.1, 0.4)):
            lr, mom = ref_one_cycle(i, lo, hi, 0.85, 0.95, first, second_, stairs1, stairs2_, 3, 0.5, 0.01)
            if step == 0: mom = 0.85            # DeepSpeed's start: cycle_min_mom until the first step()
            assert g['lr'] == pytest.approx(lr, abs=1e-12) and g['betas'][0] == pytest.approx(mom, abs=1e-12)
            assert g['betas'][1] == 0.95
        s.step()

def test_one_cycle_known_values():
    "Hand-computed: up in 2, down in 4, then decay every 2 batches at rate 1"
    s = OneCycle(torch.optim.SGD([torch.zeros(1)], lr=1., momentum=0.5), cycle_min_lr=0.1, cycle_max_lr=0.5,
                 cycle_first_step_size=2, cycle_second_step_size=4, decay_step_size=2, decay_lr_rate=1.0)
    got = run(s, 8)
    close([l[0] for l in got], [0.1, 0.3, 0.5, 0.4, 0.3, 0.2, 0.1, 0.1 / 1.5, 0.05])
    assert s.optimizer.param_groups[0]['momentum'] == pytest.approx(0.9)      # SGD momentum is cycled too
    s.step(batch_iteration=1)
    assert s.optimizer.param_groups[0]['momentum'] == pytest.approx(0.8) and s.get_last_lr() == [0.5]

def test_one_cycle_without_momentum_warns_and_leaves_it():
    opt = torch.optim.SGD([torch.zeros(1)], lr=1.)
    with pytest.warns(UserWarning, match='cycle_momentum is off'):
        s = OneCycle(opt, 0.1, 1.0, cycle_first_step_size=3)
    run(s, 4)
    assert opt.param_groups[0]['momentum'] == 0 and s.get_mom() is None

@pytest.mark.parametrize('staircase', [False, True])
def test_lr_range_test(staircase):
    s = LRRangeTest(two_groups(), lr_range_test_min_lr=[1e-3, 2e-3], lr_range_test_step_size=3,
                    lr_range_test_step_rate=0.5, lr_range_test_staircase=staircase)
    for step, lrs in enumerate(run(s, 12)):
        close(lrs, [ref_range_test(step - 1, 1e-3, 3, 0.5, staircase), ref_range_test(step - 1, 2e-3, 3, 0.5, staircase)])

# ---------------------------------------------------------------- resume, jumps, torch compatibility

CASES = [
    ('WarmupLR', dict(warmup_min_lr=0.0, warmup_max_lr=[0.1, 0.2], warmup_num_steps=8)),
    ('WarmupDecayLR', dict(total_num_steps=25, warmup_num_steps=6, warmup_type='linear')),
    ('WarmupCosineLR', dict(total_num_steps=25, warmup_num_steps=6, warmup_min_ratio=0.1)),
    ('OneCycle', dict(cycle_min_lr=0.01, cycle_max_lr=0.2, cycle_first_step_size=5, cycle_second_step_size=7,
                      cycle_first_stair_count=2, decay_step_size=2, decay_lr_rate=0.3, decay_mom_rate=0.01)),
    ('LRRangeTest', dict(lr_range_test_min_lr=1e-3, lr_range_test_step_size=4, lr_range_test_staircase=True)),
]

def group_values(opt): return [(g['lr'], tuple(g['betas'])) for g in opt.param_groups]

@pytest.mark.parametrize('name, params', CASES)
def test_state_dict_resumes_exactly(name, params):
    opt = two_groups(torch.optim.Adam)
    s = build_scheduler(name, opt, params)
    for _ in range(9): s.step()
    saved = copy.deepcopy(s.state_dict())
    assert saved == {'last_batch_iteration': 8}
    expected = []
    for _ in range(20): s.step(); expected.append(group_values(opt))
    opt2 = two_groups(torch.optim.Adam)
    s2 = build_scheduler(name, opt2, params)
    s2.load_state_dict(saved)
    got = []
    for _ in range(20): s2.step(); got.append(group_values(opt2))
    assert got == expected

@pytest.mark.parametrize('name, params', CASES)
def test_loading_state_sets_the_learning_rates_at_once(name, params):
    opt = two_groups(torch.optim.Adam)
    s = build_scheduler(name, opt, params)
    for _ in range(11): s.step()
    opt2 = two_groups(torch.optim.Adam)
    s2 = build_scheduler(name, opt2, params)
    s2.load_state_dict(s.state_dict())
    assert group_values(opt2) == group_values(opt) and s2.get_last_lr() == s.get_last_lr()

@pytest.mark.parametrize('name, params', CASES)
def test_step_to_a_batch_and_resume_argument(name, params):
    a = build_scheduler(name, two_groups(torch.optim.Adam), params)
    for _ in range(13): a.step()
    b = build_scheduler(name, two_groups(torch.optim.Adam), params)
    b.step(batch_iteration=12)
    c = build_scheduler(name, two_groups(torch.optim.Adam), {**params, 'last_batch_iteration': 12})
    assert a.get_last_lr() == b.get_last_lr() == c.get_last_lr()
    assert group_values(a.optimizer) == group_values(b.optimizer) == group_values(c.optimizer)

def test_torch_scheduler_in_a_training_loop():
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    s = WarmupDecayLR(opt, total_num_steps=10, warmup_num_steps=3)
    assert isinstance(s, LRScheduler) and isinstance(s, BatchLRScheduler)
    with warnings.catch_warnings():
        warnings.simplefilter('error')                      # torch's step-order warnings included
        for _ in range(5):
            model(torch.ones(2, 3)).sum().backward(); opt.step(); opt.zero_grad(); s.step()
    assert s.last_epoch == 5 and s.last_batch_iteration == 4

def test_wrapped_optimizer_and_tensor_lr():
    class Wrapper:                                          # what a ZeRO optimizer looks like to the scheduler
        def __init__(self, optimizer): self.optimizer = optimizer
    inner = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=torch.tensor(0.01))
    s = WarmupLR(Wrapper(inner), warmup_max_lr=0.02, warmup_num_steps=4, warmup_type='linear')
    lr_tensor = inner.param_groups[0]['lr']
    for _ in range(2): s.step()
    assert inner.param_groups[0]['lr'] is lr_tensor and lr_tensor.item() == pytest.approx(0.02 * 0.25)
    assert s.get_last_lr() == [pytest.approx(0.005)]
    with pytest.raises(TypeError, match='needs a torch.optim.Optimizer'): WarmupLR(object())

# ---------------------------------------------------------------- build_scheduler and bad parameters

def test_build_scheduler_resolves_case_insensitively():
    for name, cls in SCHEDULERS.items():
        params = dict(CASES)[name]
        for spelling in (name, name.lower(), name.upper()):
            assert type(build_scheduler(spelling, two_groups(torch.optim.Adam), params)) is cls

@pytest.mark.parametrize('type_name, params, error, match', [
    ('WarmupCosine', {}, ValueError, r"unknown scheduler type 'WarmupCosine' \(did you mean 'WarmupCosineLR'\?\)"),
    ('onecycl', {}, ValueError, r"did you mean 'OneCycle'"),
    ('StepLR', {}, ValueError, r"unknown scheduler type 'StepLR'.*valid types: WarmupLR"),
    (None, {}, TypeError, 'scheduler type must be a string'),
    ('WarmupLR', [('warmup_num_steps', 3)], TypeError, 'scheduler params must be a dict'),
    ('WarmupLR', {'warmup_steps': 10}, ValueError, r"unknown parameter 'warmup_steps' for WarmupLR \(did you mean 'warmup_num_steps'\?\)"),
    ('WarmupDecayLR', {'warmup_num_steps': 10}, ValueError, "WarmupDecayLR needs 'total_num_steps'"),
    ('WarmupDecayLR', {'total_num_steps': 5, 'warmup_num_steps': 10}, ValueError, 'total_num_steps=5 is less than warmup_num_steps=10'),
    ('WarmupCosineLR', {'total_num_steps': 5, 'warmup_num_steps': 10}, ValueError, 'total_num_steps=5 is less than warmup_num_steps=10'),
    ('WarmupCosineLR', {'total_num_steps': 50, 'warmup_num_steps': 5, 'cos_min_ratio': 2.0}, ValueError, r'cos_min_ratio is a fraction of the learning rate, in \[0, 1\]'),
    ('WarmupLR', {'warmup_num_steps': 0}, ValueError, 'warmup_num_steps must be a positive int, got 0'),
    ('WarmupLR', {'warmup_num_steps': 10.5}, ValueError, 'warmup_num_steps must be a positive int, got 10.5'),
    ('WarmupLR', {'warmup_num_steps': None}, ValueError, r'warmup_num_steps must be a positive int, got None \(leave it out'),
    ('WarmupDecayLR', {'total_num_steps': 10, 'warmup_num_steps': None}, ValueError, 'warmup_num_steps must be a positive int, got None'),
    ('WarmupCosineLR', {'total_num_steps': 10, 'warmup_num_steps': None}, ValueError, 'warmup_num_steps must be a positive int, got None'),
    ('OneCycle', {'cycle_min_lr': 0.1, 'cycle_max_lr': 1, 'cycle_second_step_size': -1}, ValueError, 'cycle_second_step_size must be a finite number >= 0'),
    ('WarmupLR', {'warmup_max_lr': [0.1, 0.2, 0.3]}, ValueError, 'warmup_max_lr has 3 values but the optimizer has 2 param groups'),
    ('WarmupLR', {'warmup_min_lr': -0.1}, ValueError, 'warmup_min_lr must be a finite number >= 0'),
    ('WarmupLR', {'warmup_max_lr': 'high'}, TypeError, 'warmup_max_lr must be a number'),
    ('OneCycle', {'cycle_min_lr': 0.1}, ValueError, "OneCycle needs 'cycle_max_lr'"),
    ('OneCycle', {'cycle_min_lr': 0.5, 'cycle_max_lr': 0.1}, ValueError, r'cycle_min_lr=\[0.5, 0.5\] must not exceed cycle_max_lr'),
    ('OneCycle', {'cycle_min_lr': 0.1, 'cycle_max_lr': 1, 'cycle_first_step_size': 0}, ValueError, 'cycle_first_step_size must be > 0'),
    ('OneCycle', {'cycle_min_lr': 0.1, 'cycle_max_lr': 1, 'cycle_first_stair_count': -1}, ValueError, 'cycle_first_stair_count'),
    ('OneCycle', {'cycle_min_lr': 0.1, 'cycle_max_lr': 1, 'cycle_max_mom': 1.2}, ValueError, 'cycle_max_mom must be below 1'),
    ('LRRangeTest', {'lr_range_test_step_size': 0}, ValueError, 'lr_range_test_step_size must be > 0'),
    ('LRRangeTest', {'lr_range_test_staircase': 'yes'}, TypeError, 'lr_range_test_staircase must be True or False'),
    ('LRRangeTest', {'last_batch_iteration': -3}, ValueError, 'last_batch_iteration must be a finite number >= -1'),
])
def test_bad_scheduler_configs(type_name, params, error, match):
    with pytest.raises(error, match=match): build_scheduler(type_name, two_groups(torch.optim.Adam), params)

def test_bad_state():
    s = WarmupLR(two_groups(), warmup_num_steps=3)
    with pytest.raises(ValueError, match="needs 'last_batch_iteration'"): s.load_state_dict({'last_epoch': 2})
