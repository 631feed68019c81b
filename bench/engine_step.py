"""Training step time on 2 gloo ranks: DDP vs flexrt (ZeRO stages 0-3) vs DeepSpeed (same stages) vs FSDP2, interleaved.

    python bench/engine_step.py [--workload gpt,mlp] [--stages 0,1,2,3] [--quick] [--rounds 12] [--steps 2]
                                [--impls NAME,...] [--baseline REV] [--layers 4] [--dim 192] [--vocab 2048] [--seq 64] [--batch 8]
                                [--mlp-layers 8] [--mlp-width 1024] [--mlp-batch 4]

Two workloads, each measured in its own run of interleaved rounds, fp32, torch's AdamW, no clipping, one
micro-batch per step, every implementation training its own copy of the same initial model on the same batches:

- gpt (compute-bound): a small GPT-style model (tied embedding and head, pre-norm blocks, causal attention).
- mlp (communication-bound): `--mlp-layers` Linear(width, width) + GELU layers and a micro-batch of `--mlp-batch`
  rows per rank: little compute per parameter, so the step time is mostly gradient and parameter traffic.

Implementations (`--impls` picks some; `--stages` keeps those of the listed ZeRO stages, DDP always):

- ddp: torch.nn.parallel.DistributedDataParallel (defaults: a 1 MiB first bucket, then 25 MiB ones).
- flexrt-reducer: a plain loop with flexrt.zero.reducer.GradientReducer (bucketed all-reduce overlapping backward),
  the engine's stage 0 without the engine around it.
- flexrt-z0 .. flexrt-z3: flexrt.initialize(...) with zero_optimization.stage 0..3 (`ds_config`). At stage 3 the
  GPT's tied head (the root's forward reads `tok.weight`) is detected by both engines: no model change.
  On gloo flexrt's stages 1/2 run their reduce-scatter and all-gather as direct messages
  (`flexrt.comm.reduce_scatter_tensor_p2p`, `all_gather_into_tensor_p2p`: faster there than gloo's own ops; see
  `flexrt.zero.shard_reducer.ShardReducer`).
- flexrt-z1-ar, flexrt-z2-ar (not run by default): zero_optimization.reduce_scatter=false, DeepSpeed's switch to
  all-reduce the gradients and keep the rank's chunk.
- deepspeed-z0 .. deepspeed-z3: deepspeed.initialize(...) with the same config on CPU (DS_ACCELERATOR=cpu).
- fsdp2, fsdp2-noreshard: torch.distributed.fsdp.fully_shard on every block/layer and the root;
  `reshard_after_forward=True` (parameters partitioned between uses: ZeRO-3) or False (kept gathered from forward
  to backward: ZeRO-2-like).
- no-comm: the same loop with no communication at all, the floor every implementation pays.
- baseline-z0 .. baseline-z3 (with `--baseline REV`): flexrt as it was at git revision REV, imported in the same
  ranks under the name `flexrt_baseline` (its `flexrt/` tree copied from git and renamed), so a change is measured
  against the code before it in one interleaved run; each flexrt-zN then also prints its paired ratio to baseline-zN.

Both engines get the same config (gradient_clipping 0, overlap_comm true, reduce_bucket_size `--bucket` elements:
4M = 16 MiB of fp32 by default, between DDP's 1 MiB first and 25 MiB later buckets).
flexrt's engine still computes the global gradient norm every step (get_global_grad_norm() reports it); DeepSpeed
at clipping 0 does not: like with like, flexrt carries one norm pass more.
On CPU the first flexrt engine built fixes glibc's malloc thresholds for the process (`flexrt.memory.tune_cpu_malloc`:
buffers under 32 MiB come from the heap and are reused, instead of being mapped and faulted in anew each step). All
implementations share the rank's process, so DDP, DeepSpeed and FSDP2 run with the same setting: the comparison
stays like with like. Set MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_ to run every implementation with your own.

Each round runs every implementation for `--steps` steps; the order alternates between rounds (the machine's speed
drifts, and other processes share its cores), round 0 only warms up. Printed per implementation: the median step
time (rank 0's clock, averaged over the steps of a round), the paired ratio to DDP (median over rounds of its time /
DDP's time in the same round, which cancels drift between rounds), the CPU time rank 0's process spent per step (all
threads, gloo's included) and its paired ratio to DDP's, the paired ratio against DeepSpeed's same stage and
against FSDP2 of the same kind (below 1: faster), and the largest difference of its losses from DDP's over the run
(same batches, same initial weights: they must agree).
Each implementation is one `build_*` function returning `step(inputs, targets) -> loss`; adding one is a function.
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

class MLP(nn.Module):
    "Many wide layers: the communication-bound workload"
    def __init__(self, width, layers):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
    def forward(self, x):
        for layer in self.layers: x = F.gelu(layer(x))
        return x

def make_model(args):
    torch.manual_seed(0)
    if args.workload == 'mlp': return MLP(args.mlp_width, args.mlp_layers)
    return GPT(args.vocab, args.dim, args.layers, args.heads, args.seq)

def blocks(model): return list(model.layers if isinstance(model, MLP) else model.blocks)

def loss_of(out, targets):
    "Next-token cross-entropy for the GPT, mean squared error for the MLP"
    if targets.dtype == torch.long: return F.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))
    return F.mse_loss(out, targets)

def batch(step, rank, args):
    g = torch.Generator().manual_seed(1000 * step + rank)
    if args.workload == 'mlp':
        return torch.randn(args.mlp_batch, args.mlp_width, generator=g), torch.randn(args.mlp_batch, args.mlp_width, generator=g)
    tokens = torch.randint(args.vocab, (args.batch, args.seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]

def adamw(model): return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)

def ds_config(args, stage=0, **zero):
    micro = args.mlp_batch if args.workload == 'mlp' else args.batch
    return {'train_micro_batch_size_per_gpu': micro, 'gradient_accumulation_steps': 1, 'gradient_clipping': 0.0,
            'zero_optimization': {'stage': stage, 'overlap_comm': True, 'reduce_bucket_size': args.bucket, **zero},
            'zero_allow_untested_optimizer': True, 'steps_per_print': 10 ** 9, 'wall_clock_breakdown': False}

# ---------------------------------------------------------------- the implementations: model -> step(inputs, targets)
def torch_step(model, opt):
    "A plain torch training step over `model` (a DDP or FSDP2 wrapper communicates inside backward)"
    def step(x, y):
        loss = loss_of(model(x), y); loss.backward()
        opt.step(); opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step

def build_ddp(model, args):
    return torch_step(nn.parallel.DistributedDataParallel(model), adamw(model))

def build_flexrt_reducer(model, args):
    from flexrt.zero.reducer import GradientReducer
    reducer, opt = GradientReducer(model.parameters()), adamw(model)
    def step(x, y):
        reducer.set_boundary(True)
        loss = loss_of(model(x), y); loss.backward(); reducer.wait()
        opt.step(); reducer.zero_grad()
        return loss.detach()
    return step

def engine_step(engine):
    def step(x, y):
        loss = loss_of(engine(x), y); engine.backward(loss); engine.step()
        return loss.detach()
    return step

def build_flexrt(stage, **zero):
    def build(model, args):
        import flexrt
        engine, *_ = flexrt.initialize(model=model, optimizer=adamw(model), config=ds_config(args, stage, **zero))
        return engine_step(engine)
    return build

def build_baseline(stage):
    def build(model, args):
        import flexrt_baseline
        engine, *_ = flexrt_baseline.initialize(model=model, optimizer=adamw(model), config=ds_config(args, stage))
        return engine_step(engine)
    return build

def export_baseline(rev:str)->str:
    "A directory holding git revision `rev`'s flexrt/ as the package `flexrt_baseline` (its own name rewritten)"
    import re, subprocess, tarfile, tempfile, io
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tree = subprocess.run(['git', 'archive', rev, 'flexrt'], cwd=root, capture_output=True)
    if tree.returncode: raise SystemExit(f"--baseline {rev}: git archive failed: {tree.stderr.decode().strip()}")
    out = tempfile.mkdtemp(prefix='flexrt-baseline-')
    with tarfile.open(fileobj=io.BytesIO(tree.stdout)) as tar: tar.extractall(out, filter='data')
    os.rename(os.path.join(out, 'flexrt'), os.path.join(out, 'flexrt_baseline'))
    for folder, _, files in os.walk(os.path.join(out, 'flexrt_baseline')):
        for f in files:
            if f.endswith('.py'):
                path = os.path.join(folder, f)
                with open(path) as fh: text = fh.read()
                with open(path, 'w') as fh: fh.write(re.sub(r'\bflexrt\b(?!_)', 'flexrt_baseline', text))
    return out

def build_deepspeed(stage):
    def build(model, args):
        import deepspeed
        deepspeed.utils.logger.setLevel(logging.WARNING)
        # memory_efficient_linear off: DeepSpeed's stage 3 would otherwise replace torch.nn.functional.linear for the
        # whole process ("persists unless manually reset") and every other implementation's layers would run through it
        extra = {'memory_efficient_linear': False} if stage == 3 else {}
        engine, *_ = deepspeed.initialize(model=model, optimizer=adamw(model), config=ds_config(args, stage, **extra))
        return engine_step(engine)
    return build

def build_fsdp2(reshard):
    def build(model, args):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh('cpu', (tdist.get_world_size(),))
        for block in blocks(model): fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        return torch_step(model, adamw(model))
    return build

def build_no_comm(model, args):
    return torch_step(model, adamw(model))

BUILDERS = {'ddp': build_ddp, 'flexrt-reducer': build_flexrt_reducer,
            **{f'flexrt-z{s}': build_flexrt(s) for s in range(4)},
            'flexrt-z1-ar': build_flexrt(1, reduce_scatter=False), 'flexrt-z2-ar': build_flexrt(2, reduce_scatter=False),
            **{f'deepspeed-z{s}': build_deepspeed(s) for s in range(4)},
            **{f'baseline-z{s}': build_baseline(s) for s in range(4)},
            'fsdp2': build_fsdp2(True), 'fsdp2-noreshard': build_fsdp2(False), 'no-comm': build_no_comm}

def stage_of(name):
    "The ZeRO stage an implementation runs (None: DDP and the no-communication floor)"
    if name == 'flexrt-reducer': return 0
    if name.startswith(('flexrt-z', 'deepspeed-z', 'baseline-z')): return int(name.split('-z')[1][0])
    if name.startswith('fsdp2'): return 3 if name == 'fsdp2' else 2
    return None

def peers(name):
    "(DeepSpeed's same stage, FSDP2 of the same kind) to compare a flexrt implementation with"
    s = stage_of(name)
    if not name.startswith('flexrt') or s is None: return None, None
    return f'deepspeed-z{s}', ('fsdp2' if s == 3 else 'fsdp2-noreshard' if s else None)

def available(names):
    "The requested implementations that can run here, and why the others cannot"
    out, missing = [], {}
    for name in names:
        if name not in BUILDERS: raise SystemExit(f"unknown implementation {name!r}: choose from {', '.join(BUILDERS)}")
        if name.startswith('deepspeed'):
            try: import deepspeed  # noqa: F401
            except ImportError: missing[name] = 'not installed (pip install deepspeed)'; continue
        out.append(name)
    return out, missing

# ---------------------------------------------------------------- one rank
def worker(rank, world, port, args, names):
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(args.threads)
    if args.baseline_dir: sys.path.insert(0, args.baseline_dir)
    warnings.filterwarnings('ignore')
    logging.disable(logging.WARNING)
    tdist.init_process_group('gloo', rank=rank, world_size=world)
    base = make_model(args)
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

def paired(xs, ys):
    "Median over rounds of x / y in the same round: cancels drift between rounds"
    return statistics.median(x / y for x, y in zip(xs, ys))

def describe(model, args):
    numel = sum(p.numel() for p in model.parameters())
    size = f"{numel / 1e6:.2f}M params ({numel * 4 / 2**20:.1f} MiB of fp32 gradients)"
    if args.workload == 'mlp':
        what = f"MLP: {args.mlp_layers} x Linear({args.mlp_width}, {args.mlp_width}), micro-batch {args.mlp_batch}/rank"
    else:
        what = (f"GPT: {args.layers} layers, dim {args.dim}, {args.heads} heads, vocab {args.vocab}, seq {args.seq}, "
                f"micro-batch {args.batch}/rank")
    return f"{what}: {size}; 2 gloo ranks x {args.threads} thread; {args.rounds} rounds x {args.steps} steps, order alternating"

def report(times, cpu, losses, model, args):
    print(describe(model, args))
    med, base = statistics.median, 'ddp'
    baseline = any(n.startswith('baseline-') for n in times)
    print(f"  {'':16s} {'median':>9s}  vs DDP  {'cpu':>8s}  cpu vs DDP   vs DeepSpeed  vs FSDP2   max |loss - DDP's|"
          + ("   vs baseline (cpu)" if baseline else ''))
    for name, ts in times.items():
        ds, fsdp = peers(name)
        vs = lambda other: f"{paired(ts, times[other]):8.2f}x" if other in times else ' ' * 9
        drift = ('n/a (no averaging)' if name == 'no-comm' else
                 f"{max(abs(a - b) for a, b in zip(losses[name], losses[base])):.1e}")
        print(f"  {name:16s} {med(ts) * 1e3:6.1f} ms {paired(ts, times[base]):6.2f}x {med(cpu[name]) * 1e3:6.1f} ms "
              f"{paired(cpu[name], cpu[base]):8.2f}x    {vs(ds)}   {vs(fsdp)}   {drift:18s}"
              + (against_baseline(name, times, cpu) if baseline else ''))
    print("  all ratios paired: median over rounds of (this implementation's time / the other's in the same round); "
          "vs DeepSpeed: its same stage; vs FSDP2: fsdp2 for stage 3, fsdp2-noreshard for stages 1-2")

def against_baseline(name, times, cpu)->str:
    "flexrt-zN's paired ratios to baseline-zN (time and cpu), or nothing"
    other = name.replace('flexrt-z', 'baseline-z')
    if not name.startswith('flexrt-z') or other not in times: return ''
    return f"   {paired(times[name], times[other]):6.3f}x ({paired(cpu[name], cpu[other]):.3f}x)"

DEFAULT_IMPLS = ['ddp', 'flexrt-reducer', 'flexrt-z0', 'deepspeed-z0', 'flexrt-z1', 'deepspeed-z1',
                 'flexrt-z2', 'deepspeed-z2', 'fsdp2-noreshard', 'flexrt-z3', 'deepspeed-z3', 'fsdp2', 'no-comm']

def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--workload', default='gpt,mlp', help='comma-separated: gpt (compute-bound), mlp (communication-bound)')
    ap.add_argument('--stages', default='0,1,2,3', help='ZeRO stages to run (DDP always runs)')
    ap.add_argument('--quick', action='store_true', help='6 rounds instead of --rounds')
    ap.add_argument('--rounds', type=int, default=12)
    ap.add_argument('--steps', type=int, default=2, help='steps per implementation per round')
    ap.add_argument('--layers', type=int, default=4)
    ap.add_argument('--dim', type=int, default=192)
    ap.add_argument('--heads', type=int, default=4)
    ap.add_argument('--vocab', type=int, default=2048)
    ap.add_argument('--seq', type=int, default=64)
    ap.add_argument('--batch', type=int, default=8, help='GPT micro-batch per rank')
    ap.add_argument('--mlp-layers', type=int, default=8)
    ap.add_argument('--mlp-width', type=int, default=1024)
    ap.add_argument('--mlp-batch', type=int, default=4, help='MLP micro-batch per rank')
    ap.add_argument('--threads', type=int, default=1, help='torch threads per rank')
    ap.add_argument('--bucket', type=int, default=2 ** 22, help="engines' reduce_bucket_size, in elements")
    ap.add_argument('--impls', default=','.join(DEFAULT_IMPLS))
    ap.add_argument('--baseline', default=None, metavar='REV',
                    help='also run flexrt as of git revision REV (baseline-zN next to each flexrt-zN), e.g. HEAD~1')
    args = ap.parse_args()
    if args.quick: args.rounds = 6
    stages = {int(s) for s in args.stages.split(',')}
    wanted = [n for n in args.impls.split(',') if n == 'ddp' or stage_of(n) is None or stage_of(n) in stages]
    if 'ddp' not in wanted: wanted.insert(0, 'ddp')   # every ratio is against DDP
    args.baseline_dir = None
    if args.baseline:
        args.baseline_dir = export_baseline(args.baseline)
        wanted = [m for n in wanted for m in ([n, f'baseline-z{stage_of(n)}'] if n.startswith('flexrt-z') and n[-1].isdigit() else [n])]
    names, missing = available(wanted)
    for name, why in missing.items(): print(f"{name}: skipped, {why}")
    for workload in args.workload.split(','):
        if workload not in ('gpt', 'mlp'): raise SystemExit(f"unknown workload {workload!r}: choose gpt or mlp")
        args.workload = workload
        with socket.socket() as s: s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]
        mp.spawn(worker, args=(2, port, args, names), nprocs=2)

if __name__ == '__main__':
    sys.exit(main())
