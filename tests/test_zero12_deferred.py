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
    e = stepped(); missing = hasattr(e, 'no_such_attribute'); out['hasattr'] = (missing, len(e.optimizer.deferred.pending) > 0)
    module = e.module
    out['module'] = (len(e.optimizer.deferred.pending), [p.detach().clone() for p in module.parameters()]); e.close()
    e = stepped(); inner = e._modules['module']
    with e.optimizer.gathered(list(inner.parameters())):
        out['gathered'] = (len(e.optimizer.deferred.pending), [p.detach().clone() for p in inner.parameters()])
    e.close()
    e = stepped(); e.save_checkpoint(tmp, tag='t')
    out['save'] = (len(e.optimizer.deferred.pending), None); e.close()
    loaded = engine_of(stage); loaded.load_checkpoint(tmp, tag='t')
    out['load'] = (len(loaded.optimizer.deferred.pending), [p.detach().clone() for p in loaded.module.parameters()]); loaded.close()
    e = stepped(); inner = e._modules['module']; e.close()
    out['close'] = (len(e.optimizer.deferred.pending), [p.detach().clone() for p in inner.parameters()])
    ref.close()
    return out, expect

@pytest.mark.parametrize('stage', [1, 2])
def test_module_gathered_checkpoint_and_close_wait_for_gathers_in_flight(stage, tmp_path):
    for out, expect in run_distributed(wait_rank, 2, args=(stage, str(tmp_path))):
        assert set(out) == {'hasattr', 'module', 'gathered', 'save', 'load', 'close'}
        assert out.pop('hasattr') == (False, True)   # a name the engine and model lack waits for nothing
        for name, (pending, params) in out.items():
            assert pending == 0, name
            if params is not None:
                for p, q in zip(params, expect): torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)

class ParentReads(torch.nn.Module):
    "The parent multiplies by its child's weight itself before it calls the child"
    def __init__(self):
        super().__init__(); torch.manual_seed(0)
        self.inp, self.child, self.out = torch.nn.Linear(6, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 3)
        self.probe = lambda module: None
    def forward(self, x):
        h = torch.tanh(self.inp(x))
        self.probe(self.child); w = self.child.weight; self.probe(self.child)
        h = torch.tanh(F.linear(h, w))
        return self.out(torch.tanh(self.child(h)))

class TiedReads(torch.nn.Module):
    "`head` shares `emb`'s weight; the parent reads it through `head` before `emb` or `head` runs"
    def __init__(self):
        super().__init__(); torch.manual_seed(0)
        self.inp, self.emb, self.out = torch.nn.Linear(6, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 3)
        self.head = torch.nn.Linear(16, 16, bias=False); self.head.weight = self.emb.weight
        self.probe = lambda module: None
    def forward(self, x):
        h = torch.tanh(self.inp(x))
        self.probe(self.head); w = self.head.weight; self.probe(self.head)
        h = torch.tanh(F.linear(h, w.t()))
        h = torch.tanh(self.emb(h))
        return self.out(torch.tanh(self.head(h)))

def reads_rank(rank, world, stage, name):
    "Per step: the gathers of the weight read in flight just before the parent's read and just after it"
    import flexrt
    make = {'parent': ParentReads, 'tied': TiedReads}[name]
    models = {0: make(), stage: make()}
    engines = {k: flexrt.initialize(model=m, config={**CONFIG, **zero(k)})[0] for k, m in models.items()}
    deferred, seen = engines[stage].optimizer.deferred, []
    def probe(module):
        w = dict.__getitem__(module._parameters, 'weight')   # an unwatched read: it waits for nothing
        seen.append(sum(i in deferred.pending for i in deferred._buckets_of[id(w)]))
    models[stage].probe = probe
    losses, probes = {0: [], stage: []}, []
    for s in range(STEPS):
        x, y = share(rank, world, s)
        for k, engine in engines.items():
            loss = F.mse_loss(engine(x), y)
            engine.backward(loss); engine.step(); losses[k].append(loss.item())
        probes.append(list(seen)); seen.clear()
    params = {k: [p.detach().clone() for p in e.module.parameters()] for k, e in engines.items()}
    for e in engines.values(): e.close()
    return losses, params, probes

@pytest.mark.parametrize('name', ['parent', 'tied'])
@pytest.mark.parametrize('stage', [1, 2])
def test_a_parameter_read_before_its_module_runs_waits_for_its_gather(stage, name):
    for losses, params, probes in run_distributed(reads_rank, 2, args=(stage, name)):
        torch.testing.assert_close(torch.tensor(losses[stage]), torch.tensor(losses[0]), rtol=1e-5, atol=1e-6)
        for p, q in zip(params[stage], params[0]): torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert probes[0] == [0, 0]                       # no step yet: nothing in flight
        for before, after in probes[1:]:
            assert before > 0 and after == 0, probes     # in flight up to the read, finished by the read itself

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
