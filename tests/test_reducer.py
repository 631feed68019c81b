"""flexrt.zero.reducer on real 2- and 4-rank gloo groups: averaged gradients equal a single-process reference (the whole
batch on one process), with several buckets, accumulation (no collective off the boundary, counted by the comms
logger), unused, frozen and tied parameters, expert groups, mixed dtypes, several backward passes per micro-step,
close(); one process: nothing to do; bad input."""
import copy
import pytest, torch
from torch import nn
import torch.nn.functional as F
from helpers import run_distributed
from flexrt import comm as dist
from flexrt.zero.reducer import GradientReducer, plan_buckets

def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))

def _batch(step=0, n=16):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)

def _shard(t, rank, world): return t.chunk(world)[rank]

def _reference_grads(model, loss_fn):
    "Gradients of `loss_fn(model)` on a copy of `model`, in one process"
    ref = copy.deepcopy(model)
    ref.zero_grad(set_to_none=True)
    loss_fn(ref).backward()
    return [p.grad for p in ref.parameters()]

def _all_reduce_count():
    return sum(v['count'] for v in dist.get_comm_stats().get('all_reduce', {}).values())

def _close(a, b, atol=1e-6): return a is not None and torch.allclose(a, b, atol=atol, rtol=1e-5)

# ---------------------------------------------------------------- averaging equals the whole batch on one process
def _rank_average(rank, world, predivide):
    model = _mlp()
    x, y = _batch(n=8 * world)
    ref = _reference_grads(model, lambda m: F.mse_loss(m(x), y))
    dist.configure(enabled=True); dist.reset_log()
    reducer = GradientReducer(model.parameters(), bucket_bytes=300, gradient_predivide_factor=predivide)
    F.mse_loss(model(_shard(x, rank, world)), _shard(y, rank, world)).backward()
    launched_in_backward = all(bk.work is not None for bk in reducer.buckets)
    reducer.wait()
    ok = [_close(p.grad, r) for p, r in zip(model.parameters(), ref)]
    in_buckets = all(p.grad.data_ptr() == v.data_ptr() for bk in reducer.buckets for p, v in zip(bk.params, bk.views))
    flat = reducer.flat_gradients(model.parameters())   # the same gradients as a few flat buffers
    flat_ok = (len(flat) == len(reducer.buckets) and
               torch.allclose(torch.cat(flat).norm(), torch.cat([r.flatten() for r in ref]).norm(), rtol=1e-5)
               and reducer.flat_gradients(list(model.parameters())[1:]) is None)   # buckets hold more than asked
    return len(reducer.buckets), _all_reduce_count(), launched_in_backward, ok, in_buckets and flat_ok

@pytest.mark.parametrize('world,predivide', [(2, 1.0), (4, 1.0), (4, 2.0)])
def test_average_matches_full_batch(world, predivide):
    for num_buckets, count, launched, ok, in_buckets in run_distributed(_rank_average, world, args=(predivide,)):
        assert num_buckets >= 4 and count == num_buckets     # several buckets, one all-reduce each
        assert launched                                     # every bucket started during backward (overlap)
        assert all(ok) and in_buckets

# ---------------------------------------------------------------- accumulation
def _rank_accumulate(rank, world, zero):
    gas, model = 3, _mlp(1)
    reducer = GradientReducer(model.parameters(), bucket_bytes=500)
    dist.configure(enabled=True); dist.reset_log()
    out = []
    for window in range(2):
        batches = [_batch(10 * window + i, n=4 * world) for i in range(gas)]
        ref = _reference_grads(model, lambda m: sum(F.mse_loss(m(x), y) for x, y in batches) / gas)
        for i, (x, y) in enumerate(batches):
            reducer.set_boundary(i == gas - 1)
            (F.mse_loss(model(_shard(x, rank, world)), _shard(y, rank, world)) / gas).backward()
            if i < gas - 1: assert not any(bk.work is not None for bk in reducer.buckets)
        reducer.wait()
        out.append((_all_reduce_count(), all(_close(p.grad, r) for p, r in zip(model.parameters(), ref))))
        reducer.zero_grad() if zero == 'in place' else model.zero_grad(set_to_none=True)
    return len(reducer.buckets), out

