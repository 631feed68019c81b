"""flexrt.utils.grads: norms and clipping against torch on one process, and on real 2- and 4-rank gloo groups
against a single-process reference over the full set of distinct tensors (model-parallel pieces, replicas,
expert parameters); overflow agreement across ranks; bad input."""
import math
import pytest, torch
from helpers import run_distributed
from flexrt import comm as dist
from flexrt.utils import (clip_grad_norm_, get_grad_norm, get_weight_norm, get_grad_zeros, get_global_norm,
                          get_global_norm_of_tensors, clip_tensors_by_global_norm, CheckOverflow)

NORMS = (1.0, 2.0, math.inf)

def _model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(20, 40), torch.nn.GELU(), torch.nn.Linear(40, 40), torch.nn.Linear(40, 3)).to(dtype)
    m(torch.randn(16, 20, dtype=dtype)).pow(2).mean().backward()
    return m

def _grads(m): return [p.grad.clone() for p in m.parameters()]

# ---------------------------------------------------------------- one process, against torch
@pytest.mark.parametrize('p', NORMS)
@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
def test_clip_matches_torch_bitwise(p, dtype):
    ours, theirs = _model(dtype=dtype), _model(dtype=dtype)
    total = clip_grad_norm_(ours.parameters(), 1e-3, p)
    ref = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 1e-3, p)
    assert total.dim() == 0 and total.dtype == ref.dtype and torch.equal(total, ref) and ref > 1e-3
    for a, b in zip(ours.parameters(), theirs.parameters()): assert torch.equal(a.grad, b.grad)

@pytest.mark.parametrize('p', NORMS)
def test_norms_match_get_total_norm(p):
    m = _model(1)
    ref = torch.nn.utils.get_total_norm([q.grad for q in m.parameters()], p)
    assert torch.equal(clip_grad_norm_(m.parameters(), math.inf, p), ref)   # inf max_norm: never clips
    assert get_grad_norm(m.parameters(), p) == pytest.approx(ref.item(), rel=1e-6)
    assert get_global_norm_of_tensors([q.grad for q in m.parameters()], p) == pytest.approx(ref.item(), rel=1e-6)
    wref = torch.nn.utils.get_total_norm([q.detach() for q in m.parameters()], p).item()
    assert get_weight_norm(m.parameters(), p) == pytest.approx(wref, rel=1e-6)

def test_below_max_norm_is_bit_identical():
    m = _model(2)
    before = _grads(m)
    total = torch.nn.utils.get_total_norm(before).item()
    for max_norm in (total * 10, math.nextafter(total, math.inf), total):   # well below, a hair below, equal
        clip_grad_norm_(m.parameters(), max_norm)
        for g, b in zip(_grads(m), before): assert torch.equal(g, b)
    tm = _model(2); torch.nn.utils.clip_grad_norm_(tm.parameters(), total + 1e-7)   # torch rescales just below...
    assert any(not torch.equal(q.grad, b) for q, b in zip(tm.parameters(), before))  # ...flexrt does not
    fm = _model(2); clip_grad_norm_(fm.parameters(), total + 1e-7)
    assert all(torch.equal(q.grad, b) for q, b in zip(fm.parameters(), before))

