"""flexrt.precision: loss-scaling sequences, state round trips, bf16/fp16 master weights, overflow agreement on 2 gloo ranks."""
import copy, math, warnings
import pytest
import torch
from helpers import run_distributed
from flexrt.precision.loss_scaler import DynamicLossScaler, StaticLossScaler, make_loss_scaler
from flexrt.precision import MasterWeights, ModelWeights, Precision


# ---------------------------------------------------------------- loss scalers

def reference_scales(flags, init, factor, window, min_scale, hysteresis, consecutive):
    "The scale after each step, written from DeepSpeed's documented rules as an explicit simulation"
    scale, left, clean_before, out = init, hysteresis, 0, []
    for overflow in flags:
        if overflow:
            clean_before = 0
            if left > 1: left -= 1
            else: scale = max(scale / factor, min_scale)
        else:
            if consecutive: left = hysteresis
            if clean_before and clean_before % window == 0: scale, left = scale * factor, hysteresis
            clean_before += 1
        out.append(scale)
    return out

def scales(scaler, flags):
    out = []
    for f in flags: scaler.update(f); out.append(scaler.loss_scale)
    return out

def test_overflow_halves_once_hysteresis_runs_out():
    s = DynamicLossScaler(init_scale=2.**10, scale_window=100, delayed_shift=3)
    # overflow at steps 2, 4, 5: the first two spend the hysteresis, the third halves; later ones halve each time
    got = scales(s, [False, False, True, False, True, True, True, False])
    assert got == [1024., 1024., 1024., 1024., 1024., 512., 256., 256.]
    assert s.cur_hysteresis == 1

def test_grows_after_each_clean_window_counted_from_the_last_overflow():
    "As DeepSpeed's fp16 optimizers: the clean step that follows `scale_window` clean ones (or a multiple) grows the scale"
    s = DynamicLossScaler(init_scale=8., scale_window=3)
    assert scales(s, [False] * 7) == [8., 8., 8., 16., 16., 16., 32.]
    assert scales(s, [True, False, False, False, False]) == [16., 16., 16., 16., 32.]

def test_window_refills_hysteresis():
    s = DynamicLossScaler(init_scale=8., scale_window=2, delayed_shift=2)
    assert scales(s, [True, False, False, False, True, True]) == [8., 8., 8., 16., 16., 8.]

def test_consecutive_hysteresis_refill():
    flags = [True, False, True, False, True]            # never two overflows in a row
    plain = DynamicLossScaler(init_scale=64., scale_window=1000, delayed_shift=2)
    consec = DynamicLossScaler(init_scale=64., scale_window=1000, delayed_shift=2, consecutive_hysteresis=True)
    assert scales(plain, flags) == [64., 64., 32., 32., 16.]
    assert scales(consec, flags) == [64.] * 5
    consec = DynamicLossScaler(init_scale=64., scale_window=1000, delayed_shift=2, consecutive_hysteresis=True)
    assert scales(consec, [True, True, True]) == [64., 32., 16.]   # overflows in a row still lower the scale

def test_min_scale_clamp_and_raise():
    s = DynamicLossScaler(init_scale=8., min_scale=3., scale_window=1000)
    assert scales(s, [True, True, True]) == [4., 3., 3.]    # never below min_scale, and no error by default
    s = DynamicLossScaler(init_scale=4., min_scale=2., raise_error_at_min_scale=True)
    s.update(True)
    assert s.loss_scale == 2.
    with pytest.raises(RuntimeError, match='already at minimum'):
        s.update(True)

@pytest.mark.parametrize('seed', [0, 1, 2])
def test_random_sequences_match_the_reference_rules(seed):
    g = torch.Generator().manual_seed(seed)
    flags = (torch.rand(300, generator=g) < 0.15).tolist()
    for hysteresis in (1, 2, 4):
        for consecutive in (False, True):
            s = DynamicLossScaler(init_scale=2.**12, scale_window=7, min_scale=2., delayed_shift=hysteresis,
                                  consecutive_hysteresis=consecutive)
            assert scales(s, flags) == reference_scales(flags, 2.**12, 2., 7, 2., hysteresis, consecutive)