@pytest.mark.parametrize('zero', ['in place', 'set_to_none'])
def test_accumulation_communicates_only_at_the_boundary(zero):
    for num_buckets, ((count1, ok1), (count2, ok2)) in run_distributed(_rank_accumulate, 2, args=(zero,)):
        assert num_buckets >= 3
        assert (count1, count2) == (num_buckets, 2 * num_buckets)   # one all-reduce per bucket per window, no more
        assert ok1 and ok2

# ---------------------------------------------------------------- unused, frozen and tied parameters
class Branchy(nn.Module):
    "A branch used only on some ranks; `never` is used by none; the branch is last, so its bucket comes first"
    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.body, self.head = nn.Linear(6, 8), nn.Linear(8, 3)
        self.never = nn.Parameter(torch.randn(3))
        self.branch = nn.Linear(8, 3)
    def forward(self, x, use_branch):
        h = torch.tanh(self.body(x))
        return self.head(h) + self.branch(h) if use_branch else self.head(h)

def _rank_unused(rank, world):
    model, results = Branchy(), []
    reducer = GradientReducer(model.parameters(), bucket_bytes=64)
    dist.configure(enabled=True)
    for step, user in enumerate((0, 1)):              # step 0: only rank 0 uses the branch; step 1: only rank 1
        x, y = _batch(step, n=4 * world)
        def loss(m, r): return F.mse_loss(m(_shard(x, r, world), r == user), _shard(y, r, world))
        ref = _reference_grads(model, lambda m: sum(loss(m, r) for r in range(world)) / world)
        dist.reset_log(); model.zero_grad(set_to_none=True)
        loss(model, rank).backward(); reducer.wait()
        named = dict(model.named_parameters())
        ok = {n: _close(named[n].grad, r) for n, r in zip(named, ref) if n != 'never'}
        results.append((ok, torch.equal(model.never.grad, torch.zeros(3)), _all_reduce_count() == len(reducer.buckets)))
    return results

def test_unused_parameters_reduce_as_zeros_on_every_rank():
    for rank_results in run_distributed(_rank_unused, 2):
        for ok, never_is_zero, one_per_bucket in rank_results:
            assert all(ok.values()), ok
            assert never_is_zero and one_per_bucket

def _rank_frozen_tied(rank, world):
    torch.manual_seed(3)
    emb, mid, frozen = nn.Linear(6, 6, bias=False), nn.Linear(6, 6), nn.Linear(6, 6)
    frozen.requires_grad_(False)
    model = nn.ModuleList([emb, mid, frozen])
    def forward(m, x): return F.linear(m[2](torch.tanh(m[1](m[0](x)))), m[0].weight)   # emb weight used twice (tied)
    x, y = _batch(n=4 * world)
    y = y.repeat(1, 2)
    params = [emb.weight, *mid.parameters(), *frozen.parameters(), emb.weight]        # tied weight listed twice
    ref = _reference_grads(model, lambda m: F.mse_loss(forward(m, x), y))
    reducer = GradientReducer(params, bucket_bytes=100)
    dist.configure(enabled=True); dist.reset_log()
    F.mse_loss(forward(model, _shard(x, rank, world)), _shard(y, rank, world)).backward(); reducer.wait()
    reduced = [p for bk in reducer.buckets for p in bk.params]
    return (len(reduced), all(p.grad is None for p in frozen.parameters()),
            all(_close(p.grad, r) for p, r in zip(model.parameters(), ref) if p.requires_grad),
            _all_reduce_count() == len(reducer.buckets),
            reducer.flat_gradients(params) is not None)   # frozen (no gradient) and the tied duplicate change nothing

def test_frozen_parameters_are_left_out_and_tied_ones_reduced_once():
    for num_reduced, frozen_untouched, ok, one_per_bucket, flat in run_distributed(_rank_frozen_tied, 2):
        assert num_reduced == 3 and frozen_untouched and ok and one_per_bucket and flat

