"""One DeepSpeed training script, run under `import deepspeed` or `import flexrt as deepspeed` (tests/test_deepspeed_parity.py).

    python -m torch.distributed.run --nproc_per_node 2 tests/parity_train.py --impl deepspeed --out DIR
    python -m torch.distributed.run --nproc_per_node 2 tests/parity_train.py --impl flexrt --out DIR

The two runs differ only in the import. Each trains a tiny MLP at ZeRO stages 0-3 in fp32 and bf16 (2 micro-batches
per step, gradient clipping active, AdamW), saves a checkpoint, and rank 0 writes `DIR/<impl>.pt`: per run the loss of
every micro-step, the model's weights, and the checkpoint's contents as per-parameter tensors (fp32 masters and Adam
moments), read back with the implementation's own tools (DeepSpeed: `zero_to_fp32` functions and its optimizer
shards; flexrt: `flexrt.checkpoint.consolidate` and its fragment index).
"""
import argparse, os, sys
os.environ.setdefault('DS_ACCELERATOR', 'cpu')
import torch, torch.nn as nn, torch.nn.functional as F

STEPS, MICRO, GAS, CLIP, LR = 3, 4, 2, 0.05, 2e-2
BF16_INIT = True   # --fp32-init switches it off (the known difference in how fp32 masters start)
RUNS = [(stage, dtype) for dtype in ('fp32', 'bf16') for stage in (0, 1, 2, 3)]

def config(stage, dtype):
    return {'train_micro_batch_size_per_gpu': MICRO, 'gradient_accumulation_steps': GAS, 'gradient_clipping': CLIP,
            'steps_per_print': 1000, 'bf16': {'enabled': dtype == 'bf16'},
            'optimizer': {'type': 'AdamW', 'params': {'lr': LR, 'weight_decay': 0.01, 'torch_adam': True}},
            'zero_optimization': {'stage': stage}}

def make_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    if BF16_INIT:   # weights bf16 holds exactly: DeepSpeed's fp32 masters (built from the bf16-cast model) equal flexrt's
        with torch.no_grad():
            for p in model.parameters(): p.copy_(p.bfloat16().float())
    return model

def batch(step, micro, rank, world):
    "This rank's micro-batch: the same global data in every run"
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(MICRO, 6, generator=g), torch.randn(MICRO, 3, generator=g)

def train(deepspeed, stage, dtype, save_dir):
    model = make_model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(stage, dtype))
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    losses, norms = [], []
    for step in range(STEPS):
        for micro in range(GAS):
            x, y = batch(step, micro, rank, world)
            loss = F.mse_loss(engine(x.to(engine.device, _dtype(dtype))).float(), y)   # 16-bit models take 16-bit inputs
            engine.backward(loss); engine.step()
            losses.append(loss.item())
        norm = engine.get_global_grad_norm()
        norms.append(None if norm is None else float(norm))
    weights = full_weights(deepspeed, engine, stage)
    engine.save_checkpoint(save_dir, tag='final')
    return {'losses': losses, 'weights': weights, 'grad_norms': norms,
            'global_steps': engine.global_steps}

def _dtype(name): return torch.bfloat16 if name == 'bf16' else torch.float32

def full_weights(deepspeed, engine, stage):
    "The model's working weights, gathered under ZeRO-3"
    params = list(engine.module.named_parameters())
    if stage == 3:
        # flexrt has no `deepspeed.zero.GatheredParameters` at the top of `flexrt.zero` (a known difference): take its own
        gathered = getattr(deepspeed.zero, 'GatheredParameters', None)
        if gathered is None: from flexrt.zero.stage3.gathered import GatheredParameters as gathered
        with gathered([p for _, p in params]):
            return {n: p.detach().clone() for n, p in params}
    return {n: p.detach().clone() for n, p in params}

MOMENTS = ('exp_avg', 'exp_avg_sq')

