"""A plain torch.distributed data-parallel training script: nothing in it knows about flexrt.

    torchrun --nproc_per_node 2 examples/plain_ddp_train.py

Replace the line `import torch.distributed as dist` with `from flexrt import comm as dist` and it runs unchanged,
with every collective now going through flexrt.comm (profiled when the comms logger is on). tests/test_comm_train.py
runs both versions and checks they train to bit-identical weights.
"""
import torch, torch.nn as nn, torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

def average_gradients(model, world_size):
    "Manual data parallelism: all-reduce each gradient asynchronously, then wait and average"
    works = [dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, async_op=True) for p in model.parameters()]
    for w in works: w.wait()
    for p in model.parameters(): p.grad /= world_size

def main(steps=20, batch=16):
    dist.init_process_group('gloo')
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)  # different on purpose: the broadcast below must make the replicas equal
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    for p in model.parameters(): dist.broadcast(p.data, src=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1234)
    X = torch.randn(512, 8, generator=g); Y = X.sum(1, keepdim=True).sin()
    X, Y = X[rank::world], Y[rank::world]  # this rank's shard
    for step in range(steps):
        idx = torch.arange(step * batch, (step + 1) * batch) % len(X)
        loss = F.mse_loss(model(X[idx]), Y[idx])
        opt.zero_grad(); loss.backward()
        average_gradients(model, world)
        opt.step()
        mean_loss = loss.detach().clone(); dist.all_reduce(mean_loss); mean_loss /= world
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    replicas = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(replicas, flat)
    assert all(torch.equal(r, flat) for r in replicas), "replicas diverged"
    # the same model under DDP, which runs its own bucketed all-reduce on torch's process group
    ddp = DDP(model)
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    F.mse_loss(ddp(X[:batch]), Y[:batch]).backward(); ddp_opt.step()
    report = [None] * world
    dist.all_gather_object(report, {'rank': rank, 'loss': round(mean_loss.item(), 6)})
    checksum = torch.cat([p.detach().flatten() for p in model.parameters()]).double().sum().item()
    if rank == 0: print(f"world {world} loss {mean_loss.item():.8f} checksum {checksum:.10f} report {report}")
    dist.barrier()
    dist.destroy_process_group()

if __name__ == '__main__':
    main()