# ---------------------------------------------------------------- expert parameters over their own group
def _moe_model(rank):
    "Dense layers identical everywhere; the expert layer identical within an expert group (rank % 2)"
    torch.manual_seed(0)
    dense, head = nn.Linear(6, 8), nn.Linear(8, 3)
    torch.manual_seed(10 + rank % 2)
    expert = nn.Linear(8, 8)
    for p in expert.parameters(): p.allreduce, p.group_name = False, 'experts'
    return nn.ModuleList([dense, expert, head])

def _moe_loss(m, rank, world):
    x, y = _batch(n=4 * world)
    return F.mse_loss(m[2](torch.tanh(m[1](torch.tanh(m[0](_shard(x, rank, world)))))), _shard(y, rank, world))

def _rank_experts(rank, world, as_dict):
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]          # every rank creates every group
    mine = groups[rank % 2]
    local = []                                                       # every rank's local gradients, in one process
    for r in range(world):
        m = _moe_model(r); _moe_loss(m, r, world).backward()
        local.append([p.grad for p in m.parameters()])
    members = [r for r in range(world) if r % 2 == rank % 2]
    # the gradient of the loss averaged over all ranks: dense grads summed over every rank, expert grads over the
    # ranks of their group, both divided by the data-parallel world size
    ref = [torch.stack([local[r][i] for r in (members if 2 <= i < 4 else range(world))]).sum(0) / world for i in range(6)]
    model = _moe_model(rank)
    with pytest.raises(ValueError, match="no expert_groups given"): GradientReducer(model.parameters())
    with pytest.raises(ValueError, match="no expert group for group_name='experts'"):
        GradientReducer(model.parameters(), expert_groups={'other': mine})
    reducer = GradientReducer(model.parameters(), bucket_bytes=200, expert_groups={'experts': mine} if as_dict else mine)
    _moe_loss(model, rank, world).backward(); reducer.wait()
    sizes = sorted({bk.world_size for bk in reducer.buckets})
    return sizes, [_close(p.grad, r) for p, r in zip(model.parameters(), ref)]

@pytest.mark.parametrize('as_dict', [True, False])
def test_expert_parameters_reduced_within_their_group(as_dict):
    for sizes, ok in run_distributed(_rank_experts, 4, args=(as_dict,)):
        assert sizes == [2, 4] and all(ok), ok

def _rank_expert_alone(rank, world):
    "Each rank holds its own expert (expert groups of one rank): no collective, the local gradient divided by world"
    groups = [dist.new_group([r]) for r in range(world)]
    model = _moe_model(rank)
    ref = []
    for r in range(world):
        m = _moe_model(r); _moe_loss(m, r, world).backward()
        ref.append([p.grad for p in m.parameters()])
    expected = [sum(g[i] for g in ref) / world if i not in (2, 3) else ref[rank][i] / world for i in range(6)]
    dist.configure(enabled=True); dist.reset_log()
    reducer = GradientReducer(model.parameters(), bucket_bytes=1 << 20, expert_groups=groups[rank])
    _moe_loss(model, rank, world).backward(); reducer.wait()
    dense_bytes = sum(p.numel() * 4 for i, p in enumerate(model.parameters()) if i not in (2, 3))
    return sorted(bk.world_size for bk in reducer.buckets), _all_reduce_count(), reducer.comm_bytes == dense_bytes, \
           [_close(p.grad, e) for p, e in zip(model.parameters(), expected)]

def test_expert_group_of_one_rank_is_divided_without_a_collective():
    for sizes, count, comm_bytes_ok, ok in run_distributed(_rank_expert_alone, 2):
        assert sizes == [1, 2] and count == 1 and comm_bytes_ok and all(ok), ok

# ---------------------------------------------------------------- mixed dtypes
class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.a, self.b, self.c = nn.Linear(6, 16).double(), nn.Linear(16, 16), nn.Linear(16, 3).bfloat16()
    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x.double())).float())).bfloat16()).float()

