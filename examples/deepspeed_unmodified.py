"""An ordinary DeepSpeed training script: it imports `deepspeed` and DeepSpeed's submodules, nothing of flexrt.

    torchrun --nproc_per_node 2 examples/deepspeed_unmodified.py --deepspeed --deepspeed_config ds.json --out out.json
    torchrun --nproc_per_node 2 -m flexrt.deepspeed examples/deepspeed_unmodified.py --deepspeed --deepspeed_config ds.json --out out.json

The first runs DeepSpeed, the second the same file on flexrt; tests/test_deepspeed_script.py checks they agree.
Rank 0 writes the losses, the gradient norm of each applied step, what the engine's accessors said, and the final
weights (as lists) to --out.
"""
import argparse, json
import torch, torch.nn as nn, torch.nn.functional as F
import deepspeed
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.lr_schedules import WARMUP_LR, WARMUP_NUM_STEPS
from deepspeed.utils import RepeatingLoader, log_dist
from deepspeed import comm as dist

def parse_args():
    parser = argparse.ArgumentParser(description='a DeepSpeed script')
    parser.add_argument('--local_rank', type=int, default=-1)
    parser.add_argument('--steps', type=int, default=6)
    parser.add_argument('--out', required=True)
    return deepspeed.add_config_arguments(parser).parse_args()

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU())
        self.head = nn.Linear(32, 1)
    def forward(self, x): return self.head(self.body(x))

def dataset(n=512):
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 8, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, :4].sum(1, keepdim=True)).sin())

def main():
    args = parse_args()
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    config = json.load(open(args.deepspeed_config))
    assert config['scheduler']['type'] == WARMUP_LR and WARMUP_NUM_STEPS in config['scheduler']['params']
    torch.manual_seed(0)
    model = Net()
    engine, _, loader, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(), training_data=dataset())
    data, losses, applied, norms = RepeatingLoader(loader), [], [], []
    for micro_step in range(args.steps * engine.gradient_accumulation_steps()):
        x, y = next(data)
        loss = F.mse_loss(engine(x.to(engine.device)), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        applied.append(engine.was_step_applied())
        losses.append(loss.item())
        if applied[-1]: norms.append(float(engine.get_global_grad_norm()))
    log_dist(f'trained {args.steps} steps', ranks=[0])
    weights = {k: v.float().flatten().tolist() for k, v in engine.module_state_dict().items()}
    accessors = {name: getattr(engine, name)() for name in ('zero_optimization_stage', 'fp16_enabled', 'bfloat16_enabled',
                 'gradient_clipping', 'train_batch_size', 'train_micro_batch_size_per_gpu', 'gradient_accumulation_steps',
                 'get_lr', 'get_mom', 'zero_reduce_bucket_size', 'steps_per_print', 'dynamic_loss_scale')}
    if dist.get_rank() == 0:
        json.dump({'losses': losses, 'norms': norms, 'weights': weights, 'accessors': accessors, 'applied': applied,
                   'world_size': dist.get_world_size()},
                  open(args.out, 'w'))
    engine.destroy()

if __name__ == '__main__':
    main()