def test_state_round_trip_resumes_exactly():
    g = torch.Generator().manual_seed(3)
    flags = (torch.rand(200, generator=g) < 0.2).tolist()
    kw = dict(init_scale=2.**8, scale_window=5, delayed_shift=2)
    a = DynamicLossScaler(**kw)
    scales(a, flags[:90])
    b = DynamicLossScaler(**kw)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    assert scales(b, flags[90:]) == scales(a, flags[90:])
    assert b.state_dict() == a.state_dict()

@pytest.mark.parametrize('kwargs, error, match', [
    (dict(init_scale=0), ValueError, 'init_scale must be a finite number > 0'),
    (dict(init_scale='big'), TypeError, 'init_scale must be a number'),
    (dict(scale_factor=0.5), ValueError, 'scale_factor'),
    (dict(scale_window=0), ValueError, 'scale_window'),
    (dict(scale_window=2.5), TypeError, 'scale_window must be an int'),
    (dict(delayed_shift=0), ValueError, 'delayed_shift'),
    (dict(min_scale=-1), ValueError, 'min_scale'),
    (dict(init_scale=1., min_scale=4.), ValueError, 'below min_scale'),
])
def test_bad_scaler_arguments(kwargs, error, match):
    with pytest.raises(error, match=match): DynamicLossScaler(**kwargs)

def test_make_loss_scaler_from_deepspeed_keys():
    s = make_loss_scaler(loss_scale=0, initial_scale_power=5, loss_scale_window=3, hysteresis=2, min_loss_scale=4.)
    assert isinstance(s, DynamicLossScaler) and s.loss_scale == 32. and s.delayed_shift == 2
    assert scales(s, [True, True, True, True]) == [32., 16., 8., 4.]
    static = make_loss_scaler(loss_scale=128.)
    assert isinstance(static, StaticLossScaler) and not static.dynamic
    assert scales(static, [True, False]) == [128., 128.]
    with pytest.raises(ValueError, match='initial_scale_power'): make_loss_scaler(initial_scale_power=200)
    with pytest.raises(ValueError, match='loss_scale'): make_loss_scaler(loss_scale=-2)


# ---------------------------------------------------------------- master weights and the training step

def tiny_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 1))

def train(precision, steps, model=None, opt=None, weights=None, flat=False, seed=0, data_seed=1):
    "The engine's step sequence; returns (losses, model, opt, weights)"
    if model is None:
        model = tiny_model(seed)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        weights = precision.setup(model, opt, flat=flat)
    g = torch.Generator().manual_seed(data_seed)
    x, y = torch.randn(32, 6, generator=g), torch.randn(32, 1, generator=g)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x.to(precision.dtype)).float(), y)
        precision.backward(loss)
        losses.append(loss.item())
        if not precision.unscale_and_check(weights.collect_grads()):
            opt.step(); weights.copy_to_model()
        weights.zero_grad()
    return losses, model, opt, weights

def test_bf16_master_weights_track_fp32():
    fp32, m32, _, _ = train(Precision.fp32(), 40)
    bf16, mbf, _, w = train(Precision.bf16(), 40)
    assert fp32[-1] < 0.7 * fp32[0]
    assert all(p.dtype == torch.bfloat16 for p in mbf.parameters())
    assert all(m.dtype == torch.float32 for m in w.params)
    for a, b in zip(fp32, bf16): assert abs(a - b) <= 0.02 * abs(a) + 1e-3
    for p32, master in zip(m32.parameters(), w.params):
        torch.testing.assert_close(master, p32.detach(), atol=0.03, rtol=0.03)

def test_flat_and_per_parameter_masters_train_identically():
    a, ma, _, wa = train(Precision.bf16(), 10, flat=False)
    b, mb, _, wb = train(Precision.bf16(), 10, flat=True)
    assert a == b
    for x, y in zip(ma.parameters(), mb.parameters()): assert torch.equal(x, y)
    assert len(wb.params) == 1 and wb.params[0].numel() == sum(p.numel() for p in mb.parameters())

