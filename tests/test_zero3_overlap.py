"""ZeRO-3 overlaps its communication with compute, in the order the first forward recorded (not the registration order):
when a module's forward starts, the next module's gather is already in flight and the later ones are not started;
when a module's backward starts, the gather of the module before it is in flight (with a larger prefetch bucket, as
many modules ahead as it holds); each module's gradient
reduce-scatter is launched as soon as its gradients are in and left in flight while the rest of backward runs, then
finished when backward ends. With prefetch and reduce buckets of two modules, two modules are gathered in one
collective and the next two prefetched, and two modules' gradients go in one reduce-scatter, launched once all are in.
Losses and parameters stay equal to stage 0 (2 gloo ranks)."""
import pytest
import torch, torch.nn as nn, torch.nn.functional as F
from helpers import run_distributed

ORDER = 'dbac'   # forward order; registration order is abcd

class Shuffled(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c, self.d = (nn.Linear(8, 8) for _ in range(4))
    def forward(self, x):
        for name in ORDER: x = torch.tanh(getattr(self, name)(x))
        return x

def _state(records)->str:
    "'full', 'flight' (a gather started, not finished) or 'none' for a module's records"
    if all(r.pending is not None for r in records): return 'flight'
    if all(r.full for r in records): return 'full'
    assert all(r.pending is None and not r.full for r in records), [(r.pending, r.full) for r in records]
    return 'none'

UNIT = 8 * 8 + 8   # elements of one Linear(8, 8)

def overlap_rank(rank, world, units=1, bucket=UNIT):
    import flexrt
    g = torch.Generator().manual_seed(rank)
    X, Y = torch.randn(3, 4, 8, generator=g), torch.randn(3, 4, 8, generator=g)
    runs = {}
    for stage in (0, 3):
        model = Shuffled()
        config = {'train_batch_size': 4 * world, 'steps_per_print': 1000, 'optimizer': {'type': 'AdamW', 'params': {'lr': 0.05}},
                  'zero_optimization': {'stage': stage, 'stage3_param_persistence_threshold': 0, 'stage3_max_reuse_distance': 0,
                                        'stage3_prefetch_bucket_size': units * UNIT, 'reduce_bucket_size': bucket}}
        engine, *_ = flexrt.initialize(model=model, config=config)
        seen = {'forward': [], 'backward': []}
        if stage == 3:
            part = engine.optimizer.partitioner
            unit = {n: next(u for u in part.units if u.module is getattr(model, n)) for n in 'abcd'}
            gp = lambda n: part.grads.bucket(unit[n].records[0])   # buckets are planned again when the trace is known
            def at_forward(name, module, args):   # runs after the partitioner's own pre-hook (it is prepended)
                seen['forward'].append((name, {n: _state(unit[n].records) for n in 'abcd' if n != name}))
            arrived = {n: 0 for n in 'abcd'}
            def at_grad(name, p):   # after the partitioner's gradient hook of each parameter: look once both are in
                arrived[name] += 1
                if arrived[name] % 2: return
                launched = {n: (gp(n).launched, gp(n).reduce is not None and gp(n).reduce.work is not None)
                            for n in 'abcd'}   # launched, and not yet waited on (finished) by flexrt
                seen['backward'].append((name, {n: _state(unit[n].records) for n in 'abcd' if n != name}, launched))
            for n in 'abcd':
                getattr(model, n).register_forward_pre_hook(lambda m, a, n=n: at_forward(n, m, a))
                for p in getattr(model, n).parameters(): p.register_post_accumulate_grad_hook(lambda p, n=n: at_grad(n, p))
        losses = []
        for s in range(3):
            for k in seen: seen[k].clear()
            loss = F.mse_loss(engine(X[s]), Y[s]); engine.backward(loss)
            after = [gp(n).reduce for n in 'abcd'] if stage == 3 else []
            engine.step(); losses.append(loss.item())
        if stage == 3:
            from flexrt.zero.stage3.gathered import GatheredParameters
            with GatheredParameters(engine.module.parameters()): params = [p.detach().clone() for p in engine.module.parameters()]
        else: params = [p.detach().clone() for p in engine.module.parameters()]
        trace = ''.join(next(n for n in 'abcd' if getattr(model, n) is u.module) for u in part.trace) if stage == 3 else None
        engine.close()
        runs[stage] = (losses, params, dict(seen), trace, after)
    return runs

def test_stage3_prefetches_in_recorded_order_and_overlaps_reduce_scatter():
    for runs in run_distributed(overlap_rank, 2, timeout=120):
        (l0, p0, *_), (l3, p3, seen, trace, after) = runs[0], runs[3]
        torch.testing.assert_close(torch.tensor(l3), torch.tensor(l0), rtol=1e-5, atol=1e-6)
        for p, q in zip(p3, p0): torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert trace == ORDER
        # forward (third step): the next module in the recorded order is in flight, the earlier ones released, the later not started
        assert [n for n, _ in seen['forward']] == list(ORDER)
        for i, (name, states) in enumerate(seen['forward']):
            nxt = ORDER[i + 1] if i + 1 < len(ORDER) else None
            assert all(s == ('flight' if n == nxt else 'none') for n, s in states.items()), (name, states)
        # backward: modules in reverse order; the one before each (in forward order) is being gathered
        assert [n for n, *_ in seen['backward']] == list(reversed(ORDER))
        for i, (name, states, launched) in enumerate(seen['backward']):
            j = ORDER.index(name)
            prev = ORDER[j - 1] if j > 0 else None
            assert all(s == ('flight' if n == prev else 'none') for n, s in states.items()), (name, states)
            done = set(ORDER[j:])   # this module and those whose backward already ran
            # their reduce-scatters are launched and none has been waited on yet; the others are not started
            assert all(launched[n] == ((True, True) if n in done else (False, False)) for n in ORDER), (name, launched)
        assert after == [None] * 4   # backward's end finished every reduce-scatter

# two modules a chunk (d b | a c) and a bucket (gradients c a | b d): what each module sees of the others when it
# runs, and (backward) the modules whose reduce-scatter is launched
CHUNKED_FORWARD = {'d': dict(b='full', a='flight', c='flight'), 'b': dict(d='none', a='flight', c='flight'),
                   'a': dict(d='none', b='none', c='full'), 'c': dict(d='none', b='none', a='none')}
CHUNKED_BACKWARD = {'c': (dict(a='full', b='flight', d='flight'), ''), 'a': (dict(c='none', b='flight', d='flight'), 'ca'),
                    'b': (dict(c='none', a='none', d='full'), 'ca'), 'd': (dict(c='none', a='none', b='none'), 'cabd')}

def test_stage3_gathers_two_modules_at_once_and_reduces_two_modules_gradients_together():
    for runs in run_distributed(overlap_rank, 2, args=(2, 2 * UNIT), timeout=120):
        (l0, p0, *_), (l3, p3, seen, trace, after) = runs[0], runs[3]
        torch.testing.assert_close(torch.tensor(l3), torch.tensor(l0), rtol=1e-5, atol=1e-6)
        for p, q in zip(p3, p0): torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert trace == ORDER
        assert seen['forward'] == [(n, CHUNKED_FORWARD[n]) for n in ORDER]
        for name, states, launched in seen['backward']:
            expected, done = CHUNKED_BACKWARD[name]
            assert states == expected, (name, states)
            assert launched == {n: (n in done, n in done) for n in 'abcd'}, (name, launched)
        assert [n for n, *_ in seen['backward']] == list(reversed(ORDER))
        assert after == [None] * 4

def _count_collectives(rank, world, widths):
    "All-gathers and reduce-scatters of one training step at stage 3 (defaults but persistence 0 and reuse distance 0)"
    import flexrt
    from flexrt import comm as dist
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(a, b) for a, b in zip(widths, widths[1:])])
    config = {'train_batch_size': 2 * world, 'steps_per_print': 1000, 'optimizer': {'type': 'AdamW', 'params': {'lr': 0.01}},
              'zero_optimization': {'stage': 3, 'stage3_param_persistence_threshold': 0, 'stage3_max_reuse_distance': 0}}
    engine, *_ = flexrt.initialize(model=model, config=config)
    x = torch.randn(2, widths[0])
    def step(): engine.backward(engine(x).square().mean()); engine.step()
    step()                                     # the first step records the order the next ones follow
    dist.configure(enabled=True, prof_all=True); dist.reset_log()
    step()
    counts = {}
    for op, sizes in dist.comms_logger.stats(wait=True).items():
        kind = 'gather' if 'all_gather' in op else 'reduce' if 'reduce_scatter' in op else None
        if kind: counts[kind] = counts.get(kind, 0) + sum(s['count'] for s in sizes.values())
    dist.configure(enabled=False); engine.close()
    return counts

