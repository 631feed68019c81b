"""A Hugging Face `Trainer` with a DeepSpeed config, as its users write it: no flexrt import. tests/test_hf_clients.py
runs it under torchrun on real DeepSpeed (`tests/real_deepspeed.py hf_trainer_train.py ...`) and on flexrt
(`-m flexrt.deepspeed hf_trainer_train.py ...`) and compares what it writes.

For each ZeRO stage asked for: a GPT-2 from a tiny config (built through `from_config`, so under `zero.Init` at stage 3,
while the config still holds "auto" values), random tokens, `--steps` optimizer steps logging every step and saving a
checkpoint half way; `save_model` at the end; then a second Trainer resumes from the half-way checkpoint and runs the
remaining steps again. Writes {stage: {"engine": class, "partitioned": built under zero.Init, "first": log, "resumed": log, "saved": [files]}} to `--out` on rank 0.

    python -m torch.distributed.run --nproc_per_node 2 [-m flexrt.deepspeed] hf_trainer_train.py --out r.json --stages 0 2 3
"""
import argparse, json, os
import torch
from transformers import AutoModelForCausalLM, GPT2Config, Trainer, TrainingArguments, set_seed

VOCAB, LENGTH = 96, 16

class RandomTokens(torch.utils.data.Dataset):
    "Fixed random token sequences; the labels are the inputs (the model shifts them)"
    def __init__(self, n:int, seed:int=0):
        self.ids = torch.randint(0, VOCAB, (n, LENGTH), generator=torch.Generator().manual_seed(seed))
    def __len__(self): return len(self.ids)
    def __getitem__(self, i): return {'input_ids': self.ids[i], 'labels': self.ids[i]}

def ds_config(stage:int)->dict:
    "A DeepSpeed config as the Transformers docs write one: sizes, rates and buckets left to the Trainer ('auto')"
    return {'train_micro_batch_size_per_gpu': 'auto', 'train_batch_size': 'auto', 'gradient_accumulation_steps': 'auto',
            'gradient_clipping': 'auto', 'steps_per_print': 1000,
            'optimizer': {'type': 'AdamW', 'params': {'lr': 'auto', 'betas': 'auto', 'eps': 'auto', 'weight_decay': 'auto', 'torch_adam': True}},
            'scheduler': {'type': 'WarmupDecayLR', 'params': {'warmup_min_lr': 'auto', 'warmup_max_lr': 'auto',
                                                              'warmup_num_steps': 'auto', 'total_num_steps': 'auto'}},
            'zero_optimization': {'stage': stage, 'reduce_bucket_size': 'auto', 'stage3_prefetch_bucket_size': 'auto',
                                  'stage3_param_persistence_threshold': 'auto', 'stage3_gather_16bit_weights_on_model_save': True}}

def arguments(output_dir:str, stage:int, steps:int)->TrainingArguments:
    return TrainingArguments(output_dir=output_dir, deepspeed=ds_config(stage), max_steps=steps, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, learning_rate=3e-3, warmup_steps=2, max_grad_norm=0.5, weight_decay=0.01,
                             logging_steps=1, save_steps=steps // 2, save_strategy='steps', report_to=[], disable_tqdm=True,
                             use_cpu=True, seed=7, dataloader_drop_last=True)

def model():
    "GPT-2 from a tiny config, no dropout (the two libraries draw random numbers differently)"
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0., embd_pdrop=0., attn_pdrop=0.,
                        bos_token_id=0, eos_token_id=0)
    set_seed(0)
    return AutoModelForCausalLM.from_config(config)

def steps_of(history:list)->list:
    "One entry per logged training step: loss, gradient norm, learning rate"
    return [{k: h.get(k) for k in ('step', 'loss', 'grad_norm', 'learning_rate')} for h in history if 'loss' in h]

def run(stage:int, steps:int, root:str)->dict:
    out = os.path.join(root, f'stage{stage}')
    data = RandomTokens(64)
    args = arguments(out, stage, steps)                  # before the model: at stage 3 from_config builds it under zero.Init
    built = model()
    partitioned = all(p.numel() == 0 for p in built.parameters())   # built under zero.Init: each rank holds only its shards
    trainer = Trainer(model=built, args=args, train_dataset=data)
    trainer.train()
    first = steps_of(trainer.state.log_history)
    engine = f'{type(trainer.model_wrapped).__module__}.{type(trainer.model_wrapped).__qualname__}'   # the engine the Trainer built
    trainer.save_model(os.path.join(out, 'final'))
    args = arguments(out, stage, steps)
    resumed = Trainer(model=model(), args=args, train_dataset=data)
    resumed.train(resume_from_checkpoint=os.path.join(out, f'checkpoint-{steps // 2}'))
    saved = sorted(os.listdir(os.path.join(out, 'final')))
    return {'engine': engine, 'partitioned': partitioned, 'first': first, 'resumed': steps_of(resumed.state.log_history), 'saved': saved}

if __name__ == '__main__':
    p = argparse.ArgumentParser()
    p.add_argument('--out', required=True)
    p.add_argument('--stages', type=int, nargs='+', default=[0, 2, 3])
    p.add_argument('--steps', type=int, default=10)
    a = p.parse_args()
    results = {stage: run(stage, a.steps, os.path.dirname(os.path.abspath(a.out))) for stage in a.stages}
    if int(os.environ.get('RANK', 0)) == 0:
        with open(a.out, 'w') as f: json.dump(results, f)
