"""Loss curves of DeepSpeed's communication-reducing keys against the exact run: a small LM, 500 steps, 2 gloo ranks.

    python bench/convergence.py [--steps 500] [--stage 3] [--settings fp32,bf16,fp16,qgz,qwz,qwz+qgz]
                                [--png docs/images/convergence.png] [--csv bench_out/convergence.csv]

The model is bench/engine_step.py's GPT (tied embedding and head, pre-norm blocks, causal attention), here over
bytes (vocabulary 256, embeddings drawn with std 0.02), `--layers` 4, `--dim` 192, trained on the source text of
flexrt's own package (every flexrt/**/*.py, sorted: about 1.8 MB of real, learnable text that needs no download).
Each step, each rank reads `--batch` windows of `--seq` + 1 bytes at offsets drawn from a generator seeded by (step,
rank), so every setting sees the same batches. Every setting trains its own engine from the same initial weights
with the same config: ZeRO `--stage`, fp32, torch's AdamW (lr `--lr`, weight decay 0.01, no schedule), gradient
clipping 1.0, one micro-batch per step. Only the communication keys differ:

- fp32: none (the reference: the exact run);
- bf16, fp16: `communication_data_type`, gradients reduced in that dtype;
- qgz: `zero_quantized_gradients` (int8 blocks through an all-to-all reduce-scatter; stages 1-3);
- qwz: `zero_quantized_weights` (int8 parameter gathers; stage 3);
- qwz+qgz: both.

hpZ (`zero_hpz_partition_size`) is left out: it changes where the gathers run, not their values (bit-identical to
the exact run, tests/test_zeropp.py).

Printed per setting: the mean loss (over both ranks) of steps 1-20, 81-100, 231-250 and the last 20, the difference
of the last 50 steps' mean from the reference's, and the largest difference over the run of a 20-step mean from the
reference's at the same steps (both in % of the reference). `--png` draws the curves (20-step means) and their
difference from the reference; `--csv` keeps every loss of every rank.
"""
import argparse, csv, glob, os, socket, statistics, sys, time, warnings
os.environ.setdefault('DS_ACCELERATOR', 'cpu')
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ZPP = lambda **keys: {'zero_optimization': keys}
SETTINGS = {
    'fp32': {},
    'bf16': {'communication_data_type': 'bf16'},
    'fp16': {'communication_data_type': 'fp16'},
    'qgz': ZPP(zero_quantized_gradients=True),
    'qwz': ZPP(zero_quantized_weights=True),
    'qwz+qgz': ZPP(zero_quantized_weights=True, zero_quantized_gradients=True),
}
NEEDS = {'qgz': 1, 'qwz': 3, 'qwz+qgz': 3}  # the lowest stage each setting means something at
WINDOW = 20


def corpus() -> torch.Tensor:
    "flexrt's own source as bytes (uint8)"
    paths = sorted(glob.glob(os.path.join(ROOT, 'flexrt', '**', '*.py'), recursive=True))
    if not paths: raise SystemExit(f"no flexrt/**/*.py under {ROOT}: run this from a flexrt checkout")
    text = b'\n'.join(open(p, 'rb').read() for p in paths)
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)


def batch(data, step, rank, args):
    "`--batch` windows of this rank at this step: (inputs, next bytes), int64"
    g = torch.Generator().manual_seed(100_003 * step + rank)
    starts = torch.randint(len(data) - args.seq - 1, (args.batch,), generator=g)
    windows = torch.stack([data[s: s + args.seq + 1] for s in starts.tolist()]).long()
    return windows[:, :-1], windows[:, 1:]


def config(args, extra: dict) -> dict:
    zero = {'stage': args.stage, 'overlap_comm': True, **extra.get('zero_optimization', {})}
    return {'train_micro_batch_size_per_gpu': args.batch, 'gradient_accumulation_steps': 1, 'gradient_clipping': 1.0,
            'optimizer': {'type': 'AdamW', 'params': {'lr': args.lr, 'weight_decay': 0.01}},
            'steps_per_print': 10 ** 9, 'zero_optimization': zero,
            **{k: v for k, v in extra.items() if k != 'zero_optimization'}}


def train(rank, args, data, name) -> tuple:
    "One setting's run on this rank: (its losses, seconds per step)"
    import flexrt
    from engine_step import GPT
    torch.manual_seed(0)
    model = GPT(256, args.dim, args.layers, args.heads, args.seq)
    for table in (model.tok, model.pos): torch.nn.init.normal_(table.weight, std=0.02)  # GPT-2's: the tied head starts
                                                                                      # near uniform (loss ln 256)
    engine, *_ = flexrt.initialize(model=model, config=config(args, SETTINGS[name]))
    losses, start = [], time.perf_counter()
    for step in range(args.steps):
        x, y = batch(data, step, rank, args)
        logits = engine(x)
        loss = F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    seconds = (time.perf_counter() - start) / args.steps
    engine.close()
    return losses, seconds


def rank_main(rank, world, port, args, names, out):
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    warnings.filterwarnings('ignore')
    torch.set_num_threads(1)
    tdist.init_process_group('gloo', rank=rank, world_size=world)
    data, got = corpus(), {}
    for name in names:
        got[name] = train(rank, args, data, name)
        if rank == 0: print(f"  {name}: {args.steps} steps at {got[name][1] * 1e3:.0f} ms a step", flush=True)
    every = [None] * world
    tdist.all_gather_object(every, got)
    if rank == 0: torch.save(every, out)
    tdist.destroy_process_group()