def test_stage3_coalesces_small_layers_into_few_collectives_and_keeps_large_ones_apart():
    from flexrt.zero.stage3.plan import COALESCE_NUMEL
    assert 12 * (64 * 64 + 64) < COALESCE_NUMEL <= 1024 * 1024
    # 12 small layers: one chunk gathered in forward, one again in backward, one reduce-scatter (not 12, 12 and 12)
    assert run_distributed(_count_collectives, 2, args=([64] * 13,), timeout=120)[0] == {'gather': 2, 'reduce': 1}
    # 3 layers of COALESCE_NUMEL elements or more: each gathered alone in forward and in backward, each reduced alone
    assert run_distributed(_count_collectives, 2, args=([1024] * 4,), timeout=120)[0] == {'gather': 6, 'reduce': 3}

def _ahead_rank(rank, world):
    "What each of 4 large layers sees of the others when its forward starts and while its backward runs, with prefetch of two layers; losses at stages 0 and 3"
    import flexrt
    g = torch.Generator().manual_seed(rank)
    X, Y = torch.randn(3, 2, 1024, generator=g), torch.randn(3, 2, 1024, generator=g)
    layer = 1024 * 1024 + 1024   # elements of one layer: more than COALESCE_NUMEL, so a chunk each
    out = {}
    for stage in (0, 3):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)])
        config = {'train_batch_size': 2 * world, 'steps_per_print': 1000, 'optimizer': {'type': 'AdamW', 'params': {'lr': 1e-4}},
                  'zero_optimization': {'stage': stage, 'stage3_param_persistence_threshold': 0, 'stage3_max_reuse_distance': 0,
                                        'stage3_prefetch_bucket_size': 2 * layer}}
        engine, *_ = flexrt.initialize(model=model, config=config)
        seen, losses = [], []
        if stage == 3:
            units = [next(u for u in engine.optimizer.partitioner.units if u.module is m) for m in model]
            look = lambda: ''.join({'full': 'F', 'flight': '~', 'none': '.'}[_state(u.records[:1])] for u in units)   # the weights
            for m in model:
                m.register_forward_pre_hook(lambda m, a: seen.append(('forward', look())))
                m.weight.register_hook(lambda g: seen.append(('backward', look())))   # its gradient, while its backward runs
        for s in range(3):
            del seen[:]
            loss = F.mse_loss(engine(X[s]), Y[s]); engine.backward(loss); engine.step(); losses.append(loss.item())
        engine.close()
        out[stage] = losses, list(seen)
    return out

