"""ZeRO stages 1 and 2 leave the all-gathers of updated parameters in flight after step() and wait for each bucket
when forward first needs it (2 gloo ranks): the next forward still computes with the updated parameters (losses and
parameters equal to stage 0's), a bucket is waited on only when its first module runs, and `engine.module`,
`gathered()` (evaluation, 16-bit saves), checkpoint saves and `close()` wait for everything in flight."""
import copy
import pytest, torch, torch.nn.functional as F
from helpers import run_distributed
from test_engine import CONFIG, STEPS, BATCH, make_model, make_data

def zero(stage): return {'zero_optimization': {'stage': stage, 'reduce_bucket_size': 60}}

def engine_of(stage, **config):
    import flexrt
    engine, *_ = flexrt.initialize(model=make_model(), config={**CONFIG, **zero(stage), **config})
    return engine

def share(rank, world, s):
    X, Y = make_data()
    micro = BATCH // world
    return X[s * BATCH + rank * micro:][:micro], Y[s * BATCH + rank * micro:][:micro]

def order_rank(rank, world, stage, **config):
    "Per step: gathers in flight after step(); at each Linear's forward, how many of its own buckets were still pending"
    engines = {0: engine_of(0), stage: engine_of(stage, **config)}
    deferred = engines[stage].optimizer.deferred
    pending_at = []
    def probe(m, args):   # registered after the slot's hook: runs once the slot waited for m's buckets
        pending_at.append((len(deferred.pending), sum(i in deferred.pending for i in deferred._needs[m])))
    for m in engines[stage]._modules['module']:
        if isinstance(m, torch.nn.Linear): m.register_forward_pre_hook(probe)
    losses, in_flight, probes = {0: [], stage: []}, [], []
    for s in range(STEPS):
        x, y = share(rank, world, s)
        for k, engine in engines.items():
            pending_at.clear()
            loss = F.mse_loss(engine(x), y)
            engine.backward(loss); engine.step(); losses[k].append(loss.item())
        in_flight.append(len(deferred.pending)); probes.append(list(pending_at))
    params = {k: [p.detach().clone() for p in e.module.parameters()] for k, e in engines.items()}
    for e in engines.values(): e.close()
    return losses, params, in_flight, probes, (len(engines[stage].optimizer.buckets), len(deferred.params_of))

@pytest.mark.parametrize('stage', [1, 2])
def test_forward_after_step_sees_updated_parameters_and_waits_bucket_by_bucket(stage):
    for losses, params, in_flight, probes, (num_buckets, num_gathers) in run_distributed(order_rank, 2, args=(stage,)):
        torch.testing.assert_close(torch.tensor(losses[stage]), torch.tensor(losses[0]), rtol=1e-5, atol=1e-6)
        for p, q in zip(params[stage], params[0]): torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert num_gathers >= num_buckets > 3 and in_flight == [num_gathers] * STEPS   # every gather (bucket or piece) left in flight by step()
        for step, seen in enumerate(probes[1:], 1):          # step 0's forward ran before any step(): nothing pending
            assert all(own == 0 for _, own in seen), seen      # each Linear's buckets were finished before it ran
            total = [n for n, _ in seen]
            assert total[0] > 0 and total == sorted(total, reverse=True), seen   # the rest still in flight, waited later
        assert probes[0] == [(0, 0)] * 3

def one_bucket(rank, world, stage):
    return order_rank(rank, world, stage, zero_optimization={'stage': stage})   # the default bucket holds the whole model

@pytest.mark.parametrize('stage', [1, 2])
def test_a_one_bucket_model_is_gathered_in_pieces_waited_as_forward_reaches_them(stage):
    for losses, params, in_flight, probes, (num_buckets, num_gathers) in run_distributed(one_bucket, 2, args=(stage,)):
        torch.testing.assert_close(torch.tensor(losses[stage]), torch.tensor(losses[0]), rtol=1e-5, atol=1e-6)
        for p, q in zip(params[stage], params[0]): torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert (num_buckets, num_gathers) == (1, 4) and in_flight == [4] * STEPS
        for seen in probes[1:]:
            assert all(own == 0 for _, own in seen), seen          # each Linear waited for every piece it needs
            assert seen[0][0] > 0, seen                             # the first Linear ran with pieces still in flight

def wait_rank(rank, world, stage, tmp):
    "After step(): engine.module, gathered(), save_checkpoint and close() each find nothing in flight afterwards"
    import flexrt
    x, y = share(rank, world, 0)
    out = {}
    ref = engine_of(0)
    ref.backward(F.mse_loss(ref(x), y)); ref.step()
    expect = [p.detach().clone() for p in ref.module.parameters()]
    def stepped():
        e = engine_of(stage)
        e.backward(F.mse_loss(e(x), y)); e.step()
        assert len(e.optimizer.deferred.pending) > 0
        return e
    e = stepped(); module = e.module
    out['module'] = (len(e.optimizer.deferred.pending), [p.detach().clone() for p in module.parameters()]); e.close()
    e = stepped(); inner = e._modules['module']
    with e.optimizer.gathered(list(inner.parameters())):
        out['gathered'] = (len(e.optimizer.deferred.pending), [p.detach().clone() for p in inner.parameters()])
    e.close()
    e = stepped(); e.save_checkpoint(tmp, tag='t')
    out['save'] = (len(e.optimizer.deferred.pending), None); e.close()
    loaded = engine_of(stage); loaded.load_checkpoint(tmp, tag='t')
    out['load'] = (0, [p.detach().clone() for p in loaded.module.parameters()]); loaded.close()
    e = stepped(); inner = e._modules['module']; e.close()
    out['close'] = (len(e.optimizer.deferred.pending), [p.detach().clone() for p in inner.parameters()])
    ref.close()
    return out, expect

@pytest.mark.parametrize('stage', [1, 2])
def test_module_gathered_checkpoint_and_close_wait_for_gathers_in_flight(stage, tmp_path):
    for out, expect in run_distributed(wait_rank, 2, args=(stage, str(tmp_path))):
        assert set(out) == {'module', 'gathered', 'save', 'load', 'close'}
        for name, (pending, params) in out.items():
            assert pending == 0, name
            if params is not None:
                for p, q in zip(params, expect): torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)

def eager_rank(rank, world):
    "defer_gather=False: step() returns with every gather finished (no hooks on the model)"
    from flexrt.zero import ZeroStage2
    from flexrt.precision import Precision
    model = make_model()
    slot = ZeroStage2(model, torch.optim.AdamW(model.parameters(), lr=0.05), Precision(), bucket_bytes=240, defer_gather=False)
    x, y = share(rank, world, 0)
    slot.set_boundary(True); F.mse_loss(model(x), y).backward(); slot.reduced_gradients(); slot.step()
    hooks = sum(len(m._forward_pre_hooks) for m in model.modules())
    slot.close()
    return slot.deferred, hooks

def test_defer_gather_false_waits_in_step():
    for deferred, hooks in run_distributed(eager_rank, 2): assert deferred is None and hooks == 0
