"""clip_grad_norm_ on 1,000 parameter tensors: flexrt vs torch.nn.utils vs DeepSpeed, interleaved in one run.

    python bench/grad_norm.py [--tensors 1000] [--hidden 64 256] [--repeats 15] [--device cpu|cuda]

The parameters look like a stack of transformer blocks (layer norms, attention and MLP weights and biases) cut
at `--tensors` tensors; each `--hidden` size is one model (64: 4M elements, where per-tensor overheads
dominate, as they do on GPUs; 256: 67M elements, where memory bandwidth does). Two cases: gradients above `max_norm` (every implementation scales them; the gradients
are restored from a saved copy before each call, outside the timing) and gradients already below it. Each round
runs every implementation once, in turn, so drift in machine load hits them alike; the medians are printed with
the ratios torch/flexrt and deepspeed/flexrt (> 1 means flexrt is faster); the best (minimum) time of each is
shown too, as a check when other processes share the machine. DeepSpeed is optional: without it the
bench prints 'deepspeed: not installed' and compares flexrt with torch only.
"""
import argparse, math, os, statistics, sys, time
import torch
from flexrt.utils import clip_grad_norm_ as flexrt_clip

def block_shapes(h):
    "Parameter shapes of one transformer block with hidden size h"
    return [(h,), (h,), (3 * h, h), (3 * h,), (h, h), (h,), (h,), (h,), (4 * h, h), (4 * h,), (h, 4 * h), (h,)]

def make_parameters(num_tensors, hidden, device, seed=0):
    g = torch.Generator(device='cpu').manual_seed(seed)
    shapes = [(50_000 // 8, hidden)]                               # a (small) embedding first
    while len(shapes) < num_tensors: shapes += block_shapes(hidden)
    params = []
    for shape in shapes[:num_tensors]:
        p = torch.nn.Parameter(torch.zeros(shape, device=device))
        p.grad = (torch.randn(shape, generator=g) * 1e-2).to(device)
        params.append(p)
    return params

def deepspeed_clip():
    "DeepSpeed's clip_grad_norm_ with a 1-rank gloo group initialised, or None when DeepSpeed is not installed"
    os.environ.setdefault('DS_ACCELERATOR', 'cuda' if torch.cuda.is_available() else 'cpu')
    try:
        import deepspeed, deepspeed.comm as ds_comm
        from deepspeed.runtime.utils import clip_grad_norm_
    except ImportError:
        return None, None
    if not ds_comm.is_initialized():
        import socket
        with socket.socket() as s: s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port), RANK='0', WORLD_SIZE='1', LOCAL_RANK='0')
        ds_comm.init_distributed(dist_backend='nccl' if torch.cuda.is_available() else 'gloo', verbose=False)
    return clip_grad_norm_, deepspeed.__version__

def sync(device):
    if device.type == 'cuda': torch.cuda.synchronize()

def run_case(impls, params, saved, max_norm, repeats, device):
    times = {name: [] for name in impls}
    norms = {}
    names = list(impls)
    for r in range(repeats + 1):                                   # round 0 warms up and is not counted
        for name in names[r % len(names):] + names[:r % len(names)]:   # rotate who goes first
            fn = impls[name]
            for p, g in zip(params, saved): p.grad.copy_(g)
            sync(device); t0 = time.perf_counter()
            norm = fn(params, max_norm)
            sync(device); elapsed = time.perf_counter() - t0
            if r: times[name].append(elapsed)
            norms[name] = float(norm)
    return {name: (statistics.median(ts), min(ts)) for name, ts in times.items()}, norms

def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--tensors', type=int, default=1000)
    ap.add_argument('--hidden', type=int, nargs='+', default=[64, 256])
    ap.add_argument('--repeats', type=int, default=15)
    ap.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    args = ap.parse_args()
    device = torch.device(args.device)
    impls = {'flexrt': flexrt_clip, 'torch': torch.nn.utils.clip_grad_norm_}
    ds_clip, ds_version = deepspeed_clip()
    if ds_clip is not None: impls['deepspeed'] = ds_clip
    print(f'torch {torch.__version__} on {device} ({torch.get_num_threads()} threads); '
          + (f'deepspeed: {ds_version}' if ds_clip is not None else 'deepspeed: not installed'))
    for hidden in args.hidden:
        params = make_parameters(args.tensors, hidden, device)
        saved = [p.grad.clone() for p in params]
        numel = sum(p.numel() for p in params)
        print(f'\n{len(params)} tensors, hidden {hidden}: {numel / 1e6:.1f}M elements ({numel * 4 / 2**20:.0f} MiB fp32), '
              f'median of {args.repeats} interleaved rounds')
        total = float(torch.nn.utils.get_total_norm(saved))
        for case, max_norm in (('above max_norm (clips)', total / 2), ('below max_norm (no change)', total * 2)):
            medians, norms = run_case(impls, params, saved, max_norm, args.repeats, device)
            assert all(math.isclose(n, total, rel_tol=1e-4) for n in norms.values()), norms
            line = '  '.join(f'{name} {med * 1e3:7.2f} ms (best {best * 1e3:6.2f})' for name, (med, best) in medians.items())
            ratios = '  '.join(f'{name}/flexrt {medians[name][0] / medians["flexrt"][0]:.2f}x'
                               for name in medians if name != 'flexrt')
            print(f'  {case:27s} {line}   median ratios: {ratios}')
        del params, saved

if __name__ == '__main__':
    sys.exit(main())
