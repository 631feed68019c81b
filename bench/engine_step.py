"""Training step time on 2 gloo ranks: DDP vs flexrt (ZeRO stages 0-3) vs DeepSpeed (same stages) vs FSDP2, interleaved.

    python bench/engine_step.py [--workload gpt,mlp] [--stages 0,1,2,3] [--quick] [--rounds 12] [--steps 2]
                                [--impls NAME,...] [--baseline REV] [--config-extra [STAGES:]JSON ...]
                                [--link-rate 10gbit]
                                [--layers 4] [--dim 192] [--vocab 2048] [--seq 64] [--batch 8]
                                [--mlp-layers 8] [--mlp-width 1024] [--mlp-batch 4]
                                [--launcher spawn|torchrun|launch|kernel]
    python bench/engine_step.py --launchers kernel,launch,torchrun [--rounds 8] [--passes 3] [--steps 3]

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
- extra-z0 .. extra-z3 (with `--config-extra JSON`): flexrt-zN with the JSON object merged into its config (nested
  blocks merged key by key), e.g. `--config-extra '{"communication_data_type": "bf16"}'`, so a setting is measured
  against flexrt without it in one interleaved run; each extra-zN prints its paired ratio to flexrt-zN. Given again,
  extra2-zN, extra3-zN, ... (up to 4 settings in one run); a prefix of stages keeps a setting to them, e.g.
  `--config-extra '0,1,2:{"communication_data_type": "bf16"}' --config-extra '3:{"zero_optimization":
  {"zero_quantized_weights": true, "zero_quantized_gradients": true}}'`.

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
(same batches, same initial weights: they must agree). Also the bytes the rank sent per step, read from the kernel
(`/proc/self/io` wchar: what the process wrote with write()/writev(), gloo's sends included; the bench writes nothing
else while timing) for every implementation alike, with its ratio to DDP's; and for flexrt's engines, the bytes of
the messages flexrt's comms logger logged in one more step (its own count, next to the kernel's).

`--link-rate RATE` (e.g. 10gbit): the ranks talk over a link of that bandwidth in each direction instead of the
loopback device, whose memory-speed transfers make communication cost CPU rather than bandwidth
(bench/shaped_link.py: an address per rank on a veth device, a tc token bucket per destination on the loopback;
needs root; the rest of the machine's traffic is untouched, and everything made is removed at the end).
Each implementation is one `build_*` function returning `step(inputs, targets) -> loss`; adding one is a function.

How the ranks start (`--launcher`; bench/launchers.py):
- spawn (default): torch.multiprocessing.spawn from this process, `--threads` (1) set in each rank with
  torch.set_num_threads; each workload is one launch.
- torchrun: `torchrun --nproc_per_node 2` running the rank code as a script (torchrun sets OMP_NUM_THREADS=1 when the
  environment has none); launch: `flexrt.launch(fn, num_processes=2)` from this plain Python process; kernel: a real
  Jupyter kernel (nbclient) whose cell calls `flexrt.launch(fn, num_processes=2)`, the notebook user's exact path.
  These three set no thread count in the ranks (the point is what users get): the report's header says what the
  ranks had, `torch.get_num_threads()` read in each rank on entry and while timing. One launch times every workload.

`--launchers kernel,launch,torchrun` is the notebook path against torchrun in one interleaved run: `--rounds` (8)
rounds of one launch per launcher, the order reversed every other round (kernel, launch, torchrun; then torchrun,
launch, kernel); each launch builds DDP and flexrt's stages 0-3 (`--impls`) for both workloads, runs a warm-up pass,
then `--passes` (3) passes of `--steps` (3) steps per implementation, the order alternating between passes. A launch's
reading of an implementation is rank 0's median over its passes of the mean step time; printed per workload and
implementation: the median reading per launcher, and the ratios kernel/torchrun and launch/torchrun paired by round
(median over rounds of the ratio of the two launches' readings in the same round; quartiles beside it; goal: within
3 %).
Start-up (from the launch call to the ranks entering their function) and set-up (process group, builds, warm-up) are
printed per launcher, and kept out of the step times. On 2 cores the default run takes about 6 minutes.
"""
import argparse, contextlib, copy, json, logging, math, os, socket, statistics, sys, time, warnings
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
    # what the step left in flight (flexrt's stages 1-2 leave the parameters' all-gather running until the next forward
    # needs it; reading the module waits for it): finished before a round's bytes are read, so they count in its round
    step.drain = lambda: engine.module
    return step

