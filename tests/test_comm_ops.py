"Every flexrt.comm op on 2 and 4 real gloo ranks gives exactly torch.distributed's result on the same inputs."
import pytest, torch, torch.distributed as tdist
from helpers import run_distributed
from flexrt import comm as dist

def _x(rank, n=6, dtype=torch.float32):
    "Rank-dependent data: equal results prove the data really moved between ranks"
    return torch.arange(n, dtype=dtype) * (rank + 1) + 10 * rank

def _pair(ours, theirs):
    "Run `ours(dist)` and `theirs(tdist)`; each returns a tensor or a list of them"
    flat = lambda r: [t.tolist() for t in r] if isinstance(r, (list, tuple)) else r.tolist()
    return flat(ours(dist)), flat(theirs(tdist))

def _reductions(rank, ws):
    out = {}
    assert (dist.get_rank(), dist.get_world_size(), dist.is_initialized(), dist.get_backend()) == (rank, ws, True, 'gloo')
    for op in ('SUM', 'MAX', 'MIN', 'PRODUCT', 'AVG'):
        def run(m, op=op):
            t = _x(rank); m.all_reduce(t, getattr(m.ReduceOp, op)); return t
        out[f'all_reduce_{op}'] = _pair(run, run)
    def red(m):
        t = _x(rank); m.reduce(t, dst=ws - 1); return t
    ours, theirs = _pair(red, red)  # every rank calls reduce; only dst's result is defined
    out['reduce'] = (ours, theirs) if rank == ws - 1 else (None, None)
    def bcast(m):
        t = _x(rank); m.broadcast(t, src=1); return t
    out['broadcast'] = _pair(bcast, bcast)
    def rs(m):
        o = torch.empty(2); m.reduce_scatter(o, [_x(rank, 2) + i for i in range(ws)]); return o
    out['reduce_scatter'] = _pair(rs, rs)
    def rst(m):
        o = torch.empty(3); m.reduce_scatter_tensor(o, _x(rank, 3 * ws)); return o
    out['reduce_scatter_tensor'] = _pair(rst, rst)
    def rst_max(m):
        o = torch.empty(2, 2); m.reduce_scatter_tensor(o, _x(rank, 4 * ws).view(2 * ws, 2), m.ReduceOp.MAX); return o
    out['reduce_scatter_tensor_max_2d'] = _pair(rst_max, rst_max)
    dist.barrier(); dist.monitored_barrier(wait_all_ranks=True)
    return out

def _gathers(rank, ws):
    out = {}
    def ag(m):
        lst = [torch.empty(6) for _ in range(ws)]; m.all_gather(lst, _x(rank)); return lst
    out['all_gather'] = _pair(ag, ag)
    def agt(m):
        o = torch.empty(ws * 2, 3); m.all_gather_into_tensor(o, _x(rank).view(2, 3)); return o
    out['all_gather_into_tensor'] = _pair(agt, agt)
    def ga(m):
        lst = [torch.empty(6) for _ in range(ws)] if rank == 0 else None
        m.gather(_x(rank), lst, dst=0); return lst or []
    out['gather'] = _pair(ga, ga)
    def sc(m):
        o = torch.empty(4); m.scatter(o, [_x(i, 4) for i in range(ws)] if rank == 1 else None, src=1); return o
    out['scatter'] = _pair(sc, sc)
    def a2a(m):
        outs = [torch.empty(3) for i in range(ws)]
        m.all_to_all(outs, [_x(rank, 3) + 100 * j for j in range(ws)]); return outs
    out['all_to_all'] = _pair(a2a, a2a)
    def a2as(m):
        o = torch.empty(2 * ws); m.all_to_all_single(o, _x(rank, 2 * ws)); return o
    out['all_to_all_single'] = _pair(a2as, a2as)
    ins, outs = [j + 1 for j in range(ws)], [rank + 1] * ws  # each rank sends j+1 elements to rank j
    def a2as_split(m):
        o = torch.empty(sum(outs)); m.all_to_all_single(o, _x(rank, sum(ins)), outs, ins); return o
    out['all_to_all_single_splits'] = _pair(a2as_split, a2as_split)
    def obj(m):
        lst = [None] * ws; m.all_gather_object(lst, {'rank': rank, 'x': [rank] * rank}); return torch.tensor([len(str(lst))])
    out['all_gather_object'] = _pair(obj, obj)
    objs = [[None, None], [None, None]]
    for m, o in zip((dist, tdist), objs):
        if rank == 0: o[:] = ['cfg', {'lr': 0.1}]
        m.broadcast_object_list(o, src=0)
    out['broadcast_object_list'] = (str(objs[0]), str(objs[1]))
    return out

def _p2p(rank, ws):
    out, nxt, prv = {}, (rank + 1) % ws, (rank - 1) % ws
    def ring(m):  # blocking send/recv around the ring; even ranks send first
        o = torch.empty(5)
        if rank % 2 == 0: m.send(_x(rank, 5), nxt); m.recv(o, prv)
        else: m.recv(o, prv); m.send(_x(rank, 5), nxt)
        return o
    out['send_recv'] = _pair(ring, ring)
    def any_source(m):  # recv returns the sender's rank, as torch's does
        o = torch.empty(2)
        if rank == 0: return torch.tensor([float(m.recv(o, src=1))])
        if rank == 1: m.send(_x(rank, 2), 0)
        return torch.tensor([-1.])
    out['recv_returns_sender'] = _pair(any_source, any_source)
    assert rank != 0 or out['recv_returns_sender'][0] == [1.0]
    def iring(m):
        o = torch.empty(5)
        works = [m.isend(_x(rank, 5), nxt), m.irecv(o, prv)]
        for w in works: w.wait()
        return o
    out['isend_irecv'] = _pair(iring, iring)
    def batch(m):
        o = torch.empty(5)
        ops = [m.P2POp(m.isend, _x(rank, 5), nxt), m.P2POp(m.irecv, o, prv)]
        for w in m.batch_isend_irecv(ops): w.wait()
        return o
    out['batch_isend_irecv'] = _pair(batch, batch)
    o = torch.empty(5)  # flexrt also takes torch's own P2POp
    for w in dist.batch_isend_irecv([tdist.P2POp(tdist.isend, _x(rank, 5), nxt), tdist.P2POp(tdist.irecv, o, prv)]): w.wait()
    out['batch_torch_p2pop'] = (o.tolist(), out['batch_isend_irecv'][1])
    return out