def test_stage3_gathers_as_many_chunks_ahead_as_the_prefetch_bucket_holds():
    for out in run_distributed(_ahead_rank, 2, timeout=120):
        (l0, _), (l3, seen) = out[0], out[3]
        torch.testing.assert_close(torch.tensor(l3), torch.tensor(l0), rtol=1e-5, atol=1e-6)
        # F: whole, ~: gathering, .: released. Forward: each layer whole, the next two gathering; backward: the two before
        assert seen == [('forward', 'F~~.'), ('forward', '.F~~'), ('forward', '..F~'), ('forward', '...F'),
                        ('backward', '.~~F'), ('backward', '~~F.'), ('backward', '~F..'), ('backward', 'F...')], seen

def _held_after_forward(rank, world):
    "Bytes a stage-3 forward leaves allocated (activations and what autograd saved), and one layer's gathered bytes"
    import flexrt
    from flexrt.memory.tracker import TensorMemoryTracker
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])
    config = {'train_batch_size': 4 * world, 'steps_per_print': 1000, 'optimizer': {'type': 'AdamW', 'params': {'lr': 0.01}},
              'zero_optimization': {'stage': 3, 'stage3_param_persistence_threshold': 0, 'stage3_max_reuse_distance': 0,
                                    'stage3_prefetch_bucket_size': 256 * 256 + 256}}   # one layer a chunk
    tracker = TensorMemoryTracker(count_existing=False).enable()
    engine, *_ = flexrt.initialize(model=model, config=config)
    x, held = torch.randn(4, 256), []
    for _ in range(3):
        before = tracker.allocated_bytes
        y = engine(x); held.append(tracker.allocated_bytes - before)
        engine.backward(y.square().mean()); engine.step()
    tracker.disable(); engine.close()
    return held, world * -(-(256 * 256 + 256) // world) * 4

def test_stage3_forward_frees_what_it_gathered_although_autograd_saved_views_of_it():
    "Every Linear saves weight.t() for its backward: that view must not keep the gathered weight alive until then"
    for held, layer in run_distributed(_held_after_forward, 2, timeout=120):
        activations = 8 * 4 * 256 * 4 * 2   # inputs and outputs of 8 layers, 4 rows, fp32 (an upper bound)
        assert all(h <= activations + layer for h in held), (held, layer)   # at most the next layer's prefetch in flight