def build_flexrt(stage, **zero):
    def build(model, args):
        import flexrt
        engine, *_ = flexrt.initialize(model=model, optimizer=adamw(model), config=ds_config(args, stage, **zero))
        return engine_step(engine)
    return build

def merged(config:dict, extra:dict)->dict:
    "`config` with `extra` laid over it; a block both hold (a dict) is merged key by key"
    out = dict(config)
    for key, value in extra.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out

def extra_name(k:int, stage:int)->str:
    "The implementation of the `k`th `--config-extra` at `stage`: extra-zN, extra2-zN, ..."
    return f"extra{k + 1 if k else ''}-z{stage}"

def extra_index(name:str):
    "`k` of an extra's name (extra-z3: 0, extra2-z3: 1), or None"
    head = name.split('-z')[0]
    if not head.startswith('extra') or not name[-1].isdigit(): return None
    return int(head[5:]) - 1 if head[5:] else 0

def build_extra(stage, k):
    "flexrt-zN with the `k`th `--config-extra` merged into its config"
    def build(model, args):
        import flexrt
        config = merged(ds_config(args, stage), args.config_extra[k][1])
        engine, *_ = flexrt.initialize(model=model, optimizer=adamw(model), config=config)
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

MAX_EXTRAS = 4   # --config-extra given at most this often

BUILDERS = {'ddp': build_ddp, 'flexrt-reducer': build_flexrt_reducer,
            **{f'flexrt-z{s}': build_flexrt(s) for s in range(4)},
            'flexrt-z1-ar': build_flexrt(1, reduce_scatter=False), 'flexrt-z2-ar': build_flexrt(2, reduce_scatter=False),
            **{f'deepspeed-z{s}': build_deepspeed(s) for s in range(4)},
            **{f'baseline-z{s}': build_baseline(s) for s in range(4)},
            **{extra_name(k, s): build_extra(s, k) for k in range(MAX_EXTRAS) for s in range(4)},
            'fsdp2': build_fsdp2(True), 'fsdp2-noreshard': build_fsdp2(False), 'no-comm': build_no_comm}

def stage_of(name):
    "The ZeRO stage an implementation runs (None: DDP and the no-communication floor)"
    if name == 'flexrt-reducer': return 0
    if name.startswith(('flexrt-z', 'deepspeed-z', 'baseline-z')) or extra_index(name) is not None:
        return int(name.split('-z')[1][0])
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
def time_rounds(args, names, rank)->dict:
    "Every implementation built on this rank's process group and timed in rounds of `--steps` steps (round 0 warms up)"
    started = time.perf_counter()
    base = make_model(args)
    steps = {name: BUILDERS[name](copy.deepcopy(base), args) for name in names}
    times, cpu, losses, counter = {n: [] for n in names}, {n: [] for n in names}, {n: [] for n in names}, {n: 0 for n in names}
    sent = {n: [] for n in names}
    threads, setup_s = set(), None
    for r in range(args.rounds + 1):
        for name in (names if r % 2 == 0 else names[::-1]):
            tdist.barrier()
            start, cpu_start, sent_start = time.perf_counter(), time.process_time(), bytes_written()
            for _ in range(args.steps):
                x, y = batch(counter[name], rank, args); counter[name] += 1
                losses[name].append(float(steps[name](x, y)))
            if r: times[name].append((time.perf_counter() - start) / args.steps)
            if r: cpu[name].append((time.process_time() - cpu_start) / args.steps)
            getattr(steps[name], 'drain', lambda: None)()   # after the clocks: its sends land in its own round
            if r and sent_start is not None: sent[name].append((bytes_written() - sent_start) / args.steps)
            threads.add(torch.get_num_threads())   # what the steps ran with (an engine sizes them when built)
        if r == 0: setup_s = time.perf_counter() - started
    tdist.barrier()
    logged = {n: logged_bytes(steps[n], counter[n], rank, args) for n in names if n.startswith(('flexrt-z', 'extra'))}
    return dict(times=times, cpu=cpu, losses=losses, numel=sum(p.numel() for p in base.parameters()),
                threads=sorted(threads), setup_s=setup_s, sent=sent, logged=logged)

