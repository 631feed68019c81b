"""Training step time of data parallelism (stage 0) on 2 gloo ranks: DDP vs flexrt vs DeepSpeed, interleaved in one run.

    python bench/engine_step.py [--rounds 30] [--steps 2] [--layers 4] [--dim 192] [--vocab 2048] [--seq 64] [--batch 8]
                                [--impls ddp,flexrt-reducer,deepspeed,flexrt-engine,no-comm]

Every implementation trains its own copy of the same small GPT-style model (tied embedding and head, pre-norm
blocks, causal attention) with torch's AdamW, fp32, no clipping, one micro-batch per step, on the same batches:

- ddp: torch.nn.parallel.DistributedDataParallel (defaults: 25 MiB buckets).
- flexrt-reducer: a plain loop with flexrt.reducer.GradientReducer (bucketed all-reduce overlapping backward;
  gradients zeroed in place in the buckets), standing in for the engine's stage 0.
- flexrt-engine: flexrt.initialize(...) with zero_optimization.stage 0, when flexrt has an engine.
- deepspeed: deepspeed.initialize(...) stage 0 on CPU (DS_ACCELERATOR=cpu), when DeepSpeed is installed.
- no-comm: the same loop with no communication at all, the floor every implementation pays.

Each round runs every implementation for `--steps` steps; the order alternates between rounds (the machine's speed
drifts, and other processes share its cores), round 0 only warms up. Printed per implementation: the median and
best step time (rank 0's clock, averaged over the steps of a round), the ratio of its median to DDP's, the paired
ratio (median over rounds of its time / DDP's time in the same round, which cancels drift between rounds), and
the CPU time rank 0's process spent per step (all threads, gloo's included: less sensitive to other processes'
load than wall time), and the largest difference of its losses from DDP's over the run (same batches, same
initial weights: they must agree).
Each implementation is one `build_*` function returning `step(tokens, targets) -> loss`; adding one is a function.
"""
import argparse, copy, logging, math, os, socket, statistics, sys, time, warnings
os.environ.setdefault('DS_ACCELERATOR', 'cpu')   # this bench runs on CPU with gloo
import torch
from torch import nn
import torch.nn.functional as F
import torch.distributed as tdist
import torch.multiprocessing as mp

# ---------------------------------------------------------------- the model
class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.qkv, self.proj = nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.ln2, self.fc, self.out = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(C, 2))
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))

class GPT(nn.Module):
    def __init__(self, vocab, dim, layers, heads, seq):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks: x = block(x)
        return self.ln(x) @ self.tok.weight.T          # head tied to the embedding

def lm_loss(logits, targets): return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

def batch(step, rank, args):
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(args.vocab, (args.batch, args.seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]

def adamw(model): return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)

def ds_config(args):
    return {'train_micro_batch_size_per_gpu': args.batch, 'gradient_accumulation_steps': 1, 'gradient_clipping': 0.0,
            'zero_optimization': {'stage': 0}, 'steps_per_print': 10 ** 9, 'wall_clock_breakdown': False}

# ---------------------------------------------------------------- the implementations: model -> step(tokens, targets)
def build_ddp(model, args):
    ddp, opt = nn.parallel.DistributedDataParallel(model), adamw(model)
    def step(x, y):
        loss = lm_loss(ddp(x), y); loss.backward()
        opt.step(); opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step

def build_flexrt_reducer(model, args):
    from flexrt.reducer import GradientReducer
    reducer, opt = GradientReducer(model.parameters()), adamw(model)
    def step(x, y):
        reducer.set_boundary(True)
        loss = lm_loss(model(x), y); loss.backward(); reducer.wait()
        opt.step(); reducer.zero_grad()
        return loss.detach()
    return step

def build_flexrt_engine(model, args):
    import flexrt
    engine, *_ = flexrt.initialize(model=model, optimizer=adamw(model), config=ds_config(args))
    def step(x, y):
        loss = lm_loss(engine(x), y); engine.backward(loss); engine.step()
        return loss.detach()
    return step

def build_deepspeed(model, args):
    import deepspeed
    deepspeed.utils.logger.setLevel(logging.WARNING)
    engine, *_ = deepspeed.initialize(model=model, optimizer=adamw(model), config=ds_config(args))
    def step(x, y):
        loss = lm_loss(engine(x), y); engine.backward(loss); engine.step()
        return loss.detach()
    return step

def build_no_comm(model, args):
    opt = adamw(model)
    def step(x, y):
        loss = lm_loss(model(x), y); loss.backward()
        opt.step(); opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step

