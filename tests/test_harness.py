"The multi-rank harness itself: results come back by rank, and failures and hangs are reported, not swallowed."
import re, warnings
import pytest, torch, torch.distributed as tdist
from helpers import run_distributed, pending_finalisers

def _sum_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    tdist.all_reduce(t)
    return t.item()

def test_results_by_rank():
    assert run_distributed(_sum_ranks, 2) == [1.0, 1.0]

def _fail_on_one(rank, world_size):
    # both ranks through init first: otherwise rank 1 can fail and close its connections while rank 0 is still
    # connecting, and rank 0 fails too ("Connection closed by peer"; seen with 3 pytest workers on 2 cores)
    tdist.barrier()
    if rank == 1: raise ValueError('boom on rank 1')
    return rank

def test_error_names_rank():
    with pytest.raises(RuntimeError, match='(?s)ranks 1.*boom on rank 1'):
        run_distributed(_fail_on_one, 2)

def _hang(rank, world_size):
    import time; time.sleep(60)   # the hung rank itself: run_distributed must kill it at its timeout

def test_hang_times_out_showing_where_each_rank_was():
    "A hang no rank reports is started once more (with a warning); the second hang fails, with every rank's stack"
    with pytest.warns(RuntimeWarning, match=r'(?s)ranks \[0, 1\] did not finish.*started once more'):
        with pytest.raises(TimeoutError, match=r'ranks \[0, 1\] did not finish') as hang:
            run_distributed(_hang, 2, timeout=3)
    message = str(hang.value)
    assert 'the second start too' in message
    for rank in (0, 1):   # each rank's own stack, down to the line it hung on
        assert re.search(rf'(?s)--- rank {rank}: its threads at the deadline ---.*line \d+ in _hang', message), message

def _fail_on_zero_hang_on_one(rank, world_size):
    if rank == 0: raise ValueError('boom on rank 0')
    import time; time.sleep(60)

def test_a_hang_beside_a_reported_failure_is_not_started_again():
    "The failure a rank reported is the answer: no second start, and the silent rank's stack is shown with it"
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter('always')
        with pytest.raises(TimeoutError, match=r'(?s)ranks \[1\] did not finish.*boom on rank 0.*in _fail_on_zero'):
            run_distributed(_fail_on_zero_hang_on_one, 2, init=False, timeout=8)
    assert not [w for w in said if 'started once more' in str(w.message)]   # a second start would say so

def _return_tensor(rank, world_size):
    return torch.full((3,), float(rank))

def test_tensor_results_survive_the_rank():
    a, b = run_distributed(_return_tensor, 2)
    assert torch.equal(a, torch.zeros(3)) and torch.equal(b, torch.ones(3))

# --- garbage the worker holds at the fork is finalised in the worker, not in a rank -------------------------------
import gc, os

def _collect_in_rank(rank, world_size):
    gc.collect()                                # as see_memory_usage does: finalisers a rank inherits would run here
    return os.getpid()

def test_the_worker_finalises_its_garbage_before_the_ranks_fork():
    "An unreachable cycle whose finaliser leaves a new one behind: both finalised in the worker before the fork"
    with pending_finalisers(2) as finalisers:   # the cycles stay pending until run_distributed collects
        ranks = run_distributed(_collect_in_rank, 2)
    assert finalisers == [os.getpid()] * 2 and not set(ranks) & set(finalisers), (finalisers, ranks)
