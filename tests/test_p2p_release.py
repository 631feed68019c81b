"""A finished direct-message collective lets go of its tensors at once (its handle may live on), so ZeRO-2 holds a
bucket buffer only while that bucket's reduction runs; the comms logger reports a direct-message op still in flight
by finishing it first (2 gloo ranks)."""
import gc, weakref
import pytest, torch
from helpers import run_distributed

def release_rank(rank, world, threaded):
    from flexrt import comm as dist
    from flexrt.comm.state import comm_state
    comm_state.p2p_threaded = threaded   # either way the tensors go at wait(), not before: peaks do not depend on timing
    inp, out = torch.randn(world * 4), torch.empty(4)
    alive = weakref.ref(inp)
    work = dist.reduce_scatter_tensor_p2p(out, inp, async_op=True)
    del inp; gc.collect()
    before = alive() is not None       # in flight: the handle holds the input it sends
    work.wait(); gc.collect()
    return before, alive() is None

@pytest.mark.parametrize('threaded', [False, True])
def test_a_finished_p2p_handle_holds_no_tensors(threaded):
    for before, after in run_distributed(release_rank, 2, args=(threaded,)):
        assert before and after

def stage2_rank(rank, world):
    "At the end of backward, before reducer.wait(): only the buckets still in flight hold a buffer"
    from flexrt.zero import ZeroStage2
    from flexrt.zero.shard_reducer import _FINISHED
    from flexrt.precision import Precision
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(6)])
    slot = ZeroStage2(model, torch.optim.AdamW(model.parameters()), Precision(), bucket_bytes=32 * 33 * 4)
    slot.set_boundary(True)
    model(torch.randn(4, 32)).square().mean().backward()
    red = slot.reducer
    in_flight = {id(bk) for bk in red._in_flight}
    launched = [bk for bk in red.buckets if bk not in red._queue]
    finished = [bk for bk in launched if id(bk) not in in_flight]
    state = (len(launched), len(in_flight), all(bk.work is _FINISHED and bk.buffer is None for bk in finished),
             all(bk.buffer is not None for bk in red._in_flight))
    slot.reduced_gradients(); slot.close()
    return state

def test_stage2_drops_each_bucket_buffer_when_its_reduction_finished():
    for launched, in_flight, finished_free, flying_held in run_distributed(stage2_rank, 2):
        assert launched == 6 and in_flight == 2 and finished_free and flying_held

def logger_rank(rank, world):
    from flexrt import comm as dist
    dist.configure(enabled=True); dist.reset_log()
    out = torch.empty(world * 3)
    work = dist.all_gather_into_tensor_p2p(out, torch.full((3,), float(rank)), async_op=True)
    stats = dist.get_comm_stats()        # not waited on yet: the report finishes it
    done = work.is_completed()
    work.wait(); dist.configure(enabled=False)
    return sorted(stats), done, out.tolist()

def test_the_comms_logger_reports_a_p2p_op_in_flight():
    for ops, done, out in run_distributed(logger_rank, 2):
        assert ops == ['all_gather_into_tensor_p2p'] and done and out == [0.] * 3 + [1.] * 3
