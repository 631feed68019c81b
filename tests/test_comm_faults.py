"""Fallbacks (forced on gloo, which has every op) give torch's native result, warn once naming the op, and are logged
under the op's own name. Collectives that cannot complete raise within the timeout, naming op, rank and group; the
direct-message ops (flexrt.comm.p2p) also name the peers that never answered, and flexrt.launch blames those."""
import os, warnings
from datetime import timedelta
import pytest, torch, torch.distributed as tdist
from helpers import run_distributed
from flexrt import comm as dist
from flexrt.comm.backends import TorchBackend

def _x(rank, n): return torch.arange(n, dtype=torch.float32) * (rank + 1) + 10 * rank

def _run_op(op, rank, ws, m):
    "Call `op` through module `m` (flexrt.comm or torch.distributed) on fixed data; the result as lists"
    if op == 'all_gather_into_tensor':
        o = torch.empty(ws * 2, 3); m.all_gather_into_tensor(o, _x(rank, 6).view(2, 3)); return o.tolist()
    if op == 'reduce_scatter_tensor':
        o = torch.empty(3); m.reduce_scatter_tensor(o, _x(rank, 3 * ws), m.ReduceOp.MAX); return o.tolist()
    if op == 'reduce_scatter':
        o = torch.empty(2); m.reduce_scatter(o, [_x(rank, 2) * (i + 1) for i in range(ws)]); return o.tolist()
    if op == 'all_to_all':
        outs = [torch.empty(3) for _ in range(ws)]; m.all_to_all(outs, [_x(rank, 3) + 100 * j for j in range(ws)])
        return [t.tolist() for t in outs]
    if op == 'all_to_all_single/even':
        o = torch.empty(2 * ws); m.all_to_all_single(o, _x(rank, 2 * ws)); return o.tolist()
    if op == 'all_to_all_single':  # uneven splits
        ins, outs = [j + 1 for j in range(ws)], [rank + 1] * ws
        o = torch.empty(sum(outs)); m.all_to_all_single(o, _x(rank, sum(ins)), outs, ins); return o.tolist()
    raise ValueError(op)