def _rank_mixed(rank, world):
    model = Mixed()
    x, y = _batch(n=4 * world)
    local = []
    for r in range(world):                         # each rank's gradients computed here, averaged in float64
        m = copy.deepcopy(model); F.mse_loss(m(_shard(x, r, world)), _shard(y, r, world)).backward()
        local.append([p.grad.double() for p in m.parameters()])
    ref = [sum(g[i] for g in local) / world for i in range(len(local[0]))]
    reducer = GradientReducer(model.parameters(), bucket_bytes=256)
    F.mse_loss(model(_shard(x, rank, world)), _shard(y, rank, world)).backward(); reducer.wait()
    dtypes = [bk.dtype for bk in reducer.buckets]
    single = all(p.dtype == bk.dtype for bk in reducer.buckets for p in bk.params)
    errors = {str(p.dtype): 0.0 for p in model.parameters()}
    for p, r in zip(model.parameters(), ref):
        errors[str(p.dtype)] = max(errors[str(p.dtype)], float((p.grad.double() - r).abs().max() / r.abs().max()))
    return set(map(str, dtypes)), single, len(dtypes), errors

def test_mixed_dtypes_use_separate_buckets():
    for dtypes, single, num_buckets, errors in run_distributed(_rank_mixed, 2):
        assert dtypes == {'torch.float64', 'torch.float32', 'torch.bfloat16'} and single and num_buckets >= 4
        assert errors['torch.float64'] < 1e-14 and errors['torch.float32'] < 1e-6 and errors['torch.bfloat16'] < 1e-2, errors

# ---------------------------------------------------------------- several backward passes in one micro-step
def _rank_two_backward(rank, world):
    model = _mlp(5)
    x, y = _batch(n=4 * world)
    def losses(m, r):
        out = m(_shard(x, r, world))
        return F.mse_loss(out, _shard(y, r, world)), out.pow(2).mean()
    ref = _reference_grads(model, lambda m: sum(a + b for a, b in (losses(m, r) for r in range(world))) / world)
    reducer = GradientReducer(model.parameters(), bucket_bytes=300)
    dist.configure(enabled=True); dist.reset_log()
    first, second = losses(model, rank)
    reducer.set_boundary(True); first.backward(retain_graph=True)
    reducer.set_boundary(True); second.backward()
    reducer.wait()
    ok = all(_close(p.grad, r) for p, r in zip(model.parameters(), ref))
    rounds = _all_reduce_count() / len(reducer.buckets)
    model.zero_grad()
    first, second = losses(model, rank)
    first.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="already being reduced"): second.backward()
    reducer.close()
    return ok, rounds

def test_second_backward_adds_to_the_average_without_double_counting():
    for ok, rounds in run_distributed(_rank_two_backward, 2):
        assert ok and rounds == 2

# ---------------------------------------------------------------- close
def _rank_close(rank, world):
    model = _mlp(6)
    x, y = _batch(n=4 * world)
    reducer = GradientReducer(model.parameters(), bucket_bytes=300)
    num_buckets = len(reducer.buckets)
    reducer.close(); reducer.close()                        # idempotent
    dist.configure(enabled=True); dist.reset_log()
    F.mse_loss(model(_shard(x, rank, world)), _shard(y, rank, world)).backward(); reducer.wait()
    count = _all_reduce_count()
    local = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    gathered = [torch.zeros_like(local) for _ in range(world)]
    dist.configure(enabled=False); dist.all_gather(gathered, local)
    again = GradientReducer(model.parameters(), bucket_bytes=300)   # a new reducer on the same model works
    model.zero_grad(); F.mse_loss(model(_shard(x, rank, world)), _shard(y, rank, world)).backward(); again.wait()
    ref = _reference_grads(_mlp(6), lambda m: F.mse_loss(m(x), y))
    return num_buckets, count, not torch.equal(*gathered), all(_close(p.grad, r) for p, r in zip(model.parameters(), ref))

def test_close_removes_the_hooks():
    for num_buckets, count, grads_differ, rebuilt_ok in run_distributed(_rank_close, 2):
        assert num_buckets >= 3 and count == 0 and grads_differ and rebuilt_ok