def bytes_written():
    "Bytes this process has written with write()/writev() since it started (Linux /proc/self/io `wchar`, every "
    "thread's), or None where there is no such file. gloo sends with writev(): what the rank put on the wire"
    try:
        with open('/proc/self/io') as f:
            return next(int(line.split()[1]) for line in f if line.startswith('wchar:'))
    except OSError: return None

def logged_bytes(step, at:int, rank, args)->int:
    "One more step of a flexrt engine with the comms logger on: the bytes of the messages it logged (its own count)"
    from flexrt import comm
    comm.configure(enabled=True)
    comm.reset_log()
    step(*batch(at, rank, args))
    stats = comm.get_comm_stats()
    comm.configure(enabled=False)
    return sum(size * row['count'] for sizes in stats.values() for size, row in sizes.items())

def quiet(baseline_dir):
    "Warnings and library logging off in a rank; `flexrt_baseline` importable when asked for"
    if baseline_dir: sys.path.insert(0, baseline_dir)
    warnings.filterwarnings('ignore')
    logging.disable(logging.WARNING)

def worker(rank, world, port, args, names):
    "A rank of the in-process mode (`--launcher spawn`): torch.multiprocessing.spawn, `--threads` set here"
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    if args.link_rate: os.environ.update(args.link_env[rank])   # gloo on this rank's shaped address
    torch.set_num_threads(args.threads)
    quiet(args.baseline_dir)
    tdist.init_process_group('gloo', rank=rank, world_size=world)
    got = time_rounds(args, names, rank)
    link = f", over a shaped link of {args.link_rate} per direction" if args.link_rate else ', over loopback'
    if rank == 0:
        report(got, args, f"2 gloo ranks (torch.multiprocessing.spawn) x {args.threads} thread (--threads, set there)"
               + link)
    tdist.destroy_process_group()

def launched_rank(options:dict, names:list, workloads:list)->dict:
    "A rank started by torchrun, flexrt.launch or a kernel: no thread count of its own; every workload, one group"
    quiet(options['baseline_dir'])
    tdist.init_process_group('gloo')
    return {w: time_rounds(argparse.Namespace(**{**options, 'workload': w}), names, tdist.get_rank())
            for w in workloads}

def paired(xs, ys):
    "Median over rounds of x / y in the same round: cancels drift between rounds"
    return statistics.median(x / y for x, y in zip(xs, ys))

def what(numel, args)->str:
    "The workload and its size, in words"
    size = f"{numel / 1e6:.2f}M params ({numel * 4 / 2**20:.1f} MiB of fp32 gradients)"
    if args.workload == 'mlp':
        width = args.mlp_width
        return f"MLP: {args.mlp_layers} x Linear({width}, {width}), micro-batch {args.mlp_batch}/rank: {size}"
    return (f"GPT: {args.layers} layers, dim {args.dim}, {args.heads} heads, vocab {args.vocab}, seq {args.seq}, "
            f"micro-batch {args.batch}/rank: {size}")

def describe(numel, args, ranks:str)->str:
    return f"{what(numel, args)}; {ranks}; {args.rounds} rounds x {args.steps} steps, order alternating"

