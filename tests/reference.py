"""The plain-torch reference for 16-bit training: the same casts, in the same order, as flexrt's engine and ZeRO stages.

    ref = reference16(make_model, micro_batches, loss_fn, make_optimizer, dtype=torch.bfloat16, world=2, gas=2, clip=0.5)

`micro_batches[s][rank][i]` is rank `rank`'s i-th micro-batch of step s (each rank of the run is simulated here, one
after another, in one process). The sequence, per optimizer step:
  1. the model holds 16-bit weights; fp32 masters are copies of the fp32 weights the model had before the cast;
  2. each micro-batch: loss (fp32) / gas, times the loss scale, backward: 16-bit gradients;
  3. `reduce='boundary'` (stages 0-2): each rank sums its micro-batches' gradients in 16-bit (autograd accumulation),
     then the ranks' sums are added in 16-bit (rank 0 + rank 1 + ...), divided by `world` in 16-bit, cast to fp32;
     `reduce='micro'` (stage 3): the ranks' gradients of each micro-batch are added and divided in 16-bit, then summed
     into fp32 gradient shards;
  4. overflow (any non-finite gradient) skips the step and halves the scale (fp16, hysteresis 1); else the fp32 gradients
     are multiplied by 1/scale;
  5. clipping as torch's clip_grad_norm_ (norm of the per-tensor norms; coefficient max_norm / (norm + 1e-6));
  6. the optimizer steps the fp32 masters, which are then cast into the model.
With two ranks every 16-bit sum is one rounding of a commutative addition, so the gloo algorithm cannot change it. The
tests allow one ulp of the 16-bit dtype per weight (`assert_close16`) and `ULPS` fp32 ulps for losses and norms
(`assert_ulps`: summation order inside the fp32 norm); measured, the engine at stages 0-3 in bf16 and fp16 matches
bit for bit, norms within one fp32 ulp. On more than two ranks the 16-bit sums depend on the order (see test_zero12).

`drop_step` skips the optimizer step at that index (counters and scaler still advance): the tests use it to show
their comparison would see one missing step.
"""
import math
import torch

ULPS = 8   # fp32 ulps at the tensor's scale: summation order inside norms, nothing else

def close_ulps(a, b, n=ULPS)->bool:
    "|a - b| <= n fp32 ulps at the scale of `b` (its largest finite magnitude); non-finite values must be non-finite in both"
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    if a.shape != b.shape or not torch.equal(a.isfinite(), b.isfinite()): return False
    fin = b.isfinite()
    if not fin.any(): return True
    return bool(((a[fin] - b[fin]).abs() <= n * torch.finfo(torch.float32).eps * b[fin].abs().max()).all())

def assert_ulps(a, b, n=ULPS, msg=''):
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    assert close_ulps(a, b, n), f"{msg}: max |diff| {(a - b).abs().max().item():.3g} > {n} ulps of {b.abs().max().item():.3g}"

def _sum_ranks(grads:list, world:int, dtype)->torch.Tensor:
    "The ranks' 16-bit gradients added in 16-bit, rank by rank, then divided by the world size in 16-bit"
    total = grads[0].clone()
    for g in grads[1:]: total = total + g
    return total / world if world != 1 else total

@torch.no_grad()
def _clip(grads:list, max_norm:float)->float:
    "torch's clip_grad_norm_ over fp32 gradients; returns the norm before clipping"
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    if max_norm and float(total) > max_norm: torch._foreach_mul_(grads, max_norm / (total + 1e-6))
    return float(total)

def _backward(loss, gas:int, scale:float):
    "The engine's order: the loss divided by gas (when > 1), then times the scale (when != 1)"
    if gas > 1: loss = loss / gas
    (loss * scale if scale != 1. else loss).backward()

def _micro_grads(model, params, batch, loss_fn, gas, scale, start:list)->tuple:
    "One rank's backward on one micro-batch, accumulating into `start` (16-bit, as autograd does): (loss, grads)"
    for p, g in zip(params, start): p.grad = g
    loss = loss_fn(model, batch)
    _backward(loss, gas, scale)
    grads = [p.grad for p in params]
    for p in params: p.grad = None
    return loss.item(), grads

def _reduce(per_rank:list, params:list, world:int, zero_missing:bool)->list:
    "Each parameter's gradient over the ranks (16-bit sum and division), as fp32; None where no rank has one"
    out = []
    for k, p in enumerate(params):
        gs = [g[k] for g in per_rank]
        if all(g is None for g in gs) and not zero_missing: out.append(None); continue
        out.append(_sum_ranks([torch.zeros_like(p) if g is None else g for g in gs], world, p.dtype).float())
    return out