@pytest.mark.parametrize('ws', [2, 4])
@pytest.mark.parametrize('part', [_reductions, _gathers, _p2p])
def test_ops_match_torch(part, ws):
    for rank, res in enumerate(run_distributed(part, ws)):
        for name, (ours, theirs) in res.items(): assert ours == theirs, f"{name} on rank {rank}: {ours} != {theirs}"

def _async(rank, ws):
    "async_op=True returns a work handle; results after wait() equal torch's"
    t, ref = _x(rank), _x(rank)
    w = dist.all_reduce(t, async_op=True)
    assert not isinstance(w, type(None)) and hasattr(w, 'wait')
    tdist.all_reduce(ref); w.wait()
    o, ro = torch.empty(ws * 6), torch.empty(ws * 6)
    dist.all_gather_into_tensor(o, _x(rank), async_op=True).wait(); tdist.all_gather_into_tensor(ro, _x(rank))
    b = _x(rank); dist.broadcast(b, 0, async_op=True).wait()
    dist.barrier(async_op=True).wait()
    return t.tolist() == ref.tolist() and o.tolist() == ro.tolist() and b.tolist() == _x(0).tolist()

def test_async_ops():
    assert run_distributed(_async, 2) == [True, True]

def _subgroups(rank, ws):
    "Ops on a subgroup reach only its members; ranks map back with get_global_rank"
    evens, odds = dist.new_group([0, 2]), dist.new_group([1, 3])
    mine = evens if rank % 2 == 0 else odds
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mine)
    o = torch.empty(2); dist.all_gather_into_tensor(o, torch.tensor([float(rank)]), group=mine)
    return t.item(), o.tolist(), dist.get_world_size(mine), dist.get_rank(mine), dist.get_global_rank(mine, 1)

def test_subgroups():
    assert run_distributed(_subgroups, 4) == [
        (2.0, [0.0, 2.0], 2, 0, 2), (4.0, [1.0, 3.0], 2, 0, 3), (2.0, [0.0, 2.0], 2, 1, 2), (4.0, [1.0, 3.0], 2, 1, 3)]

def _isend_nonblocking(rank, ws):
    "isend/irecv return before the transfer: the receiver posts irecv, then the sender sends much later"
    import time
    if rank == 0:
        o = torch.zeros(3)
        w = dist.irecv(o, 1)
        done_at_issue = w.is_completed()
        dist.barrier()  # rank 1 sends only after this barrier, so irecv must not have blocked
        w.wait()
        return done_at_issue, o.tolist()
    dist.barrier()
    dist.isend(torch.tensor([1., 2., 3.]), 0).wait()
    return None, None

def test_isend_irecv_do_not_block():
    assert run_distributed(_isend_nonblocking, 2)[0] == (False, [1.0, 2.0, 3.0])

# ---- the drop-in promise: torch.distributed's signatures, and DeepSpeed's helpers -------------------------------

def _public_functions():
    import inspect
    return [n for n in dir(dist) if not n.startswith('_') and inspect.isfunction(getattr(dist, n))
            and inspect.isfunction(getattr(tdist, n, None))]

def test_signatures_match_torch():
    "Every flexrt.comm function torch.distributed also has takes torch's parameters, in torch's order"
    import inspect
    names = _public_functions()
    assert {'new_group', 'init_process_group', 'all_reduce', 'batch_isend_irecv', 'get_global_rank'} <= set(names)
    for name in names:
        theirs = [p.name for p in inspect.signature(getattr(tdist, name)).parameters.values() if not p.name.startswith('_')]
        ours = inspect.signature(getattr(dist, name)).parameters.values()
        positional = [p.name for p in ours if p.kind in (p.POSITIONAL_OR_KEYWORD, p.POSITIONAL_ONLY)]
        assert positional == theirs, f"{name}{inspect.signature(getattr(dist, name))} != torch's {theirs}"
        assert not any(p.kind == p.VAR_KEYWORD for p in ours), name  # extras must be named keyword-only parameters

def _positional_new_group(rank, ws):
    g = dist.new_group([0, 1], None, 'gloo')  # torch's positional order: ranks, timeout, backend
    t = torch.tensor([float(rank + 1)]); dist.all_reduce(t, group=g)
    sub = dist.new_group([1, 2]) if ws > 2 else None
    ranks = dist.get_all_ranks_from_group(sub) if rank in (1, 2) else None
    return t.item(), dist.get_all_ranks_from_group(), ranks, dist.has_all_gather_into_tensor(), dist.has_reduce_scatter_tensor()

def test_new_group_positional_and_deepspeed_helpers():
    res = run_distributed(_positional_new_group, 4)
    assert [r[0] for r in res[:2]] == [3.0, 3.0]
    assert all(r[1] == [0, 1, 2, 3] and r[3] and r[4] for r in res)
    assert res[1][2] == res[2][2] == [1, 2]