def report(got, args, ranks:str):
    "The table of one run of interleaved rounds (`got`: rank 0's `time_rounds`), headed by how the ranks ran (`ranks`)"
    times, cpu, losses = got['times'], got['cpu'], got['losses']
    print(describe(got['numel'], args, ranks))
    med, base = statistics.median, 'ddp'
    baseline = any(n.startswith('baseline-') for n in times)
    extra = any(extra_index(n) is not None for n in times)
    for k, (stages, config) in enumerate(args.config_extra or []):
        print(f"  {extra_name(k, 0)[:-1]}N: flexrt-zN with {json.dumps(config)} (stages {','.join(map(str, stages))})")
    sent = got.get('sent', {})
    print(f"  {'':16s} {'median':>9s}  vs DDP  {'cpu':>8s}  cpu vs DDP  {'sent':>8s} vs DDP   vs DeepSpeed  vs FSDP2"
          "   max |loss - DDP's|" + ("   vs baseline (cpu)" if baseline else '')
          + ("   vs flexrt-zN (cpu)" if extra else ''))
    for name, ts in times.items():
        ds, fsdp = peers(name)
        vs = lambda other: f"{paired(ts, times[other]):8.2f}x" if other in times else ' ' * 9
        drift = ('n/a (no averaging)' if name == 'no-comm' else
                 f"{max(abs(a - b) for a, b in zip(losses[name], losses[base])):.1e}")
        wire = (f"{med(sent[name]) / 1e6:5.1f} MB {med(sent[name]) / max(med(sent[base]), 1):5.2f}x"
                if sent.get(name) and sent.get(base) else ' ' * 15)
        print(f"  {name:16s} {med(ts) * 1e3:6.1f} ms {paired(ts, times[base]):6.2f}x {med(cpu[name]) * 1e3:6.1f} ms "
              f"{paired(cpu[name], cpu[base]):8.2f}x  {wire}    {vs(ds)}   {vs(fsdp)}   {drift:18s}"
              + (against_baseline(name, times, cpu) if baseline else '')
              + (against_plain(name, times, cpu) if extra else ''))
    print("  all ratios paired: median over rounds of (this implementation's time / the other's in the same round); "
          "vs DeepSpeed: its same stage; vs FSDP2: fsdp2 for stage 3, fsdp2-noreshard for stages 1-2")
    if sent:
        print("  sent: bytes rank 0's process wrote per step (/proc/self/io wchar: gloo's sends, every thread's), the "
              "median over rounds, and its ratio to DDP's")
    if got.get('logged'):
        print("  flexrt's comms logger, one more step logged: "
              + ', '.join(f"{n} {b / 1e6:.1f} MB of messages" for n, b in got['logged'].items())
              + " (message sizes as DeepSpeed's logger counts them, an all-gather's being its whole output: not bytes "
                "sent)")

def against_baseline(name, times, cpu)->str:
    "flexrt-zN's paired ratios to baseline-zN (time and cpu), or nothing"
    other = name.replace('flexrt-z', 'baseline-z')
    if not name.startswith('flexrt-z') or other not in times: return ''
    return f"   {paired(times[name], times[other]):6.3f}x ({paired(cpu[name], cpu[other]):.3f}x)"

def against_plain(name, times, cpu)->str:
    "An extra's paired ratios to flexrt-zN (time and cpu), or nothing"
    other = f"flexrt-z{stage_of(name)}"
    if extra_index(name) is None or other not in times: return ''
    return f"   {paired(times[name], times[other]):6.3f}x ({paired(cpu[name], cpu[other]):.3f}x)"

# ---------------------------------------------------------------- the launchers users take (bench/launchers.py)
def rank_options(args, **changes)->dict:
    "What every launched rank needs of the command line (JSON: it travels in a file or a notebook cell)"
    return {**vars(args), **changes}

def threads_words(ranks:list, workloads:list)->str:
    "'torch threads per rank 2,2 on entry -> 1,1 while timing (OMP_NUM_THREADS unset)', read in the ranks"
    given = ','.join(str(r['notes']['threads_given']) for r in ranks)
    timing = [sorted({t for w in workloads for t in r['result'][w]['threads']}) for r in ranks]
    during = ','.join('/'.join(map(str, ts)) for ts in timing)
    omp = sorted({r['notes']['omp_num_threads'] or 'unset' for r in ranks})
    return f"torch threads per rank {given} on entry -> {during} while timing (OMP_NUM_THREADS {'/'.join(omp)})"

