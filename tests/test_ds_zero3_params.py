"DeepSpeed's per-parameter ZeRO-3 attributes on real gloo ranks: what `ds_tensor`, `ds_persist`, `all_gather()` ... mean."
import warnings
import torch
import torch.nn as nn
from helpers import run_distributed
import flexrt
from flexrt import zero, comm as dist
from flexrt.zero.stage3.records import ZeroParamStatus
from flexrt.zero.stage3 import params as params_module

WS = 2

def config(threshold=0):
    return {'train_micro_batch_size_per_gpu': 1, 'steps_per_print': 10**6, 'gradient_clipping': 0.,
            'zero_optimization': {'stage': 3, 'stage3_param_persistence_threshold': threshold, 'stage3_max_reuse_distance': 0}}

def engine_for(model, threshold=0, lr=0.):
    return flexrt.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr), config=config(threshold))[0]

def shard_of(full:torch.Tensor, rank:int)->torch.Tensor:
    "Rank `rank`'s DeepSpeed partition of `full`: ceil(numel / WS) elements, zero-padded past the end"
    s = -(-full.numel() // WS)
    return torch.cat([full.reshape(-1), full.new_zeros(s * WS - full.numel())])[rank * s:(rank + 1) * s]

def two_layers():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 2))   # weights of 15 and 6 elements, biases of 3 and 2

# --- the attributes ------------------------------------------------------------------------------------------------

def attributes_rank(rank, ws):
    model = two_layers()
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = engine_for(model, threshold=4)   # the biases (3 and 2 elements) are persistent
    seen = []
    model[0].register_forward_hook(lambda m, a, o: seen.append(m.weight.ds_status))
    engine(torch.ones(1, 5))
    out = {n: dict(ds_numel=p.ds_numel, ds_shape=tuple(p.ds_shape), ds_id=p.ds_id, ds_persist=p.ds_persist, ds_status=p.ds_status,
                   numel=p.numel(), ds_tensor=p.ds_tensor.clone(), sizes=(p.partition_numel(), p.padding_size(), p.aligned_size()))
           for n, p in model.named_parameters()}
    engine.close()
    left = [hasattr(p, a) for p in model.parameters() for a in ('ds_id', 'ds_tensor', 'all_gather')]
    return full, out, seen, left

