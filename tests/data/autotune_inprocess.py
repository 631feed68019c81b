"A script the autotuner tunes in-process: it defines model_fn and train_step (tests/test_autotuner_cli.py)"
import torch, torch.nn as nn
def model_fn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 1))
def train_step(engine):
    loss = engine(torch.randn(engine.train_micro_batch_size_per_gpu(), 16)).pow(2).mean()
    engine.backward(loss)
    engine.step()
if __name__ == '__main__':
    raise SystemExit('this entry must not run while tuning')
