"The multi-rank harness itself: results come back by rank, and failures and hangs are reported, not swallowed."
import pytest, torch, torch.distributed as tdist
from helpers import run_distributed

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

def test_hang_times_out():
    with pytest.raises(TimeoutError, match=r'ranks \[0, 1\]'):
        run_distributed(_hang, 2, timeout=3)

def _return_tensor(rank, world_size):
    return torch.full((3,), float(rank))

def test_tensor_results_survive_the_rank():
    a, b = run_distributed(_return_tensor, 2)
    assert torch.equal(a, torch.zeros(3)) and torch.equal(b, torch.ones(3))