def windows(losses: list) -> list:
    "Means of consecutive `WINDOW`-step stretches"
    return [statistics.fmean(losses[i: i + WINDOW]) for i in range(0, len(losses) - WINDOW + 1, WINDOW)]


def report(args, names, every):
    mean = {n: [statistics.fmean(r[n][0][s] for r in every) for s in range(args.steps)] for n in names}
    ref = mean['fp32']
    steps = args.steps
    at = [(1, WINDOW), (81, 100), (231, 250), (steps - WINDOW + 1, steps)]
    at = [(a, b) for a, b in at if b <= steps]
    print(f"{args.steps} steps, 2 gloo ranks, ZeRO stage {args.stage}, GPT over bytes: {args.layers} layers, dim "
          f"{args.dim}, seq {args.seq}, micro-batch {args.batch} per rank, AdamW lr {args.lr}, clipping 1.0")
    print(f"  {'setting':10s}" + ''.join(f"{f'steps {a}-{b}':>14s}" for a, b in at)
          + f"{'last 50 vs fp32':>17s}{'largest |20-step mean - fp32|':>32s}{'ms/step':>9s}")
    for n in names:
        tail = statistics.fmean(mean[n][-50:])
        rel = 100 * (tail / statistics.fmean(ref[-50:]) - 1)
        worst = max(abs(a / b - 1) for a, b in zip(windows(mean[n]), windows(ref))) * 100
        ms = statistics.fmean(r[n][1] for r in every) * 1e3
        print(f"  {n:10s}" + ''.join(f"{statistics.fmean(mean[n][a - 1:b]):14.4f}" for a, b in at)
              + f"{rel:+16.2f}%{worst:31.2f}%{ms:9.0f}")
    print("  loss: the mean of both ranks' losses at each step; vs fp32 in % of the reference's")
    if args.png: draw(args, names, mean)
    if args.csv:
        os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
        with open(args.csv, 'w', newline='') as f:
            w = csv.writer(f)
            w.writerow(['setting', 'rank', 'step', 'loss'])
            for n in names:
                for r, got in enumerate(every):
                    w.writerows((n, r, s + 1, loss) for s, loss in enumerate(got[n][0]))
        print(f"  every loss: {args.csv}")


def draw(args, names, mean):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.4), sharex=True, gridspec_kw={'height_ratios': [3, 2]})
    xs = [WINDOW * (i + 1) for i in range(args.steps // WINDOW)]
    ref = windows(mean['fp32'])
    for n in names:
        ys = windows(mean[n])
        top.plot(xs, ys, label=n, lw=2.2 if n == 'fp32' else 1.2, color='black' if n == 'fp32' else None)
        if n != 'fp32': bottom.plot(xs, [100 * (a / b - 1) for a, b in zip(ys, ref)], label=n, lw=1.2)
    top.set_ylabel(f'loss ({WINDOW}-step mean)')
    top.set_title(f'ZeRO stage {args.stage}, 2 ranks: each communication setting vs the exact (fp32) run')
    top.legend()
    bottom.axhline(0, color='black', lw=0.8)
    bottom.set_ylabel('vs fp32 (%)')
    bottom.set_xlabel('step')
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.png)), exist_ok=True)
    fig.savefig(args.png, dpi=110)
    print(f"  curves: {args.png}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--steps', type=int, default=500)
    ap.add_argument('--stage', type=int, default=3, choices=[0, 1, 2, 3])
    ap.add_argument('--settings', default=','.join(SETTINGS), help=f"comma-separated, from {', '.join(SETTINGS)}")
    ap.add_argument('--layers', type=int, default=4)
    ap.add_argument('--dim', type=int, default=192)
    ap.add_argument('--heads', type=int, default=4)
    ap.add_argument('--seq', type=int, default=64)
    ap.add_argument('--batch', type=int, default=8, help='micro-batch per rank')
    ap.add_argument('--lr', type=float, default=1e-3)
    ap.add_argument('--png', default=None, help='draw the curves into this PNG')
    ap.add_argument('--csv', default=None, help='write every loss into this CSV')
    args = ap.parse_args()
    names = [n.strip() for n in args.settings.split(',') if n.strip()]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown: raise SystemExit(f"--settings: unknown {', '.join(unknown)}: choose from {', '.join(SETTINGS)}")
    low = [n for n in names if args.stage < NEEDS.get(n, 0)]
    if low: raise SystemExit(f"--settings {', '.join(low)} need stage {max(NEEDS[n] for n in low)} or more "
                             f"(--stage {args.stage}): drop them or raise --stage")
    if args.steps < 50: raise SystemExit(f"--steps must be at least 50 (the last-50 mean), got {args.steps}")
    if 'fp32' not in names: names.insert(0, 'fp32')  # the reference every setting is compared with
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, 'losses.pt')
        mp.spawn(rank_main, args=(2, port, args, names, out), nprocs=2)
        every = torch.load(out, weights_only=False)
    report(args, names, every)


if __name__ == '__main__':
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
