"""ZeRO-3 records the order its modules run in the first forward (for one-module-ahead prefetch in forward and backward)
and records it again when a later forward runs them in another order; training through order changes stays equal to
stage 0 (2 gloo ranks)."""
import pytest, torch, torch.nn as nn, torch.nn.functional as F
from helpers import run_distributed

class Swappable(nn.Module):
    "Three layers whose forward order the caller picks"
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
    def forward(self, x, order='abc'):
        for name in order: x = torch.tanh(getattr(self, name)(x))
        return x

ORDERS = ['abc', 'abc', 'cba', 'cba', 'bac', 'bac']

def retrace_rank(rank, world):
    import flexrt
    g = torch.Generator().manual_seed(rank)
    X, Y = torch.randn(len(ORDERS), 4, 8, generator=g), torch.randn(len(ORDERS), 4, 8, generator=g)
    runs = {}
    for stage in (0, 3):
        model = Swappable()
        config = {'train_batch_size': 4 * world, 'steps_per_print': 1000, 'optimizer': {'type': 'AdamW', 'params': {'lr': 0.05}},
                  'zero_optimization': {'stage': stage, 'stage3_param_persistence_threshold': 0}}
        engine, *_ = flexrt.initialize(model=model, config=config)
        losses, traces = [], []
        for s, order in enumerate(ORDERS):
            loss = F.mse_loss(engine(X[s], order=order), Y[s]); engine.backward(loss); engine.step()
            losses.append(loss.item())
            if stage == 3:
                part = engine.optimizer.partitioner
                names = {id(m): n for n, m in model.named_modules()}
                traces.append((''.join(names[id(u.module)] for u in part.trace), part.num_retraces))
        params = [p.detach().clone() for p in engine.module.parameters()] if stage == 0 else None
        if stage == 3:
            from flexrt.zero.stage3.gathered import GatheredParameters
            with GatheredParameters(engine.module.parameters()): params = [p.detach().clone() for p in engine.module.parameters()]
        engine.close()
        runs[stage] = (losses, params, traces)
    return runs

def test_stage3_rerecords_the_order_when_forward_changes_it():
    for runs in run_distributed(retrace_rank, 2, timeout=120):
        (l0, p0, _), (l3, p3, traces) = runs[0], runs[3]
        torch.testing.assert_close(torch.tensor(l3), torch.tensor(l0), rtol=1e-5, atol=1e-6)
        for p, q in zip(p3, p0): torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert traces == [('abc', 0), ('abc', 0), ('cba', 1), ('cba', 1), ('bac', 2), ('bac', 2)]