def read_deepspeed(save_dir, stage):
    "DeepSpeed's checkpoint as per-parameter tensors: fp32 weights and Adam moments, unflattened by its zero_to_fp32 functions"
    from deepspeed.utils import zero_to_fp32 as z
    d = os.path.join(save_dir, 'final')
    if stage == 0:   # no ZeRO files: the module and the torch optimizer's state_dict sit in the model states
        states = torch.load(os.path.join(d, 'mp_rank_00_model_states.pt'), weights_only=False)
        names, opt = list(states['module']), states['optimizer']
        if 'fp32_groups' in opt:   # bf16: the FP16_Optimizer wrapper holds fp32 masters and the torch optimizer's state
            masters, state = dict(zip(names, opt['fp32_groups'][0])), opt['optimizer_state_dict']['state']
        else: masters, state = dict(states['module']), opt['state']
        return {'masters': masters, **{k: {n: state[i][k] for i, n in enumerate(names)} for k in MOMENTS}}
    out = {'masters': dict(z.get_fp32_state_dict_from_zero_checkpoint(save_dir, tag='final'))}
    model_states = z.parse_model_states(z.get_model_state_files(d))
    shards = [torch.load(f, weights_only=False)['optimizer_state_dict'] for f in z.get_optim_files(d)]
    key = 'base_optimizer_state' if stage <= 2 else 'optimizer_state_dict'
    for k in MOMENTS:   # the moments are flat partitions laid out like the fp32 groups: the same merge applies
        flat = [[s[key]['state'][g][k] for g in sorted(s[key]['state'])] for s in shards]
        merged = (z._get_fp32_state_dict_from_zero2_checkpoint(len(shards), flat, model_states, False, shards[0].get('param_alignment_paddings'))
                  if stage <= 2 else z._get_fp32_state_dict_from_zero3_checkpoint(len(shards), flat, model_states, False))
        out[k] = dict(z.to_torch_tensor(merged))
    return out

def read_flexrt(save_dir, stage):
    "flexrt's checkpoint as per-parameter tensors: fp32 masters via consolidate, Adam moments from its fragment index"
    from flexrt.checkpoint import consolidate, resolve
    from flexrt.checkpoint.layout import read_manifest
    from flexrt.checkpoint.storage import safe_load, rank_file, MODEL_STATES
    from flexrt.checkpoint.shards import FragmentIndex
    out = {'masters': dict(consolidate(save_dir, tag='final'))}
    directory = resolve(save_dir, 'final')
    states = safe_load(directory / MODEL_STATES)
    index = FragmentIndex([safe_load(directory / rank_file(r)) for r in range(read_manifest(directory)['world_size'])])
    for k in MOMENTS:
        out[k] = {}
        for name, key, kind, shape, dtype in states['entries']:
            if kind != 'param': continue
            t = torch.empty(torch.Size(shape).numel())
            index.copy_into(t, key, k)
            out[k][name] = t.view(shape)
    return out

def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--impl', choices=['deepspeed', 'flexrt'], required=True)
    parser.add_argument('--out', required=True)
    parser.add_argument('--fp32-init', action='store_true', help='initial weights bf16 cannot hold exactly')
    parser.add_argument('--only', default=None, help='stage,dtype to run only one configuration')
    args = parser.parse_args()
    global BF16_INIT
    BF16_INIT = not args.fp32_init
    if args.impl == 'deepspeed':
        from real_deepspeed import import_deepspeed   # quiet, no shared-memory comm op (see there)
        deepspeed = import_deepspeed()
    else:
        import flexrt as deepspeed
    deepspeed.init_distributed(dist_backend='gloo')
    torch.set_num_threads(1)
    rank = torch.distributed.get_rank()
    results = {}
    runs = RUNS if args.only is None else [(int(args.only.split(',')[0]), args.only.split(',')[1])]
    for stage, dtype in runs:
        save_dir = os.path.join(args.out, f'{args.impl}_z{stage}_{dtype}')
        res = train(deepspeed, stage, dtype, save_dir)
        torch.distributed.barrier()
        if rank == 0:
            res['checkpoint'] = (read_deepspeed if args.impl == 'deepspeed' else read_flexrt)(save_dir, stage)
        results[(stage, dtype)] = res
        torch.distributed.barrier()
    if rank == 0: torch.save(results, os.path.join(args.out, f'{args.impl}.pt'))

if __name__ == '__main__':
    main()
