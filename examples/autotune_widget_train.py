"""What `examples/autotune.ipynb` tunes: the quickstart's GPT-style model, one training micro-step, and the config.

They live in a module, not in the notebook, so ranks started by fork or spawn alike can import them.
"""
import torch
from torch import nn
from quickstart_train import tiny_transformer

VOCAB, SEQUENCE = 256, 32

CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
    "autotuning": {"fast": True, "start_profile_step": 2, "end_profile_step": 3},
}

def model_fn():
    "A fresh quickstart GPT model (the autotuner builds one per trial)"
    torch.manual_seed(0)
    return tiny_transformer(vocab=VOCAB)

def train_step(engine):
    "One micro-step on random tokens: forward, backward, step"
    tokens = torch.randint(0, VOCAB, (engine.train_micro_batch_size_per_gpu(), SEQUENCE + 1))
    logits = engine(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    engine.backward(loss)
    engine.step()