def test_attributes_mean_what_deepspeed_says():
    for rank, (full, out, seen, left) in enumerate(run_distributed(attributes_rank, WS)):
        for name, a in out.items():
            f, persistent = full[name], name.endswith('bias')
            assert (a['ds_numel'], a['ds_shape'], a['ds_persist']) == (f.numel(), tuple(f.shape), persistent), name
            torch.testing.assert_close(a['ds_tensor'], shard_of(f, rank))   # this rank's slice, zeros past the end
            s = -(-f.numel() // WS)
            assert a['sizes'] == (s, s * WS - f.numel(), s * WS)
            if persistent: assert (a['ds_status'], a['numel']) == (ZeroParamStatus.AVAILABLE, f.numel()), name   # whole between uses
            else: assert (a['ds_status'], a['numel']) == (ZeroParamStatus.NOT_AVAILABLE, 0), name
        assert len({a['ds_id'] for a in out.values()}) == len(out)
        assert seen == [ZeroParamStatus.AVAILABLE]   # whole inside its module's forward
        assert not any(left)                          # close() takes DeepSpeed's attributes away with the shards

# --- ds_tensor is the shard itself; the gradient shards -----------------------------------------------------------

class Scale(nn.Module):
    def __init__(self):
        super().__init__(); self.weight = nn.Parameter(torch.zeros(3, 5))
    def forward(self, x): return self.weight * x

def shard_write_rank(rank, ws):
    model = Scale()
    engine = engine_for(model, lr=0.1)
    w = next(model.parameters())   # iterating does not gather (looking `model.weight` up would: then the write shows at the next gather)
    w.ds_tensor.data = torch.full_like(w.ds_tensor, rank + 1.)   # as DeepSpeed's tests do: new storage for the shard
    with torch.no_grad(): gathered = engine(torch.ones(3, 5))   # the forward gathers it: rank 0's 8 elements, then rank 1's 7
    engine.backward(engine(torch.full((3, 5), rank + 1.)).sum())   # d/dw = x: averaged over the ranks, 1.5 everywhere
    parts = engine.optimizer.get_fp32_grad_partitions()
    grads = {g: {i: t.clone() for i, t in d.items()} for g, d in parts.items()}
    engine.step()
    norm, master = float(engine.optimizer._global_grad_norm), engine.optimizer._master_of[w].clone()
    back = w.ds_tensor.data_ptr() == engine.optimizer._working_of[w].data_ptr()
    after = w.ds_tensor.clone()
    engine.close()
    return gathered, grads, norm, back, after, master

def test_ds_tensor_is_the_shard_and_gradient_shards_are_averaged():
    expected = torch.tensor([1.] * 8 + [2.] * 7).view(3, 5)
    for rank, (gathered, grads, norm, back, after, master) in enumerate(run_distributed(shard_write_rank, WS)):
        torch.testing.assert_close(gathered, expected)
        assert list(grads) == [0] and list(grads[0]) == [0]
        torch.testing.assert_close(grads[0][0], shard_of(torch.full((15,), 1.5), rank))   # fp32, padding zero
        assert grads[0][0].dtype == torch.float32
        assert abs(norm - 1.5 * 15 ** 0.5) < 1e-5
        assert back                                        # the step points the shard at the optimizer's buffer again,
        torch.testing.assert_close(after, master)          # holding the stepped master (the write is not kept, as in DeepSpeed)
        torch.testing.assert_close(after, shard_of(torch.full((15,), -0.15), rank))

# --- all_gather() and partition() ----------------------------------------------------------------------------------

def methods_rank(rank, ws):
    model = two_layers()
    full = model[0].weight.detach().clone()
    engine = engine_for(model, threshold=4)
    w, b = model[0].weight, model[1].bias    # a partitioned weight, a persistent bias (held: a lookup would gather)
    w.all_gather()
    whole = (w.ds_status, w.detach().clone())
    w.partition(); b.partition()
    released = (w.ds_status, w.numel(), b.ds_status, b.numel())   # partition() releases a persistent parameter too
    w.all_gather(param_list=[w, b], async_op=True).wait()
    with torch.no_grad(): w.add_(10. * (rank + 1))                  # each rank changes its own whole copy...
    w.partition(has_been_updated=True)                              # ...and keeps its own piece of it
    engine.backward(engine(torch.ones(1, 5)).sum() * 0); engine.step()   # lr 0: the master (brought along) is the new value
    w.all_gather(); changed = w.detach().clone()
    engine.close()
    return full, whole, released, changed

def test_all_gather_and_partition():
    results = run_distributed(methods_rank, WS)
    for full, whole, released, changed in results:
        assert whole[0] == ZeroParamStatus.AVAILABLE
        torch.testing.assert_close(whole[1], full)
        assert released == (ZeroParamStatus.NOT_AVAILABLE, 0, ZeroParamStatus.NOT_AVAILABLE, 0)
        torch.testing.assert_close(changed, full + torch.tensor([10.] * 8 + [20.] * 7).view(3, 5))

# --- persistence and DeepSpeed's empty_partition_cache ---------------------------------------------------------------

def cache_rank(rank, ws, save_dir):
    model = two_layers()
    engine = engine_for(model, threshold=100)   # every parameter is persistent
    x = torch.arange(5.).view(1, 5)
    before = engine(x).detach().clone()
    kept = [(p.ds_persist, p.numel() == p.ds_numel) for p in model.parameters()]
    engine.empty_partition_cache()
    emptied = [(p.numel(), p.ds_status) for p in model.parameters()]
    again = engine(x).detach().clone()
    whole = [p.numel() == p.ds_numel for p in model.parameters()]
    gathered, original = [], params_module.gather_records
    params_module.gather_records = lambda records, **kw: (gathered.append(len(records)), original(records, **kw))[1]
    try:
        engine.optimizer.refresh()                  # all whole: nothing to gather
        engine.empty_partition_cache(); engine.save_checkpoint(save_dir)
    finally: params_module.gather_records = original
    saved = [(p.numel() == p.ds_numel, p.ds_status) for p in model.parameters()]
    engine.close()
    return before, kept, emptied, again, whole, gathered, saved

def test_persistent_parameters_and_empty_partition_cache(tmp_path):
    for before, kept, emptied, again, whole, gathered, saved in run_distributed(cache_rank, WS, args=(str(tmp_path),)):
        assert kept == [(True, True)] * 4
        assert emptied == [(0, ZeroParamStatus.NOT_AVAILABLE)] * 4
        torch.testing.assert_close(again, before)   # the next forward gathers them again...
        assert whole == [True] * 4                  # ...and they stay whole
        assert gathered == [4]                      # a save gathers the 4 released ones once; a refresh of whole ones, none
        assert saved == [(True, ZeroParamStatus.AVAILABLE)] * 4   # whole after the save, as DeepSpeed leaves them

# --- zero.Init -------------------------------------------------------------------------------------------------------

class Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.utils.skip_init(nn.Linear, 5, 3)   # built on the meta device, then given (uninitialised) storage
        with torch.no_grad(): self.lin.weight.copy_(torch.arange(15.).view(3, 5) * (dist.get_rank() + 1))

def init_rank(rank, ws):
    with zero.Init(config_dict_or_path=config()): model = Holder()
    w = model.lin.weight
    return w.numel(), w.ds_numel, w.ds_tensor.clone()

def test_zero_init_skip_init_and_rank_zero_values():
    for rank, (numel, ds_numel, shard) in enumerate(run_distributed(init_rank, WS)):
        assert (numel, ds_numel) == (0, 15)
        torch.testing.assert_close(shard, shard_of(torch.arange(15.), rank))   # rank 0's value, partitioned

def test_zero_init_under_another_stage_builds_whole():
    zero.stage3.partitioned_init._warned.discard('stage')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        with zero.Init(config_dict_or_path={'zero_optimization': {'stage': 2}}): a = nn.Linear(3, 2)
        with zero.Init(config_dict_or_path={'zero_optimization': {'stage': 1}}, enabled=False): b = nn.Linear(3, 2)
    assert [p.shape for p in (a.weight, b.weight)] == [(2, 3), (2, 3)] and not hasattr(a.weight, 'ds_id')
    assert len(caught) == 1 and 'no effect with zero_optimization.stage=2' in str(caught[0].message)
