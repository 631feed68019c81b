"""A DeepSpeed training script. The one flexrt-specific line is the import: with `import deepspeed` instead of
`import flexrt as deepspeed` it is an ordinary DeepSpeed script, and both train to the same weights.

    torchrun --nproc_per_node 2 examples/deepspeed_style.py --deepspeed
    torchrun --nproc_per_node 2 examples/deepspeed_style.py --deepspeed --deepspeed_config my_config.json

tests/test_engine_example.py runs it on 2 ranks (and, where DeepSpeed is installed, compares the two).
"""
import argparse
import torch, torch.nn as nn, torch.nn.functional as F
import flexrt as deepspeed

DS_CONFIG = {
    "train_batch_size": 16,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "steps_per_print": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01, "torch_adam": True}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3, "warmup_num_steps": 4}},
}

def parse_args():
    parser = argparse.ArgumentParser(description="a small regression trained DeepSpeed-style")
    parser.add_argument('--local_rank', type=int, default=-1, help="passed by the deepspeed launcher")
    parser.add_argument('--epochs', type=int, default=2)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU())
        self.head = nn.Linear(32, 1)
    def forward(self, x): return self.head(self.body(x))

def dataset(n=256):
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, :4].sum(1, keepdim=True)).sin() + 0.1 * torch.randn(n, 1, generator=g)
    return torch.utils.data.TensorDataset(x, y)

def main():
    args = parse_args()
    deepspeed.init_distributed(dist_backend='gloo')
    torch.manual_seed(0)
    model = Net()
    engine, optimizer, loader, lr_scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=dataset(),
        config=None if args.deepspeed_config else DS_CONFIG)
    rank = torch.distributed.get_rank()
    for epoch in range(args.epochs):
        loader.data_sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(engine.device), y.to(engine.device)
            loss = F.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
    checksum = sum(p.detach().double().sum().item() for p in engine.module.parameters())
    if rank == 0:
        # DeepSpeed's engine reports no gradient norm for fp32 without ZeRO (None); flexrt's always does
        print(f"RESULT steps {engine.global_steps} samples {engine.global_samples} lr {lr_scheduler.get_last_lr()[0]:.6e} "
              f"loss {loss.item():.6f} checksum {checksum:.8f} grad_norm {engine.get_global_grad_norm()}", flush=True)

if __name__ == '__main__':
    main()