BUILDERS = {'ddp': build_ddp, 'flexrt-reducer': build_flexrt_reducer, 'flexrt-engine': build_flexrt_engine,
            'deepspeed': build_deepspeed, 'no-comm': build_no_comm}

def available(names):
    "The requested implementations that can run here, and why the others cannot"
    out, missing = [], {}
    for name in names:
        if name == 'flexrt-engine':
            import flexrt
            if not hasattr(flexrt, 'initialize'): missing[name] = 'flexrt has no initialize() yet'; continue
        if name == 'deepspeed':
            try: import deepspeed  # noqa: F401
            except ImportError: missing[name] = 'not installed (pip install deepspeed)'; continue
        out.append(name)
    return out, missing

# ---------------------------------------------------------------- one rank
def worker(rank, world, port, args, names):
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(args.threads)
    warnings.filterwarnings('ignore')
    tdist.init_process_group('gloo', rank=rank, world_size=world)
    torch.manual_seed(0)
    base = GPT(args.vocab, args.dim, args.layers, args.heads, args.seq)
    steps = {name: BUILDERS[name](copy.deepcopy(base), args) for name in names}
    times, cpu, losses, counter = {n: [] for n in names}, {n: [] for n in names}, {n: [] for n in names}, {n: 0 for n in names}
    for r in range(args.rounds + 1):
        for name in (names if r % 2 == 0 else names[::-1]):
            tdist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                x, y = batch(counter[name], rank, args); counter[name] += 1
                losses[name].append(float(steps[name](x, y)))
            if r: times[name].append((time.perf_counter() - start) / args.steps)
            if r: cpu[name].append((time.process_time() - cpu_start) / args.steps)
    tdist.barrier()
    if rank == 0: report(times, cpu, losses, base, args)
    tdist.destroy_process_group()

def report(times, cpu, losses, model, args):
    numel = sum(p.numel() for p in model.parameters())
    print(f"GPT: {args.layers} layers, dim {args.dim}, {args.heads} heads, vocab {args.vocab}, seq {args.seq}, "
          f"micro-batch {args.batch}/rank: {numel / 1e6:.2f}M params ({numel * 4 / 2**20:.1f} MiB of fp32 gradients); "
          f"2 gloo ranks x {args.threads} thread; {args.rounds} rounds x {args.steps} steps each, order alternating")
    print(f"  {'':15s} {'median':>9s} {'best':>9s}  median/DDP's  paired ratio   {'cpu':>8s}  cpu/DDP's   max |loss - DDP's|")
    ddp, med = times.get('ddp'), statistics.median
    for name, ts in times.items():
        ratios = (f"{med(ts) / med(ddp):11.2f}x  {med(t / d for t, d in zip(ts, ddp)):11.2f}x" if ddp else ' ' * 26)
        cpu_ratio = f"{med(cpu[name]) / med(cpu['ddp']):8.2f}x" if ddp else ''
        drift = ('n/a (no averaging)' if name == 'no-comm' else
                 f"{max(abs(a - b) for a, b in zip(losses[name], losses['ddp'])):.1e}" if ddp else '')
        print(f"  {name:15s} {med(ts) * 1e3:6.1f} ms {min(ts) * 1e3:6.1f} ms  {ratios}  {med(cpu[name]) * 1e3:5.1f} ms "
              f"{cpu_ratio}    {drift}")
    print("  paired ratio: median over rounds of (step time / DDP's in the same round), which cancels drift between rounds;"
          "\n  cpu: CPU time of rank 0's process per step (all its threads), which other processes' load barely changes")

def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--rounds', type=int, default=30)
    ap.add_argument('--steps', type=int, default=2, help='steps per implementation per round')
    ap.add_argument('--layers', type=int, default=4)
    ap.add_argument('--dim', type=int, default=192)
    ap.add_argument('--heads', type=int, default=4)
    ap.add_argument('--vocab', type=int, default=2048)
    ap.add_argument('--seq', type=int, default=64)
    ap.add_argument('--batch', type=int, default=8, help='micro-batch per rank')
    ap.add_argument('--threads', type=int, default=1, help='torch threads per rank')
    ap.add_argument('--impls', default=','.join(BUILDERS))
    args = ap.parse_args()
    names, missing = available(args.impls.split(','))
    for name, why in missing.items(): print(f"{name}: skipped, {why}")
    with socket.socket() as s: s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]
    mp.spawn(worker, args=(2, port, args, names), nprocs=2)

if __name__ == '__main__':
    sys.exit(main())