def reference16(make_model, # () -> the fp32 model, freshly seeded
                micro_batches, # [step][rank][micro] -> a batch given to `loss_fn`
                loss_fn, # (model, batch) -> the micro-batch's fp32 loss
                make_optimizer, # (params) -> torch optimizer over the fp32 masters
                dtype=torch.bfloat16, # the working dtype
                make_scheduler=None, # (optimizer) -> lr schedule stepped after each applied step, or None
                gas:int=1, clip:float=0.,
                scale:float=1., # the (initial) loss scale
                dynamic:bool=False, # fp16: skip a step whose gradients hold inf/nan and halve the scale (hysteresis 1)
                reduce:str='boundary', # 'boundary' (stages 0-2) or 'micro' (stage 3)
                drop_step:int|None=None, # skip this optimizer step (the deliberate bug the tests must see)
                zero_missing:bool=True)->dict: # parameters without a gradient step with zeros (flat buffers do)
    "micro_losses [step][rank][micro], norms, skipped, scales, masters (fp32), params (the model's, as fp32), model"
    model = make_model()
    params = [p for p in model.parameters() if p.requires_grad]
    masters = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    model.to(dtype)
    opt = make_optimizer(masters)
    sched = make_scheduler(opt) if make_scheduler else None
    world = len(micro_batches[0])
    out = {'micro_losses': [], 'norms': [], 'skipped': [], 'scales': []}
    for s, ranks in enumerate(micro_batches):
        acc, fp32, losses = [[None] * len(params) for _ in range(world)], None, [[] for _ in range(world)]
        for i in range(gas):
            per_rank = []
            for r in range(world):
                start = acc[r] if reduce == 'boundary' else [None] * len(params)
                loss, grads = _micro_grads(model, params, ranks[r][i], loss_fn, gas, scale, start)
                losses[r].append(loss)
                if reduce == 'boundary': acc[r] = grads
                else: per_rank.append(grads)
            if reduce == 'micro':   # reduce-scattered at every micro-batch, summed into fp32 shards
                part = _reduce(per_rank, params, world, True)
                fp32 = part if fp32 is None else [a + b for a, b in zip(fp32, part)]
        if reduce == 'boundary': fp32 = _reduce(acc, params, world, zero_missing)
        for m, g in zip(masters, fp32): m.grad = g
        grads = [g for g in fp32 if g is not None]
        overflow = dynamic and not all(bool(torch.isfinite(g).all()) for g in grads)
        if overflow: scale = scale / 2
        elif scale != 1.: torch._foreach_mul_(grads, 1. / scale)
        out['norms'].append(math.nan if overflow else _clip(grads, clip))
        if not overflow:
            if s != drop_step:
                opt.step()
                with torch.no_grad(): torch._foreach_copy_(params, masters)
            if sched is not None: sched.step()
        opt.zero_grad(set_to_none=True)
        out['micro_losses'].append(losses); out['skipped'].append(overflow); out['scales'].append(scale)
    out['masters'] = [m.detach().clone() for m in masters]
    out['params'] = [p.detach().float().clone() for p in model.parameters()]
    out['model'] = model   # the trained 16-bit model, for evaluations
    return out

def close16(a, b, dtype=torch.bfloat16, n:int=1)->bool:
    "16-bit weights (as fp32) within n ulps of `dtype` at each element's magnitude"
    a, b = torch.as_tensor(a).float(), torch.as_tensor(b).float()
    tol = n * torch.finfo(dtype).eps * torch.maximum(a.abs(), b.abs()) + torch.finfo(dtype).tiny
    return a.shape == b.shape and bool(((a - b).abs() <= tol).all())

def assert_close16(got:list, want:list, dtype=torch.bfloat16, n:int=1, msg=''):
    "Every tensor of `got` within n ulps of `dtype` of `want`"
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert close16(a, b, dtype, n), f"{msg} tensor {i}: max |diff| {(a.float() - b.float()).abs().max().item():.3g}"

def close16_scale(a, b, dtype=torch.bfloat16, n:int=2)->bool:
    "Within n ulps of `dtype` at the tensor's scale (its largest magnitude): what different 16-bit summation orders allow"
    a, b = torch.as_tensor(a).float(), torch.as_tensor(b).float()
    return a.shape == b.shape and bool(((a - b).abs() <= n * torch.finfo(dtype).eps * b.abs().max()).all())