def _forced(rank, ws, missing, op):
    dist.set_comm_backend(TorchBackend(unsupported=missing))
    dist.configure(enabled=True, prof_all=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        ours = [_run_op(op, rank, ws, dist) for _ in range(2)]  # twice: the warning comes once
    theirs = _run_op(op, rank, ws, tdist)
    warned = sorted(str(w.message).split(' has no ')[1].split(';')[0] for w in caught if 'flexrt.comm' in str(w.message))
    logged = {o: sum(v['count'] for v in sizes.values()) for o, sizes in dist.get_comm_stats().items()}
    return ours == [theirs, theirs], warned, logged

FORCED = [  # (ops marked missing, op called, fallback chain expected in the warnings)
    (['all_gather_into_tensor'], 'all_gather_into_tensor'),
    (['reduce_scatter_tensor'], 'reduce_scatter_tensor'),
    (['reduce_scatter_tensor', 'reduce_scatter'], 'reduce_scatter_tensor'),  # -> list form -> all_reduce + slice
    (['reduce_scatter'], 'reduce_scatter'),
    (['all_to_all'], 'all_to_all'),
    (['all_to_all_single'], 'all_to_all_single'),
    (['all_to_all_single'], 'all_to_all_single/even'),
    (['all_to_all_single', 'all_to_all'], 'all_to_all_single/even'),  # -> list form -> isend/irecv
]

@pytest.mark.parametrize('ws', [2, 4])
@pytest.mark.parametrize('missing,op', FORCED)
def test_forced_fallback(missing, op, ws):
    for equal, warned, logged in run_distributed(_forced, ws, args=(missing, op)):
        assert equal
        assert warned == sorted(missing)  # once per missing op on the way, naming it
        assert logged == {op.split('/')[0]: 2}  # under the op's own name, not the ops it was rebuilt from

def _async_fallback(rank, ws):
    dist.set_comm_backend(TorchBackend(unsupported=['all_gather_into_tensor']))
    o = torch.empty(ws)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        w = dist.all_gather_into_tensor(o, torch.tensor([rank + 1.]), async_op=True)
    return w.is_completed(), w.wait(), o.tolist()

def test_async_op_under_fallback():
    assert run_distributed(_async_fallback, 2) == [(True, True, [1., 2.])] * 2

def _fallback_subgroup(rank, ws):
    "The p2p fallback maps group ranks to global ranks"
    dist.set_comm_backend(TorchBackend(unsupported=['all_to_all']))
    evens, odds = dist.new_group([0, 2]), dist.new_group([1, 3])  # every rank creates every group, in order
    g = odds if rank % 2 else evens
    outs = [torch.empty(1), torch.empty(1)]
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        dist.all_to_all(outs, [torch.tensor([10. * rank + j]) for j in range(2)], group=g)
    return [t.item() for t in outs]

def test_fallback_on_subgroup():
    assert run_distributed(_fallback_subgroup, 4) == [[0., 20.], [10., 30.], [1., 21.], [11., 31.]]

# ---- timeouts and dead peers -------------------------------------------------------------------------------------

def _skip_collective(rank, ws, async_op, subgroup, raised):
    dist.init_distributed(timeout=timedelta(seconds=2))
    group = dist.new_group([0, 1]) if subgroup else None
    if rank == 1:
        raised.wait(60)  # never calls the all_reduce; stays until rank 0 gave up on it (leaving would be another failure)
        return None
    try:
        w = dist.all_reduce(torch.ones(3), group=group, async_op=async_op)
        if async_op: w.wait()
    except dist.CommTimeoutError as e:
        return type(e).__name__, str(e)
    finally: raised.set()
    return 'no error', ''

@pytest.mark.parametrize('async_op,subgroup', [(False, False), (True, True)])
def test_skipped_collective_times_out(async_op, subgroup):
    "Raised at all (run_distributed's own timeout fails a hang), and naming op, timeout, rank and group"
    name, msg = run_distributed(_skip_collective, 2, args=(async_op, subgroup, _fork_event()), init=False)[0]
    assert name == 'CommTimeoutError'
    group = r"'\S+' \(ranks \[0, 1\], backend gloo\)" if subgroup else r'WORLD \(ranks \[0, 1\], backend gloo\)'
    import re
    assert re.search(rf"all_reduce did not complete within the timeout of 2s on rank 0 in group {group}", msg), msg

def _peer_leaves(rank, ws, entering):
    dist.init_distributed(timeout=timedelta(seconds=20))
    if rank == 1:
        entering.wait(60)   # ordering aid: rank 0 is about to enter its all_reduce (either way it must raise)
        tdist.destroy_process_group()  # closes its connections while rank 0 waits in a collective
        return None
    entering.set()
    try: dist.all_reduce(torch.ones(3))
    except dist.CommError as e: return str(e)
    return 'no error'

def _fork_event():
    "An event the forked ranks of run_distributed share"
    import multiprocessing as mp
    return mp.get_context('fork').Event()

def test_dead_peer_names_op():
    msg = run_distributed(_peer_leaves, 2, args=(_fork_event(),), init=False)[0]
    assert msg.startswith('all_reduce did not complete') and 'rank 0 in group WORLD' in msg, msg

def _user_error_passes_through(rank, ws):
    try: dist.all_gather_into_tensor(torch.empty(3), torch.ones(2))
    except dist.CommError: return 'wrapped'
    except (ValueError, RuntimeError) as e: return type(e).__name__
    return 'no error'

def test_user_errors_are_not_comm_errors():
    assert all(r in ('ValueError', 'RuntimeError') for r in run_distributed(_user_error_passes_through, 2))

# ---- learning that a backend lacks an op: only from its own error, per group, forgotten on destroy -------------

class NoAllToAll(TorchBackend):
    "gloo wrapped as a backend without alltoall: its native call raises c10d's own error for a missing op"
    @staticmethod
    def _native_all_to_all(*args): raise RuntimeError(f'Backend {tdist.get_backend()} does not support alltoall')

class DtypeTrouble(TorchBackend):
    "A native call failing for another reason, whose message also says 'not supported'"
    @staticmethod
    def _native_all_to_all(*args): raise RuntimeError('alltoall: complex dtype is not supported by this build')

def _learned(rank, ws):
    out, b = {}, NoAllToAll()
    dist.set_comm_backend(b)
    outs = [torch.empty(1) for _ in range(ws)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        for _ in range(2): dist.all_to_all(outs, [torch.tensor([10. * rank + j]) for j in range(ws)])
    theirs = [torch.empty(1) for _ in range(ws)]
    tdist.all_to_all(theirs, [torch.tensor([10. * rank + j]) for j in range(ws)])
    out['result'] = [t.item() for t in outs] == [t.item() for t in theirs]
    out['warnings'] = sum('has no all_to_all' in str(w.message) for w in caught)
    out['missing'] = sorted(b.missing)
    sub = dist.new_group([0, 1])
    out['subgroup_missing'] = sorted(b.missing_ops(sub))  # learned on WORLD only
    dist.set_comm_backend(DtypeTrouble())
    try: dist.all_to_all(outs, [torch.ones(1)] * ws)
    except RuntimeError as e: out['other_error'] = str(e)
    out['other_missing'] = sorted(dist.get_comm_backend().missing)
    dist.set_comm_backend(b)
    port = os.environ['MASTER_PORT']
    dist.destroy_process_group()                 # forgets ...
    os.environ['MASTER_PORT'] = str(int(port) + 1)
    tdist.init_process_group('gloo', rank=rank, world_size=ws)
    dist.set_comm_backend(b)
    out['after_reinit'] = sorted(b.missing)      # ... and the new group starts from nothing
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        dist.all_to_all(outs, [torch.tensor([1.])] * ws)
    out['warned_again'] = sum('has no all_to_all' in str(w.message) for w in caught)
    return out

def test_missing_op_learned_per_group_and_forgotten():
    for out in run_distributed(_learned, 2):
        assert out['result'] and out['warnings'] == 1 and out['missing'] == ['all_to_all']
        assert out['subgroup_missing'] == []
        assert 'complex dtype' in out['other_error'] and out['other_missing'] == []
        assert out['after_reinit'] == [] and out['warned_again'] == 1

# ---- direct-message ops (flexrt.comm.p2p): the error names the peers that never answered ---------------------------

def _skip_p2p(rank, ws, op, async_op, threaded, answered):
    "Rank 1 never calls `op`; it stays (on `answered`, a semaphore the ranks share) until every other rank has raised"
    from flexrt.comm.state import comm_state
    dist.init_distributed(timeout=timedelta(seconds=60))
    dist.barrier()   # every rank here: the short timeout times the op, not a slow start (3 ranks on 2 busy cores)
    tdist.group.WORLD.set_timeout(timedelta(seconds=1.5))
    comm_state.p2p_threaded = threaded
    if rank == 1:
        for _ in range(ws - 1): answered.acquire(timeout=60)
        return None
    try:
        if op == 'reduce_scatter_tensor_p2p': w = dist.reduce_scatter_tensor_p2p(torch.empty(2), torch.ones(2 * ws), async_op=async_op)
        else: w = dist.all_gather_into_tensor_p2p(torch.empty(2 * ws), torch.ones(2), async_op=async_op)
        if async_op: w.wait()
    except dist.CommTimeoutError as e: return str(e), e.peers
    finally: answered.release()
    return 'no error', []

@pytest.mark.parametrize('op,ws,async_op,threaded', [
    ('reduce_scatter_tensor_p2p', 2, False, False),    # on the calling thread
    ('reduce_scatter_tensor_p2p', 3, True, True),      # on the group's p2p thread
    ('all_gather_into_tensor_p2p', 3, True, False)])
def test_a_p2p_op_names_the_peer_that_never_answered(op, ws, async_op, threaded):
    import multiprocessing as mp
    results = run_distributed(_skip_p2p, ws, args=(op, async_op, threaded, mp.get_context('fork').Semaphore(0)), init=False)
    for rank in [r for r in range(ws) if r != 1]:
        msg, peers = results[rank]
        assert peers == [1], msg
        assert msg.startswith(f"{op} did not complete within the timeout of 1.5s on rank {rank} in group WORLD"), msg
        assert f"rank 1 never sent or received {op}'s messages" in msg and 'None' not in msg, msg

def hang_in_stage2_step(rank_to_hang=1, after=1, timeout=1, linger=30):
    "A ZeRO stage-2 engine on gloo (its reduce-scatters are direct messages); `rank_to_hang` never enters the backward of step `after`"
    import threading, flexrt
    from flexrt.comm.p2p import P2PThread
    dist.init_distributed(timeout=60)   # start-up at 3 ranks on 2 busy cores can take seconds between two collectives
    dist.comm_state.p2p_threads[None] = P2PThread(linger=linger)   # idle after the step's gathers, still there when the stacks are taken
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    engine, *_ = flexrt.initialize(model=model, config={'train_micro_batch_size_per_gpu': 2, 'steps_per_print': 10**9,
        'optimizer': {'type': 'Adam', 'params': {'lr': 1e-3}}, 'zero_optimization': {'stage': 2}})
    assert engine.optimizer.collectives == 'p2p'
    for step in range(10):
        if step == after: tdist.group.WORLD.set_timeout(timedelta(seconds=timeout))   # the step that hangs: a short one
        loss = engine(torch.randn(2, 8)).square().mean()
        if step == after and dist.get_rank() == rank_to_hang: threading.Event().wait()   # stuck for good, as a real hang
        engine.backward(loss); engine.step()

@pytest.mark.parametrize('num_processes,background', [(2, False), (3, True)])
def test_launch_blames_the_rank_that_never_entered_the_p2p_reduce_scatter(num_processes, background):
    "The hung rank's p2p thread lingers after its gathers: its stack shows that thread inside flexrt.comm, yet it is the one to blame"
    from flexrt import monitor
    from flexrt.launch import launch, RankError
    try:
        with pytest.raises(RankError) as info:
            run = launch(hang_in_stage2_step, num_processes=num_processes, background=background)
            run.wait(120)
    finally: monitor.stop_serving()
    error, others = info.value, [r for r in range(num_processes) if r != 1]
    assert (error.rank, error.op, error.waiting) == (1, 'reduce_scatter_tensor_p2p', others), str(error)
    said = str(error)
    assert said.startswith(f'rank 1 did not arrive at reduce_scatter_tensor_p2p: rank{"s" if len(others) > 1 else ""} {others} waited in it'), said
    assert 'within the timeout of 1s' in said and "rank 1 never sent or received reduce_scatter_tensor_p2p's messages" in said, said
    assert 'within None' not in said
    assert 'in hang_in_stage2_step' in error.traceback                 # where rank 1 was: its own stack
