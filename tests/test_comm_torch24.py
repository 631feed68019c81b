"""flexrt.comm on torch 2.4's torch.distributed signatures (setup.py: torch>=2.4), on 2 real gloo ranks.

torch 2.4's `new_group` has no `device_id`/`sort_ranks` and its `P2POp` no `group_peer` (both came later). Each rank
replaces them with wrappers of exactly torch 2.4's signatures around this torch's own, so handing them a newer
keyword fails as it would there; flexrt's `new_group` and `batch_isend_irecv` must still work and move the data."""
import torch, torch.distributed as tdist
from helpers import run_distributed

def _as_in_torch24(rank, world_size):
    real_new_group, real_p2p = tdist.new_group, tdist.P2POp
    def new_group(ranks=None, timeout=None, backend=None, pg_options=None, use_local_synchronization=False, group_desc=None):
        return real_new_group(ranks, timeout=timeout, backend=backend, pg_options=pg_options,
                              use_local_synchronization=use_local_synchronization, group_desc=group_desc)
    class P2POp(real_p2p):
        def __new__(cls, op, tensor, peer, group=None, tag=0): return real_p2p.__new__(cls, op, tensor, peer, group, tag)
        def __init__(self, op, tensor, peer, group=None, tag=0): super().__init__(op, tensor, peer, group, tag)
    tdist.new_group, tdist.P2POp = new_group, P2POp
    try:
        from flexrt import comm as dist
        group = dist.new_group([0, 1])
        t = torch.full((3,), float(rank + 1)); dist.all_reduce(t, group=group)
        peer, got = 1 - rank, torch.empty(4)
        ops = [dist.P2POp(dist.isend, torch.arange(4.) + 10 * rank, peer), dist.P2POp(dist.irecv, got, peer)]
        for w in dist.batch_isend_irecv(ops): w.wait()
        dist.destroy_process_group(group)
        return t.tolist(), got.tolist()
    finally:
        tdist.new_group, tdist.P2POp = real_new_group, real_p2p

def test_new_group_and_batched_p2p_on_torch24_signatures():
    results = run_distributed(_as_in_torch24, world_size=2)
    assert results[0] == ([3., 3., 3.], [10., 11., 12., 13.])
    assert results[1] == ([3., 3., 3.], [0., 1., 2., 3.])