# ---------------------------------------------------------------- one process; bad input
def test_one_process_does_nothing():
    model = _mlp()
    expert = nn.Parameter(torch.ones(3)); expert.allreduce = False
    reducer = GradientReducer([*model.parameters(), expert], bucket_bytes=64)
    assert reducer.buckets == []
    x, y = _batch()
    F.mse_loss(model(x), y).backward()
    before = [p.grad.clone() for p in model.parameters()]
    reducer.set_boundary(True); reducer.wait(); reducer.close()
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))

@pytest.mark.parametrize('kwargs,error,match', [
    (dict(bucket_bytes=0), ValueError, 'bucket_bytes must be a positive integer'),
    (dict(bucket_bytes=1.5), ValueError, 'bucket_bytes must be a positive integer'),
    (dict(bucket_bytes=True), ValueError, 'bucket_bytes must be a positive integer'),
    (dict(gradient_predivide_factor=0), ValueError, 'gradient_predivide_factor must be a number > 0'),
    (dict(gradient_predivide_factor='2'), ValueError, 'gradient_predivide_factor must be a number > 0'),
    (dict(first_bucket_bytes=0), ValueError, 'first_bucket_bytes must be a positive integer'),
    (dict(first_bucket_bytes=None), ValueError, 'first_bucket_bytes must be a positive integer'),
])
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match): GradientReducer(_mlp().parameters(), **kwargs)

def test_bad_parameters():
    w = nn.Parameter(torch.ones(2))
    with pytest.raises(TypeError, match=r"params\[1\] is a str"): GradientReducer([w, 'w'])
    with pytest.raises(ValueError, match=r"params\[0\] is not a leaf"): GradientReducer([w * 2])

def test_plan_buckets_bounds_bytes_and_keeps_order():
    params = [nn.Parameter(torch.zeros(n)) for n in (3, 5, 2, 9, 1, 4)]
    buckets = plan_buckets(params, bucket_bytes=8 * 4)
    assert [[p.numel() for p in bk.params] for bk in buckets] == [[3, 5], [2], [9], [1, 4]]
    assert [id(p) for bk in buckets for p in bk.params] == [id(p) for p in params]
    padded = plan_buckets(params, bucket_bytes=8 * 4, align=4)
    assert [bk.buffer.numel() for bk in padded] == [8, 4, 12, 8]

def test_plan_buckets_small_first_bucket():
    params = [nn.Parameter(torch.zeros(n)) for n in (3, 5, 2, 9, 1, 4)]
    buckets = plan_buckets(params, bucket_bytes=8 * 4, first_bucket_bytes=3 * 4)
    assert [[p.numel() for p in bk.params] for bk in buckets] == [[3], [5, 2], [9], [1, 4]]
    larger = plan_buckets(params, bucket_bytes=8 * 4, first_bucket_bytes=10 ** 6)   # never above bucket_bytes
    assert [[p.numel() for p in bk.params] for bk in larger] == [[3, 5], [2], [9], [1, 4]]
    mixed = [nn.Parameter(torch.zeros(4, dtype=dt)) for dt in (torch.float32, torch.float64) * 3]
    per_kind = plan_buckets(mixed, bucket_bytes=1024, first_bucket_bytes=4 * 4)   # a small first bucket per dtype
    assert [(bk.dtype, len(bk.params)) for bk in per_kind] == [(torch.float32, 1), (torch.float64, 1),
                                                                (torch.float32, 2), (torch.float64, 2)]

def _rank_default_buckets(rank, world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 4))   # 1 MiB of weights in front
    x, y = torch.randn(8 * world, 512), torch.randn(8 * world, 4)
    ref = _reference_grads(model, lambda m: F.mse_loss(m(x), y))
    reducer = GradientReducer(model.parameters())   # defaults: a 1 MiB first bucket, then 25 MiB ones
    F.mse_loss(model(_shard(x, rank, world)), _shard(y, rank, world)).backward(); reducer.wait()
    return [len(bk.params) for bk in reducer.buckets], all(_close(p.grad, r) for p, r in zip(model.parameters(), ref))

def test_default_first_bucket_is_small():
    for sizes, ok in run_distributed(_rank_default_buckets, 2):
        assert sizes == [3, 1] and ok   # last layer + first bias (8 KiB + 2 KiB) first, the 1 MiB weight after
