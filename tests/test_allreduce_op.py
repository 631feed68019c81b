"""`gradient_allreduce_op`: 'mean' averages gradients over the data-parallel ranks, 'sum' sums them (world size x the
mean), at every ZeRO stage 0-3, with `gradient_predivide_factor` and `prescale_gradients`, for dense and MoE expert
parameters alike (an expert group of both ranks, and of one rank). With SGD(lr=1) one step moves each weight by the
gradient the optimizer got; it is compared to one process's gradient of the mean of every rank's loss."""
import pytest, torch, torch.nn as nn, torch.nn.functional as F
from helpers import run_distributed

WORLD, MICRO = 2, 4
VARIANTS = {'plain': {}, 'predivide': {'gradient_predivide_factor': 2.0}, 'prescale': {'prescale_gradients': True}}

class Net(nn.Module):
    "A shared layer and an expert; with ep_size n, rank r holds expert r % n, reduced over the ranks holding the same one"
    def __init__(self, ep_size:int, rank:int):
        super().__init__()
        torch.manual_seed(0); self.shared = nn.Linear(6, 8)
        torch.manual_seed(100 + rank % ep_size); self.expert = nn.Linear(8, 3)
        for p in self.expert.parameters(): p.allreduce, p.group_name = False, f'ep_size_{ep_size}'
    def forward(self, x): return self.expert(torch.tanh(self.shared(x)))

def data():
    g = torch.Generator().manual_seed(3)
    return torch.randn(WORLD * MICRO, 6, generator=g), torch.randn(WORLD * MICRO, 3, generator=g)

def _rank_loss(model, rank, X, Y):
    lo = rank * MICRO
    return F.mse_loss(model(X[lo:lo + MICRO]), Y[lo:lo + MICRO])

def reference(ep_size:int)->list: # per rank: the mean gradient of each of its parameters
    "One process: the gradient of the mean over ranks of each rank's loss (rank r's samples through expert r % ep_size)"
    nets, (X, Y) = [Net(ep_size, e) for e in range(ep_size)], data()
    for n in nets[1:]: n.shared = nets[0].shared
    (sum(_rank_loss(nets[r % ep_size], r, X, Y) for r in range(WORLD)) / WORLD).backward()
    return [[p.grad.clone() for p in nets[r % ep_size].parameters()] for r in range(WORLD)]

def step_rank(rank, world, stage):
    "Per (ep_size, op, variant): how far one SGD(lr=1) step moved each parameter of this rank's model"
    import flexrt
    (X, Y), out = data(), {}
    for ep_size in (1, 2):
        for op in ('mean', 'sum'):
            for name, extra in VARIANTS.items():
                model = Net(ep_size, rank)
                before = [p.detach().clone() for p in model.parameters()]
                cfg = {'train_micro_batch_size_per_gpu': MICRO, 'gradient_clipping': 0.0, 'steps_per_print': 1000,
                       'optimizer': {'type': 'SGD', 'params': {'lr': 1.0}}, 'gradient_allreduce_op': op,
                       'zero_optimization': {'stage': stage, 'reduce_bucket_size': 20}, **extra}
                engine, *_ = flexrt.initialize(model=model, config=cfg)
                engine.backward(_rank_loss(engine, rank, X, Y)); engine.step()
                engine.close()   # the model keeps whole, current parameters (stage 3 hands them back)
                out[ep_size, op, name] = [b - p.detach() for b, p in zip(before, model.parameters())]
    return out

@pytest.mark.parametrize('stage', [0, 1, 2, 3])
def test_sum_is_world_size_times_mean_at_every_stage(stage):
    per_rank = run_distributed(step_rank, WORLD, args=(stage,), timeout=150)
    for ep_size in (1, 2):
        want = reference(ep_size)
        for rank, moved in enumerate(per_rank):
            for name in VARIANTS:
                mean, total = moved[ep_size, 'mean', name], moved[ep_size, 'sum', name]
                for got, ref in zip(mean, want[rank]): torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
                for got, ref in zip(total, want[rank]): torch.testing.assert_close(got, WORLD * ref, rtol=1e-5, atol=1e-6)
                for s, m in zip(total, mean): torch.testing.assert_close(s, WORLD * m, rtol=1e-5, atol=1e-6)

def test_sum_takes_effect_without_a_warning():
    import warnings
    from flexrt.config import load_config
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        assert load_config({'gradient_allreduce_op': 'sum', 'zero_optimization': {'stage': 3}}).gradient_allreduce_op == 'sum'

def boundary_rank(rank, world):
    "DeepSpeed's TestBF16OptimizerGradReduction on flexrt: bf16, stage 1, two micro-steps, the boundary set by hand"
    import flexrt
    class Scale(nn.Module):
        def __init__(self): super().__init__(); self.weight = nn.Parameter(torch.ones(4))
        def forward(self, x): return (self.weight * x).sum()
    cfg = {'train_micro_batch_size_per_gpu': 1, 'gradient_accumulation_steps': 2, 'zero_optimization': {'stage': 1},
           'optimizer': {'type': 'Adam', 'params': {'lr': 1e-3}}, 'bf16': {'enabled': True}, 'steps_per_print': 1000}
    engine, *_ = flexrt.initialize(model=Scale(), config=cfg)
    for i, x in enumerate(([1., 3., 5., 7.], [11., 13., 15., 17.])):
        engine.set_gradient_accumulation_boundary(i == 1)
        engine.backward(engine(torch.tensor(x, dtype=torch.bfloat16) + 18 * rank))
    (grad,), start_end = engine.optimizer.reduced_gradients(), engine.optimizer.buckets[0].partition.shard_range()
    grad = grad.clone(); engine.close()
    return grad, start_end

def test_the_boundary_micro_step_is_reduced_with_the_accumulated_ones():
    "Each rank's chunk of the fp32 gradient is the mean over ranks of the mean over micro-steps (DeepSpeed's [15, 17, 19, 21])"
    want = torch.tensor([15., 17., 19., 21.])
    for grad, (start, end) in run_distributed(boundary_rank, WORLD):
        torch.testing.assert_close(grad, want[start:end])
