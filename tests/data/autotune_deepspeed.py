"An unmodified DeepSpeed-style script (no model_fn/train_step): tuned with one torchrun per experiment (tests/test_autotuner_cli.py)"
import argparse, torch, torch.nn as nn
import flexrt as deepspeed
p = argparse.ArgumentParser()
p.add_argument('--local_rank', type=int, default=-1)
p.add_argument('--steps', type=int, default=100)
p = deepspeed.add_config_arguments(p)
args = p.parse_args()
deepspeed.init_distributed(dist_backend='gloo')
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 1))
engine, *_ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
for _ in range(args.steps * engine.gradient_accumulation_steps()):
    loss = engine(torch.randn(engine.train_micro_batch_size_per_gpu(), 16)).pow(2).mean()
    engine.backward(loss)
    engine.step()