def run_launched(args, names:list, workloads:list):
    "`--launcher torchrun|launch|kernel`: one launch times every workload's rounds; the tables, headed by the threads"
    from launchers import open_launcher
    with open_launcher(args.launcher, args.out) as launcher:
        ranks = launcher.run(__file__, 'launched_rank', (rank_options(args), names, workloads))
    print(f"{args.launcher}: {threads_words(ranks, workloads)}; it said: {launcher.launch_line}")
    for w in workloads:
        args.workload = w
        report(ranks[0]['result'][w], args, f"2 gloo ranks started by {args.launcher}")

def compare_launchers(args, names:list, workloads:list):
    "`--launchers kernel,launch,torchrun`: rounds of one launch per launcher, the order reversed every other round"
    from launchers import open_launcher
    kinds, started, opened = args.launchers.split(','), time.perf_counter(), {}
    runs, options = {k: [] for k in kinds}, rank_options(args, rounds=args.passes)
    try:
        for k in kinds: opened[k] = open_launcher(k, args.out)
        for r in range(args.rounds):
            for k in (kinds if r % 2 == 0 else kinds[::-1]):
                runs[k].append(opened[k].run(__file__, 'launched_rank', (options, names, workloads), f'{k}-round{r}'))
            print(f"  round {r + 1}/{args.rounds} done after {time.perf_counter() - started:.0f} s",
                  file=sys.stderr, flush=True)
    finally:
        for launcher in opened.values(): launcher.close()
    report_launchers(args, names, workloads, runs, opened, time.perf_counter() - started)

def launch_time(ranks:list, workload:str, name:str)->float:
    "One launch's reading of an implementation: rank 0's median over passes of the mean step time in a pass"
    return statistics.median(ranks[0]['result'][workload]['times'][name])

def report_launchers(args, names, workloads, runs:dict, opened:dict, seconds:float):
    "Per launcher: the ranks' threads, start-up; per workload and implementation: median step time and paired ratios"
    med, kinds = statistics.median, list(runs)
    ref = 'torchrun' if 'torchrun' in kinds else kinds[-1]
    print(f"notebook path vs {ref}: 2 gloo ranks; {args.rounds} rounds of one launch per launcher "
          f"({', '.join(kinds)}, the order reversed every other round); each launch times every implementation after "
          f"a warm-up pass, {args.passes} passes x {args.steps} steps, order alternating; the run took {seconds:.0f} s")
    for k in kinds:
        launches = runs[k]
        start = med(max(r['notes']['start_s'] for r in ranks) for ranks in launches)
        setup = med(sum(ranks[0]['result'][w]['setup_s'] for w in workloads) for ranks in launches)
        kernel = f"; the kernel itself started in {opened[k].start_seconds:.1f} s (once)" if k == 'kernel' else ''
        print(f"  {k}: {'; '.join(sorted({threads_words(ranks, workloads) for ranks in launches}))}")
        print(f"    start-up (launch call -> last rank in) {start:.2f} s, then {setup:.1f} s of process group, "
              f"{len(names) * len(workloads)} builds and warm-up (medians over launches, not in step times){kernel}")
        print(f"    it said: {opened[k].launch_line}")
    others = [k for k in kinds if k != ref]
    for w in workloads:
        args.workload = w
        print(what(runs[kinds[0]][0][0]['result'][w]['numel'], args))
        print(f"  {'':14s}" + ''.join(f"{k:>11s}" for k in kinds)
              + ''.join(f"  {k + '/' + ref + ' [q1-q3]':<25s}" for k in others) + "max |loss - DDP's|")
        for name in names:
            vals = {k: [launch_time(ranks, w, name) for ranks in runs[k]] for k in kinds}
            row = ''.join(f"{med(vals[k]) * 1e3:8.1f} ms" for k in kinds)
            for k in others:
                ratios = [a / b for a, b in zip(vals[k], vals[ref])]
                q = statistics.quantiles(ratios, n=4, method='inclusive') if len(ratios) > 1 else ratios * 3
                mark = ' ' if abs(med(ratios) - 1) <= 0.03 else '!'
                row += f"  {f'{med(ratios):.3f}x [{q[0]:.3f}-{q[2]:.3f}]{mark}':<25s}"
            losses = [ranks[0]['result'][w]['losses'] for k in kinds for ranks in runs[k]]
            drift = max(abs(a - b) for got in losses for a, b in zip(got[name], got['ddp']))
            print(f"  {name:14s}{row}{drift:.1e}")
    print(f"  step times: median over launches; ratios paired by round: median over rounds of (this launcher's "
          f"reading / {ref}'s in the same round), [q1-q3] their quartiles; goal: within 3 % of 1 at every stage "
          f"('!' marks a miss)")