@pytest.mark.parametrize('bad', [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize('p', NORMS)
def test_non_finite_reported_and_grads_untouched(bad, p):
    m = _model(3)
    next(m.parameters()).grad[0, 0] = bad
    before = _grads(m)
    total = clip_grad_norm_(m.parameters(), 1e-3, p)
    assert not torch.isfinite(total)
    if math.isnan(bad): assert total.isnan()
    for g, b in zip(_grads(m), before): assert torch.equal(g.nan_to_num(7.), b.nan_to_num(7.))
    assert get_grad_norm(m.parameters(), p) == -1 and get_global_norm_of_tensors(before, p) == -1
    assert clip_tensors_by_global_norm(before, 1e-3) == -1
    with pytest.raises(RuntimeError, match='non-finite and were not clipped'):
        clip_grad_norm_(m.parameters(), 1e-3, p, error_if_nonfinite=True)

def test_fp16_norm_does_not_overflow():
    h = torch.nn.Parameter(torch.zeros(4096, dtype=torch.float16)); h.grad = torch.full_like(h, 2048.)
    ref = 2048. * 64
    assert torch.nn.utils.get_total_norm([h.grad]).isinf()            # torch accumulates in fp16
    assert clip_grad_norm_([h], math.inf).item() == pytest.approx(ref)
    clip_grad_norm_([h], 1.0)
    assert torch.linalg.vector_norm(h.grad.float()).item() == pytest.approx(1.0, rel=1e-3)

def test_clip_tensors_by_global_norm_values():
    ts = [torch.tensor([3.]), torch.tensor([4.])]
    assert clip_tensors_by_global_norm(ts, 1.0) == 5.0
    assert [t.item() for t in ts] == pytest.approx([0.6, 0.8], abs=1e-6)
    assert get_global_norm([3.0, 4.0]) == 5.0 and get_global_norm([1.0, -1]) == math.inf

def test_grad_zeros():
    a = torch.nn.Parameter(torch.ones(5)); a.grad = torch.tensor([0., 1., 0., 2., 0.])
    b = torch.nn.Parameter(torch.ones(2)); b.grad = None
    assert get_grad_zeros([a, b]) == 3

@pytest.mark.parametrize('call, match', [
    (lambda ps: clip_grad_norm_(ps + [torch.nn.Linear(1, 1)], 1.0), r'parameters\[2\] is a Linear'),
    (lambda ps: clip_grad_norm_(ps, -1.0), 'max_norm must be a positive number'),
    (lambda ps: clip_grad_norm_(ps, float('nan')), 'max_norm must be a positive number'),
    (lambda ps: clip_grad_norm_(ps, 1.0, norm_type='nuc'), 'norm_type must be a positive number or inf'),
    (lambda ps: clip_grad_norm_(ps, 1.0, norm_type=0), 'norm_type must be a positive number or inf'),
    (lambda ps: get_grad_norm(ps, norm_type=-2), 'norm_type must be a positive number or inf'),
    (lambda ps: get_global_norm_of_tensors([ps[0].grad, [1.0]]), r'input_tensors\[1\] is a list'),
    (lambda ps: clip_tensors_by_global_norm([ps[0].grad], max_norm=-0.5), 'max_norm must be a positive number'),
    (lambda ps: clip_grad_norm_(42, 1.0), 'must be a tensor or an iterable of tensors'),
])
def test_bad_input(call, match):
    ps = list(_model(4).parameters())[:2]
    with pytest.raises((TypeError, ValueError), match=match): call(ps)

def test_bad_input_error_types():
    ps = list(_model(4).parameters())
    with pytest.raises(TypeError): clip_grad_norm_(ps + ['w'], 1.0)
    with pytest.raises(ValueError): clip_grad_norm_(ps, -1.0)
    with pytest.raises(ValueError): clip_grad_norm_(ps, 1.0, norm_type='abc')

# ---------------------------------------------------------------- several ranks
# Each rank builds the same full set of distinct gradients from seeds, keeps its own pieces, and compares the
# distributed norm with torch's norm of the full set.

def _full(kind, i, shape):
    g = torch.Generator().manual_seed(1000 * kind + i)
    return torch.randn(*shape, generator=g) * (i + 1)

def _param(grad, **flags):
    p = torch.nn.Parameter(torch.zeros_like(grad)); p.grad = grad.clone()
    for k, v in flags.items(): setattr(p, k, v)
    return p

class OldMpu:
    "Old Megatron names only"
    def __init__(self, group): self.group = group
    def get_model_parallel_group(self): return self.group
    def get_model_parallel_rank(self): return dist.get_rank(self.group)
    def get_model_parallel_world_size(self): return dist.get_world_size(self.group)

class NewMpu:
    "New Megatron names only (tensor_model_parallel_*), no world-size method: derived from the group"
    def __init__(self, group): self.group = group
    def get_tensor_model_parallel_group(self): return self.group
    def get_tensor_model_parallel_rank(self): return dist.get_rank(self.group)

def _tp_world(rank, world_size, p, mpu_style):
    "tensor parallelism over all ranks: replicated params + params split along dim 0 (old/new flags)"
    tp = dist.get_world_size()
    replicated = [_full(1, i, (7, 3)) for i in range(3)]
    split = [_full(2, i, (4 * tp, 5)) for i in range(2)]
    reference = torch.nn.utils.get_total_norm(replicated + split, p)
    params = [_param(g) for g in replicated]
    params += [_param(g.chunk(tp)[rank], **{('model_parallel' if i else 'tensor_model_parallel'): True})
               for i, g in enumerate(split)]
    mpu = (OldMpu if mpu_style == 'old' else NewMpu)(None)
    max_norm = reference.item() / 3
    before = get_grad_norm(params, p, mpu=mpu)
    total = clip_grad_norm_(params, max_norm, p, mpu=mpu)
    coef = max_norm / (reference + 1e-6)
    expect = [g * coef for g in replicated] + [(g * coef).chunk(tp)[rank] for g in split]
    clipped_ok = all(torch.allclose(q.grad, e, rtol=1e-5, atol=1e-7) for q, e in zip(params, expect))
    return total.item(), reference.item(), clipped_ok, before, get_grad_norm(params, p, mpu=mpu)

@pytest.mark.parametrize('mpu_style', ['old', 'new'])
@pytest.mark.parametrize('world', [2, 4])
def test_model_parallel_norm_matches_full_reference(world, mpu_style):
    for p in NORMS:
        results = run_distributed(_tp_world, world, args=(p, mpu_style))
        totals = [r[0] for r in results]
        assert len(set(totals)) == 1, f'ranks disagree: {totals}'          # bit-identical on every rank
        assert totals[0] == pytest.approx(results[0][1], rel=1e-6)
        assert all(r[2] for r in results), 'clipped gradients differ from the reference'
        assert all(r[3] == pytest.approx(results[0][1], rel=1e-6) for r in results)
        assert all(r[4] == pytest.approx(results[0][1] / 3, rel=1e-5) for r in results)   # clipped to max_norm

def _tp_ep_4(rank, world_size, p, use_default_key):
    """4 ranks = 2 data-parallel replicas x tensor parallel 2; experts sharded over ep groups {0,2} and {1,3}.
    Dense grads are identical across replicas; rank r holds expert e = r // 2 of each expert kind."""
    tp_rank, replica = rank % 2, rank // 2
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    ep_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp_group, ep_group = tp_groups[replica], ep_groups[tp_rank]
    replicated = [_full(1, i, (6, 2)) for i in range(2)]
    split = [_full(2, 0, (8, 3))]
    experts = [_full(3, e, (5, 4)) for e in range(2)]                 # expert e lives on replica index e
    split_experts = [_full(4, e, (6, 2)) for e in range(2)]           # expert weights also tensor-parallel
    reference = torch.nn.utils.get_total_norm(replicated + split + experts + split_experts, p)
    params = [_param(g) for g in replicated] + [_param(split[0].chunk(2)[tp_rank], tensor_model_parallel=True)]
    name = None if use_default_key else 'ep_size_2'
    params.append(_param(experts[replica], allreduce=False, **({} if name is None else {'group_name': name})))
    params.append(_param(split_experts[replica].chunk(2)[tp_rank], allreduce=False, tensor_model_parallel=True,
                         **({} if name is None else {'group_name': name})))
    mpu = NewMpu(tp_group)
    total = clip_grad_norm_(params, math.inf, p, mpu=mpu, expert_groups={name: ep_group})
    single_group = clip_grad_norm_(params, math.inf, p, mpu=mpu, expert_groups=ep_group)
    try:
        clip_grad_norm_(params, 1.0, p, mpu=mpu); missing = None
    except ValueError as e: missing = str(e)
    return total.item(), single_group.item(), reference.item(), missing

@pytest.mark.parametrize('use_default_key', [False, True])
def test_expert_and_model_parallel_norm_4_ranks(use_default_key):
    for p in NORMS:
        results = run_distributed(_tp_ep_4, 4, args=(p, use_default_key))
        totals = [r[0] for r in results] + [r[1] for r in results]
        assert len(set(totals)) == 1, f'ranks disagree: {totals}'
        assert totals[0] == pytest.approx(results[0][2], rel=1e-6)
        assert all(r[3] and 'no expert_groups given' in r[3] for r in results)

def _one_rank_bad(rank, world_size, bad, p):
    "Only the last rank's model-parallel piece is non-finite; every rank must see it and keep its grads"
    good = _param(_full(5, 0, (4, 4)))
    piece = _full(6, rank, (3,))
    if rank == world_size - 1: piece[1] = bad
    split = _param(piece, tensor_model_parallel=True)
    mpu = OldMpu(None)
    before = [good.grad.clone(), split.grad.clone()]
    total = clip_grad_norm_([good, split], 1e-3, p, mpu=mpu)
    untouched = torch.equal(good.grad, before[0]) and torch.equal(split.grad.nan_to_num(9.), before[1].nan_to_num(9.))
    overflow = CheckOverflow([[good, split]]).check()
    by_norm = CheckOverflow().check_using_norm([get_grad_norm([good, split], p, mpu=mpu)])
    local_only = CheckOverflow().has_overflow_serial([good, split])
    return str(total.item()), untouched, overflow, by_norm, local_only

@pytest.mark.parametrize('bad', [math.inf, math.nan])
@pytest.mark.parametrize('world', [2, 4])
def test_non_finite_on_one_rank_agreed_everywhere(world, bad):
    for p in NORMS:   # inf-norm with nan exercises the MAX reduction, where nan could be lost by operand order
        results = run_distributed(_one_rank_bad, world, args=(bad, p))
        expected = 'nan' if math.isnan(bad) else 'inf'
        assert [r[0] for r in results] == [expected] * world
        assert all(r[1] for r in results), 'a gradient changed although the norm was not finite'
        assert [r[2] for r in results] == [True] * world and [r[3] for r in results] == [True] * world
        assert [r[4] for r in results] == [False] * (world - 1) + [True]     # the local view differs...

def _overflow_clean(rank, world_size):
    p = _param(_full(7, rank, (10,)))
    return CheckOverflow([[p]]).check(), CheckOverflow().check_using_norm([1.0, 2.0])

def test_no_overflow_anywhere():
    assert run_distributed(_overflow_clean, 2) == [(False, False), (False, False)]

def _sharded(rank, world_size, p):
    "ZeRO-style disjoint shards of one flat tensor: sum over the shard group via moe_ep_group"
    full = _full(8, 0, (37,))
    shard = full.tensor_split(world_size)[rank].clone()
    norm = get_global_norm_of_tensors([shard], p, moe_ep_group=None) if world_size == 1 else \
        get_global_norm_of_tensors([shard], p, moe_ep_group=dist.new_group(list(range(world_size))))
    ref = torch.linalg.vector_norm(full, p).item()
    clipped_norm = clip_tensors_by_global_norm([shard], 0.5, global_norm=norm)
    return norm, ref, clipped_norm, shard

def test_sharded_tensor_norm_and_clip():
    for p in NORMS:
        results = run_distributed(_sharded, 4, args=(p,))
        norms = [r[0] for r in results]
        assert len(set(norms)) == 1 and norms[0] == pytest.approx(results[0][1], rel=1e-6)
        full = torch.cat([r[3] for r in results])
        if p == 2.0: assert torch.linalg.vector_norm(full).item() == pytest.approx(0.5, rel=1e-5)

def _zeros_mp(rank, world_size):
    a = _param(torch.tensor([0., 1., 0.]))                         # replicated: counted once
    b = _param(torch.tensor([0., float(rank)]), model_parallel=True)  # rank 0's piece has two zeros
    return get_grad_zeros([a, b], mpu=OldMpu(None))

def test_grad_zeros_model_parallel():
    assert run_distributed(_zeros_mp, 2) == [5, 5]    # 2 (replicated, once) + 2 (rank 0's piece) + 1 (rank 1's)

def _one_rank_without_grads(rank, world_size, p):
    "Rank 1 has no gradients at all (e.g. an empty shard); it must still join the reductions, not hang or differ"
    w = _param(_full(9, 0, (6,)), tensor_model_parallel=True)
    if rank == 1: w.grad = None
    total = clip_grad_norm_([w], math.inf, p, mpu=OldMpu(None))
    return total.item(), torch.linalg.vector_norm(_full(9, 0, (6,)), p).item()

def test_rank_without_gradients_still_reduces():
    for p in NORMS:
        (a, ref), (b, _) = run_distributed(_one_rank_without_grads, 2, args=(p,))
        assert a == b == pytest.approx(ref, rel=1e-6)

def _unused_expert_on_one_rank(rank, world_size, p, single_group):
    """Experts sharded over both ranks; the expert on rank 1 was not used this step, so its grad is None there.
    Rank 1 must still join the expert reduction (no local shortcut) and both ranks get the same norm."""
    dense = [_full(10, i, (5, 3)) for i in range(2)]                    # replicated: identical on both ranks
    expert = _full(11, 0, (4, 4))                                       # only rank 0's expert has a gradient
    reference = torch.nn.utils.get_total_norm(dense + [expert], p)
    params = [_param(g) for g in dense]
    mine = _param(expert if rank == 0 else torch.zeros(4, 4), allreduce=False, group_name='ep_size_2')
    if rank == 1: mine.grad = None
    params.append(mine)
    ep = dist.new_group([0, 1])
    groups = ep if single_group else {'ep_size_2': ep, 'unused_ep': dist.new_group([0, 1]), None: ep}
    total = clip_grad_norm_(params, math.inf, p, expert_groups=groups)
    return total.item(), get_grad_norm(params, p, expert_groups=groups), reference.item()

@pytest.mark.parametrize('single_group', [False, True])
def test_expert_with_grads_on_one_rank_only(single_group):
    for p in NORMS:
        results = run_distributed(_unused_expert_on_one_rank, 2, args=(p, single_group), timeout=60)
        totals = [r[0] for r in results]
        assert totals[0] == totals[1], f'ranks disagree: {totals}'
        assert totals[0] == pytest.approx(results[0][2], rel=1e-6)
        assert [r[1] for r in results] == pytest.approx([results[0][2]] * 2, rel=1e-6)

def _rank_with_no_grads_at_all(rank, world_size, p):
    """Rank 1 has no gradient anywhere (its expert and its tensor-parallel piece were unused). Expert norms,
    model-parallel norms, zero counts and overflow checks must still agree (and not hang) and equal rank 0's alone."""
    split, expert = _full(12, 0, (6,)), _full(13, 0, (3, 2))
    expert[0, 0] = 0.
    w = _param(split, tensor_model_parallel=True)
    e = _param(expert, allreduce=False, group_name='ep_size_2')
    if rank == 1: w.grad = e.grad = None
    w.data.copy_(split * (rank + 1))                                 # rank r's weight piece
    mpu, groups = OldMpu(None), {'ep_size_2': dist.new_group([0, 1])}
    expert_total = clip_grad_norm_([e], math.inf, p, expert_groups=groups).item()
    mp_total = clip_grad_norm_([w], math.inf, p, mpu=mpu).item()
    weights = get_weight_norm([w], p, mpu=mpu)                      # weights exist on both ranks
    zeros = get_grad_zeros([w, e], mpu=mpu)
    if rank == 0: w.grad[2] = math.inf
    overflow = CheckOverflow([[w, e]]).check()
    refs = [torch.linalg.vector_norm(t, p).item() for t in (expert, split, torch.cat([split, 2 * split]))]
    return expert_total, mp_total, refs, weights, zeros, overflow

def test_rank_without_any_gradients_agrees():
    for p in NORMS:
        (e0, m0, refs, w0, z0, o0), (e1, m1, _, w1, z1, o1) = run_distributed(_rank_with_no_grads_at_all, 2, args=(p,), timeout=60)
        assert e0 == e1 == pytest.approx(refs[0], rel=1e-6)
        assert m0 == m1 == pytest.approx(refs[1], rel=1e-6)
        assert w0 == w1 == pytest.approx(refs[2], rel=1e-6)
        assert (z0, z1) == (1, 1) and (o0, o1) == (True, True)
