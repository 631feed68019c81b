"""DeepSpeed writes the checkpoints that tests/test_checkpoint_deepspeed.py loads into flexrt.

    python -m torch.distributed.run --nproc_per_node 2 tests/ds_checkpoint_train.py OUT [STAGE,DTYPE ...]

For each ZeRO stage and dtype (fp32, bf16, 'groups': fp32 with two param groups, or 'tied': fp32 `TiedNet`, whose
`lm_head.weight` is `embed.weight` as GPT-2's head is its embedding), real DeepSpeed trains `Net` (two linears and a buffer) for `STEPS` steps with AdamW,
gradient clipping and a WarmupLR schedule, saves a checkpoint `OUT/z<stage>_<dtype>/ckpt` with a client state, then
trains `MORE` further steps. Rank 0 writes `OUT/z<stage>_<dtype>/reference.pt`: the global loss of every further
micro-step (the mean of the ranks' losses), the gradient norm of every further step (None where DeepSpeed keeps none:
stage 0 in fp32), the weights right after the save, the global step, and DeepSpeed's own `zero_to_fp32` state dict of
the checkpoint. flexrt must load the checkpoint and continue with the same losses and norms.
"""
import os, sys
os.environ.setdefault('DS_ACCELERATOR', 'cpu')
import torch, torch.nn as nn, torch.nn.functional as F

STEPS, MORE, MICRO, GAS, CLIP, LR = 3, 2, 4, 2, 0.05, 2e-2
RUNS = [(0, 'fp32'), (1, 'fp32'), (2, 'fp32'), (3, 'fp32'), (0, 'bf16'), (2, 'bf16'), (0, 'groups'), (2, 'groups'), (3, 'groups'),
        (0, 'tied'), (1, 'tied'), (2, 'tied'), (3, 'tied')]

class Net(nn.Module):
    "A tiny model with a buffer (a checkpoint must carry buffers as well as parameters)"
    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(6, 16), nn.Linear(16, 3)
        self.register_buffer('shift', torch.linspace(-0.5, 0.5, 6))
    def forward(self, x): return self.out(torch.tanh(self.inp(x + self.shift.to(x.dtype))))

class TiedNet(nn.Module):
    "Tied weights: `lm_head.weight` is `embed.weight` (DeepSpeed records it in `shared_params`); both modules run, so ZeRO-3 gathers it through either"
    def __init__(self):
        super().__init__()
        self.embed, self.mid, self.lm_head, self.out = nn.Linear(6, 16, bias=False), nn.Linear(16, 6), nn.Linear(6, 16, bias=False), nn.Linear(16, 3)
        self.lm_head.weight = self.embed.weight
        self.register_buffer('shift', torch.linspace(-0.5, 0.5, 6))
    def forward(self, x): return self.out(torch.tanh(self.lm_head(torch.tanh(self.mid(torch.tanh(self.embed(x + self.shift.to(x.dtype))))))))

def make_model(dtype='fp32'):
    torch.manual_seed(0)
    model = TiedNet() if dtype == 'tied' else Net()
    with torch.no_grad():   # weights bf16 holds exactly, so bf16 runs start from the same fp32 masters
        for p in model.parameters(): p.copy_(p.bfloat16().float())
    return model

def parameters(model, dtype):
    """What the optimizer gets: all parameters, or ('groups', fp32) biases without weight decay, then weights, so the
    optimizer's order is not the module's"""
    if dtype != 'groups': return model.parameters()
    named = list(model.named_parameters())
    return [{'params': [p for n, p in named if n.endswith('bias')], 'weight_decay': 0.0},
            {'params': [p for n, p in named if not n.endswith('bias')]}]

def config(stage, dtype, micro=MICRO):
    return {'train_micro_batch_size_per_gpu': micro, 'gradient_accumulation_steps': GAS, 'gradient_clipping': CLIP,
            'steps_per_print': 1000, 'bf16': {'enabled': dtype == 'bf16'},
            'optimizer': {'type': 'AdamW', 'params': {'lr': LR, 'weight_decay': 0.01, 'torch_adam': True}},
            'scheduler': {'type': 'WarmupLR', 'params': {'warmup_min_lr': 0.0, 'warmup_max_lr': LR, 'warmup_num_steps': 8}},
            'zero_optimization': {'stage': stage}}

def batch(step, micro, rank):
    "Rank `rank`'s micro-batch: the same global data in every run"
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(MICRO, 6, generator=g), torch.randn(MICRO, 3, generator=g)

def global_batch(step, micro, world):
    "The micro-batch of one rank among `world` ranks that together see the same data as DeepSpeed's 2 ranks"
    parts = [batch(step, micro, r) for r in range(2)]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])

def train_steps(engine, steps, first, rank, world, dtype):
    "Train `steps` optimizer steps from step `first`; the global loss of each micro-step and the gradient norm of each step"
    losses, norms = [], []
    for step in range(first, first + steps):
        for micro in range(GAS):
            x, y = batch(step, micro, rank) if world == 2 else global_batch(step, micro, world)
            loss = F.mse_loss(engine(x.to(engine.device, torch.bfloat16 if dtype == 'bf16' else torch.float32)).float(), y)
            engine.backward(loss); engine.step()
            total = loss.detach().clone()
            torch.distributed.all_reduce(total)
            losses.append(total.item() / world)
        norm = engine.get_global_grad_norm()
        norms.append(None if norm is None else float(norm))
    return losses, norms

def fp32_state_dict(save_dir, stage):
    """DeepSpeed's fp32 weights of the checkpoint: its zero_to_fp32 under ZeRO; at stage 0 (which zero_to_fp32 does not
    read) the module's state_dict with the fp32 masters of a 16-bit run's optimizer wrapper in place of its parameters"""
    from deepspeed.utils import zero_to_fp32
    if stage > 0: return dict(zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(save_dir, tag='ckpt'))
    states = torch.load(os.path.join(save_dir, 'ckpt', 'mp_rank_00_model_states.pt'), weights_only=False)
    out = dict(states['module'])
    if 'fp32_groups' in states['optimizer']:
        params = [n for n in out if n not in states['buffer_names']]
        out.update(zip(params, (t for g in states['optimizer']['fp32_groups'] for t in g)))
    return out

def run(deepspeed, stage, dtype, out):
    torch.distributed.barrier()
    model = make_model(dtype)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=parameters(model, dtype), config=config(stage, dtype))
    rank = torch.distributed.get_rank()
    train_steps(engine, STEPS, 0, rank, 2, dtype)
    save_dir = os.path.join(out, f'z{stage}_{dtype}')
    engine.save_checkpoint(save_dir, tag='ckpt', client_state={'epoch': 7, 'note': 'from deepspeed'})
    torch.distributed.barrier()
    ref = {'global_steps': engine.global_steps, 'lr': engine.get_lr()[0]}
    if rank == 0: ref['fp32'] = fp32_state_dict(save_dir, stage)
    ref['losses'], ref['norms'] = train_steps(engine, MORE, STEPS, rank, 2, dtype)
    if rank == 0: torch.save(ref, os.path.join(save_dir, 'reference.pt'))
    torch.distributed.barrier()

def main():
    out, only = sys.argv[1], sys.argv[2:]
    from real_deepspeed import import_deepspeed   # quiet, no shared-memory comm op (see there)
    deepspeed = import_deepspeed()
    deepspeed.init_distributed(dist_backend='gloo')
    torch.set_num_threads(1)
    runs = RUNS if not only else [(int(s.split(',')[0]), s.split(',')[1]) for s in only]
    for stage, dtype in runs: run(deepspeed, stage, dtype, out)

if __name__ == '__main__':
    main()