LAUNCHER_IMPLS = ['ddp', 'flexrt-z0', 'flexrt-z1', 'flexrt-z2', 'flexrt-z3']
DEFAULT_IMPLS = ['ddp', 'flexrt-reducer', 'flexrt-z0', 'deepspeed-z0', 'flexrt-z1', 'deepspeed-z1',
                 'flexrt-z2', 'deepspeed-z2', 'fsdp2-noreshard', 'flexrt-z3', 'deepspeed-z3', 'fsdp2', 'no-comm']

def parse_extra(text:str, stages:set)->tuple:
    "`[STAGES:]JSON` -> (the stages it runs at, the JSON object)"
    head, sep, body = text.partition(':')
    ss = stages
    if sep and head and all(p.strip().isdigit() for p in head.split(',')):
        ss, text = {int(p) for p in head.split(',')} & stages, body
    try: config = json.loads(text)
    except json.JSONDecodeError as e: raise SystemExit(f"--config-extra is not [STAGES:]JSON: {e}: {text!r}")
    if not isinstance(config, dict): raise SystemExit("--config-extra must be a JSON object: {...}")
    return sorted(ss), config

def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--workload', default='gpt,mlp', help='comma-separated: gpt (compute-bound), mlp (communication-bound)')
    ap.add_argument('--stages', default='0,1,2,3', help='ZeRO stages to run (DDP always runs)')
    ap.add_argument('--quick', action='store_true', help='6 rounds instead of --rounds (3 with --launchers)')
    ap.add_argument('--rounds', type=int, default=None,
                    help='rounds (default 12; with --launchers: launches per launcher, 8)')
    ap.add_argument('--steps', type=int, default=None,
                    help='steps per implementation per round (default 2; with --launchers: per pass, 3)')
    ap.add_argument('--layers', type=int, default=4)
    ap.add_argument('--dim', type=int, default=192)
    ap.add_argument('--heads', type=int, default=4)
    ap.add_argument('--vocab', type=int, default=2048)
    ap.add_argument('--seq', type=int, default=64)
    ap.add_argument('--batch', type=int, default=8, help='GPT micro-batch per rank')
    ap.add_argument('--mlp-layers', type=int, default=8)
    ap.add_argument('--mlp-width', type=int, default=1024)
    ap.add_argument('--mlp-batch', type=int, default=4, help='MLP micro-batch per rank')
    ap.add_argument('--launcher', default='spawn', choices=['spawn', 'torchrun', 'launch', 'kernel'],
                    help="how the ranks start: spawn (torch.multiprocessing, --threads set in the rank), torchrun, "
                         "flexrt.launch from this process, or flexrt.launch in a Jupyter kernel (no count set)")
    ap.add_argument('--launchers', default=None, metavar='A,B,...',
                    help='compare launchers in one interleaved run, e.g. kernel,launch,torchrun (against torchrun)')
    ap.add_argument('--passes', type=int, default=3,
                    help='with --launchers: timed passes per launch, after a warm-up pass')
    ap.add_argument('--out', default='bench_out/engine_step', help="with a launcher: the ranks' result files")
    ap.add_argument('--threads', type=int, default=None,
                    help='torch threads per rank (--launcher spawn only; default 1)')
    ap.add_argument('--bucket', type=int, default=2 ** 22, help="engines' reduce_bucket_size, in elements")
    ap.add_argument('--impls', default=None,
                    help=f"default: {','.join(DEFAULT_IMPLS)}; with --launchers {','.join(LAUNCHER_IMPLS)}")
    ap.add_argument('--baseline', default=None, metavar='REV',
                    help='also run flexrt as of git revision REV (baseline-zN next to each flexrt-zN), e.g. HEAD~1')
    ap.add_argument('--config-extra', action='append', default=None, metavar='[STAGES:]JSON',
                    help='also run flexrt with this JSON object merged into its config (extra-zN next to each '
                         'flexrt-zN), e.g. \'{"communication_data_type": "bf16"}\'; given again: extra2-zN, ...; '
                         'a prefix 0,1,2: keeps it to those stages')
    ap.add_argument('--link-rate', default=None, metavar='RATE',
                    help="ranks talk over a link of this bandwidth per direction (tc's units: 10gbit, 1gbit), not "
                         "the loopback's memory speed (bench/shaped_link.py; root; --launcher spawn only)")
    args = ap.parse_args()
    launched = bool(args.launchers) or args.launcher != 'spawn'
    if launched and args.threads is not None:
        raise SystemExit('--threads sets the count in the ranks, which only --launcher spawn does: the other launchers '
                         'measure the threads users get (set OMP_NUM_THREADS to choose one for them)')
    args.threads = args.threads or 1
    if args.rounds is None: args.rounds = (3 if args.quick else 8) if args.launchers else (6 if args.quick else 12)
    if args.steps is None: args.steps = 3 if args.launchers else 2
    impls = args.impls or ','.join(LAUNCHER_IMPLS if args.launchers else DEFAULT_IMPLS)
    stages = {int(s) for s in args.stages.split(',')}
    wanted = [n for n in impls.split(',') if n == 'ddp' or stage_of(n) is None or stage_of(n) in stages]
    if 'ddp' not in wanted: wanted.insert(0, 'ddp')   # every ratio is against DDP
    args.baseline_dir = None
    if args.config_extra:
        args.config_extra = [parse_extra(text, stages) for text in args.config_extra]
        if len(args.config_extra) > MAX_EXTRAS: raise SystemExit(f"--config-extra: at most {MAX_EXTRAS} of them")
        plain = lambda n: n.startswith('flexrt-z') and n[-1].isdigit()
        with_extras = lambda n: [n] + [extra_name(k, stage_of(n)) for k, (ss, _) in enumerate(args.config_extra)
                                       if stage_of(n) in ss]
        wanted = [m for n in wanted for m in (with_extras(n) if plain(n) else [n])]
    if args.link_rate and launched:
        raise SystemExit('--link-rate shapes the ranks that --launcher spawn starts; other launchers do not take it')
    if args.baseline:
        args.baseline_dir = export_baseline(args.baseline)
        wanted = [m for n in wanted for m in ([n, f'baseline-z{stage_of(n)}'] if n.startswith('flexrt-z') and n[-1].isdigit() else [n])]
    names, missing = available(wanted)
    for name, why in missing.items(): print(f"{name}: skipped, {why}")
    workloads = args.workload.split(',')
    for workload in workloads:
        if workload not in ('gpt', 'mlp'): raise SystemExit(f"unknown workload {workload!r}: choose gpt or mlp")
    unknown = [k for k in (args.launchers or '').split(',') if k and k not in ('torchrun', 'launch', 'kernel')]
    if unknown: raise SystemExit(f"--launchers: unknown {', '.join(unknown)}: choose from torchrun, launch, kernel")
    if args.launchers: return compare_launchers(args, names, workloads)
    if launched: return run_launched(args, names, workloads)
    with contextlib.ExitStack() as stack:
        if args.link_rate:
            from shaped_link import shaped_link
            args.link_env = stack.enter_context(shaped_link(args.link_rate, 2))
        for workload in workloads:
            args.workload = workload
            with socket.socket() as s: s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]
            mp.spawn(worker, args=(2, port, args, names), nprocs=2)

if __name__ == '__main__':
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # bench/launchers.py
    sys.exit(main())