def test_masters_keep_updates_that_bf16_rounds_away():
    lin = torch.nn.Linear(1, 1, bias=False); torch.nn.init.ones_(lin.weight)
    opt = torch.optim.SGD(lin.parameters(), lr=2e-4)
    p = Precision.bf16(); w = p.setup(lin, opt)
    for _ in range(50):
        p.backward(lin(torch.ones(1, 1, dtype=torch.bfloat16)).float().sum())
        assert not p.unscale_and_check(w.collect_grads())
        opt.step(); w.copy_to_model(); w.zero_grad()
    assert abs(w.params[0].item() - 0.99) < 1e-5
    assert lin.weight.item() == torch.tensor(w.params[0].item()).bfloat16().item() != 1.0

def test_unused_parameter_keeps_no_gradient():
    model = torch.nn.ModuleDict(dict(used=torch.nn.Linear(2, 1), unused=torch.nn.Linear(2, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    p = Precision.bf16(); w = p.setup(model, opt)
    before = [m.detach().clone() for m in w.params]
    p.backward(model['used'](torch.ones(1, 2, dtype=torch.bfloat16)).float().sum())
    grads = w.collect_grads()
    assert len(grads) == 2 and not p.unscale_and_check(grads)
    opt.step(); w.copy_to_model()
    changed = [not torch.equal(a, m.detach()) for a, m in zip(before, w.params)]
    assert changed == [True, True, False, False]

def test_optimizer_state_moves_to_the_masters():
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward(); opt.step(); opt.zero_grad()
    exp_avg = opt.state[model.weight]['exp_avg'].clone()
    w = MasterWeights(opt)
    assert torch.equal(opt.state[w.params[0]]['exp_avg'], exp_avg) and model.weight not in opt.state
    opt2 = torch.optim.Adam(torch.nn.Linear(3, 1).parameters(), lr=0.1)
    for q in opt2.param_groups[0]['params']: q.grad = torch.ones_like(q)
    opt2.step()
    with pytest.raises(ValueError, match='flat master weights cannot take over'): MasterWeights(opt2, flat=True)

def test_fp16_static_scale_scales_gradients():
    torch.manual_seed(0)
    model, x = torch.nn.Linear(4, 2), torch.randn(8, 4)
    ref = copy.deepcopy(model); torch.nn.functional.mse_loss(ref(x), torch.zeros(8, 2)).backward()
    p = Precision.fp16(loss_scale=256.)
    w = p.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    p.backward(torch.nn.functional.mse_loss(model(x.half()).float(), torch.zeros(8, 2)))
    torch.testing.assert_close(model.weight.grad.float() / 256., ref.weight.grad, atol=2e-3, rtol=1e-2)
    grads = w.collect_grads()
    assert not p.unscale_and_check(grads)
    torch.testing.assert_close(grads[0], ref.weight.grad, atol=2e-3, rtol=1e-2)
    model.weight.grad[0, 0] = math.nan
    assert p.unscale_and_check(w.collect_grads())
    assert p.loss_scale == 256.                             # a static scale skips the step but never changes

def test_fp32_never_checks_and_never_scales():
    model = torch.nn.Linear(2, 1)
    p = Precision.fp32(); w = p.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert isinstance(w, ModelWeights) and model.weight.dtype == torch.float32
    p.backward(model(torch.ones(1, 2)).sum())
    model.weight.grad[0, 0] = math.inf
    assert p.unscale_and_check(w.collect_grads()) is False
    assert model.weight.grad[0, 0].item() == math.inf        # untouched: fp32 has no scale to remove

def test_precision_and_master_state_resume_exactly():
    "fp16 with scripted overflows: save after 4 steps, continue; a fresh run loaded from the save continues identically"
    kw = dict(initial_scale_power=6, loss_scale_window=3, hysteresis=2)
    def run(p, model, opt, w, steps, inject):
        g = torch.Generator().manual_seed(5)
        x, y = torch.randn(16, 6, generator=g), torch.randn(16, 1, generator=g)
        for i in range(steps):
            p.backward(torch.nn.functional.mse_loss(model(x.half()).float(), y))
            if i in inject: model[0].weight.grad[0, 0] = math.inf
            if not p.unscale_and_check(w.collect_grads()): opt.step(); w.copy_to_model()
            w.zero_grad()
    def fresh():
        model = tiny_model(0); opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        p = Precision.fp16(**kw); return p, model, opt, p.setup(model, opt)
    p, model, opt, w = fresh()
    run(p, model, opt, w, 4, inject={1, 2})
    saved = copy.deepcopy(dict(precision=p.state_dict(), weights=w.state_dict(), optimizer=opt.state_dict()))
    run(p, model, opt, w, 6, inject={3})
    p2, model2, opt2, w2 = fresh()
    p2.load_state_dict(saved['precision']); w2.load_state_dict(saved['weights']); opt2.load_state_dict(saved['optimizer'])
    run(p2, model2, opt2, w2, 6, inject={3})
    assert p2.loss_scaler.state_dict() == p.loss_scaler.state_dict()
    for a, b in zip(w.params, w2.params): assert torch.equal(a, b)
    for a, b in zip(model.parameters(), model2.parameters()): assert torch.equal(a, b)

def test_from_config_blocks():
    p = Precision.from_config(fp16=dict(enabled=True, loss_scale=0, initial_scale_power=16, loss_scale_window=500,
                                        hysteresis=2, consecutive_hysteresis=True, min_loss_scale=1, auto_cast=True))
    assert (p.name, p.loss_scale, p.auto_cast, p.loss_scaler.scale_window, p.loss_scaler.consecutive_hysteresis) == \
        ('fp16', 65536., True, 500, True)
    assert Precision.from_config(bf16=dict(enabled=True, check_grad_overflow=True)).check_overflow
    assert Precision.from_config().name == 'fp32'
    with pytest.raises(ValueError, match='both enabled'):
        Precision.from_config(fp16=dict(enabled=True), bf16=dict(enabled=True))
    with pytest.raises(TypeError, match='bogus'): Precision.from_config(fp16=dict(enabled=True, bogus=1))
    with pytest.raises(ValueError, match='dtype must be one of'): Precision('int8')


# ---------------------------------------------------------------- two gloo ranks

def _overflow_rank(rank, world_size, bad_rank, bad_value):
    "Same model and batch on both ranks; `bad_rank` gets one non-finite gradient element"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    p = Precision.fp16(initial_scale_power=8, hysteresis=1, loss_scale_window=1000)
    w = p.setup(model, opt)
    x = torch.randn(16, 4)
    start_model = [q.detach().clone() for q in model.parameters()]
    start_master = [m.detach().clone() for m in w.params]
    out = {}
    p.backward(model(x.half()).float().pow(2).mean())
    if rank == bad_rank: model[2].weight.grad[0, 3] = bad_value
    out['overflow'] = p.unscale_and_check(w.collect_grads())
    if not out['overflow']: opt.step(); w.copy_to_model()
    w.zero_grad()
    out['scale'] = p.loss_scale
    out['model_unchanged'] = all(torch.equal(a, b.detach()) for a, b in zip(start_model, model.parameters()))
    out['master_unchanged'] = all(torch.equal(a, b.detach()) for a, b in zip(start_master, w.params))
    # a clean step afterwards goes through on both ranks, with the same result
    p.backward(model(x.half()).float().pow(2).mean())
    out['second_overflow'] = p.unscale_and_check(w.collect_grads())
    if not out['second_overflow']: opt.step(); w.copy_to_model()
    out['moved'] = not all(torch.equal(a, b.detach()) for a, b in zip(start_model, model.parameters()))
    out['params'] = [q.detach().float().tolist() for q in model.parameters()]   # plain lists travel safely between processes
    return out

@pytest.mark.parametrize('bad_rank, bad_value', [(1, math.inf), (0, math.nan)])
def test_inf_on_one_rank_skips_the_step_on_every_rank(bad_rank, bad_value):
    results = run_distributed(_overflow_rank, world_size=2, args=(bad_rank, bad_value))
    for r in results:
        assert r['overflow'] is True
        assert r['scale'] == 128.                                  # 2**8 halved (hysteresis 1)
        assert r['model_unchanged'] and r['master_unchanged']
        assert r['second_overflow'] is False and r['moved']
    assert results[0]['params'] == results[1]['params']


# ---------------------------------------------------------------- MoE: expert marks travel with the masters

class _DenseAndExpert(torch.nn.Module):
    "A dense layer identical on every rank and an expert layer of its own per rank, with separate losses"
    def __init__(self, rank):
        super().__init__()
        torch.manual_seed(0); self.dense = torch.nn.Linear(6, 3)
        torch.manual_seed(100 + rank); self.expert = torch.nn.Linear(6, 3)
        with torch.no_grad(): self.expert.weight.mul_(4.)
        for p in self.expert.parameters(): p.allreduce, p.group_name = False, 'experts'
    def loss(self, dtype):
        g = torch.Generator().manual_seed(7)
        x, y = torch.randn(8, 6, generator=g).to(dtype), torch.randn(8, 3, generator=g)
        return torch.nn.functional.mse_loss(self.dense(x).float(), y) + torch.nn.functional.mse_loss(self.expert(x).float(), y)

def _moe_norm_rank(rank, world):
    "Global grad norm over the weights the optimizer steps: fp32 (model's own), bf16 per-parameter and flat masters"
    from flexrt.utils import clip_grad_norm_
    norms = {}
    for name, precision, flat in (('fp32', Precision.fp32(), False), ('bf16', Precision.bf16(), False),
                                  ('bf16 flat', Precision.bf16(), True)):
        model = _DenseAndExpert(rank)
        w = precision.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), flat=flat)
        precision.backward(model.loss(precision.dtype))
        w.collect_grads()
        norms[name] = float(clip_grad_norm_(w.params, math.inf, expert_groups={'experts': None}))
        if flat: norms['flat buffers'] = [(getattr(m, 'allreduce', True), m.numel()) for m in w.params]
    return norms

def test_bf16_moe_norm_matches_fp32_with_flat_and_per_parameter_masters():
    local = []                                    # every rank's fp32 gradients, computed here
    for r in range(2):
        m = _DenseAndExpert(r); m.loss(torch.float32).backward()
        local.append(([p.grad for p in m.dense.parameters()], [p.grad for p in m.expert.parameters()]))
    sq = lambda gs: sum(float(g.pow(2).sum()) for g in gs)
    expected = math.sqrt(sq(local[0][0]) + sq(local[0][1]) + sq(local[1][1]))   # dense once, each expert once
    unmarked = [math.sqrt(sq(d) + sq(e)) for d, e in local]                   # what a master without marks gives
    assert all(abs(u - expected) > 0.1 * expected for u in unmarked)          # so the check below can fail
    for norms in run_distributed(_moe_norm_rank, 2):
        assert norms['fp32'] == pytest.approx(expected, rel=1e-5)
        assert norms['bf16'] == pytest.approx(expected, rel=2e-2)
        assert norms['bf16 flat'] == pytest.approx(norms['bf16'], rel=1e-6)
        assert norms['flat buffers'] == [(True, 6 * 3 + 3), (False, 6 * 3 + 3)]   # dense and expert never share one


# ---------------------------------------------------------------- a run of skipped steps is reported

@pytest.mark.parametrize('fp16', [{'enabled': True, 'loss_scale': 32768}, {'enabled': True, 'initial_scale_power': 8, 'hysteresis': 1}],
                         ids=['static', 'dynamic'])
def test_an_engine_warns_once_when_every_step_is_skipped(fp16):
    "Non-finite data makes every step overflow: after SKIPPED_STEPS_WARNING of them in a row, one warning, at any scale"
    import flexrt
    from flexrt.precision.loss_scaler import SKIPPED_STEPS_WARNING
    torch.manual_seed(0)
    engine = flexrt.initialize(model=torch.nn.Linear(4, 2), config={'train_batch_size': 2, 'steps_per_print': 10**6, 'fp16': fp16,
                                                                    'optimizer': {'type': 'SGD', 'params': {'lr': 0.1}}})[0]
    before = [p.detach().clone() for p in engine.module.parameters()]
    bad = torch.full((2, 4), math.inf)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        for _ in range(SKIPPED_STEPS_WARNING + 5):
            engine.backward(engine(bad.half()).float().sum()); engine.step()
    skipped = [str(x.message) for x in w if 'in a row were skipped' in str(x.message)]
    assert len(skipped) == 1 and skipped[0].startswith(f"{SKIPPED_STEPS_WARNING} optimizer steps in a row were skipped"), skipped
    assert engine.skipped_steps == SKIPPED_STEPS_WARNING + 5
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, engine.module.parameters()))
    engine.close()
