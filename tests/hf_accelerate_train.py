"""An Accelerate training loop with a DeepSpeed plugin, as its users write it: no flexrt import. tests/test_hf_clients.py
runs it on real DeepSpeed (torchrun + `tests/real_deepspeed.py`) and on flexrt (`accelerate launch --use_deepspeed` with
the alias installed; `notebook_launcher` after `flexrt.use_as_deepspeed()`, see hf_notebook_launch.py) and compares.

`train(stage, steps, out)`: a GPT-2 from a tiny config (built after the Accelerator, so under `zero.Init` at stage 3),
a torch AdamW and LambdaLR warm-up, `DeepSpeedPlugin(zero_stage=..., gradient_accumulation_steps=2, gradient_clipping=...)`
(which writes `steps_per_print: inf` and "auto" values into the DeepSpeed config), `steps` optimizer steps recording
loss, gradient norm and learning rate; `save_state` half way, `get_state_dict` at the end; then `load_state` and the
second half again. Rank 0 writes {"engine": class, "first": [...], "resumed": [...], "weights": {name: [sum, abs sum]}} to `out`.

    python -m torch.distributed.run --nproc_per_node 2 [-m flexrt.deepspeed] hf_accelerate_train.py --stage 2 --out r.json
"""
import argparse, json, os
import torch
from accelerate import Accelerator, DeepSpeedPlugin, PartialState
from accelerate.utils import set_seed
from transformers import AutoModelForCausalLM, GPT2Config

VOCAB, LENGTH, MICRO, ACCUMULATION = 96, 16, 2, 2

def samples(n:int)->list:
    "Fixed random token sequences; the labels are the inputs (the model shifts them)"
    ids = torch.randint(0, VOCAB, (n, LENGTH), generator=torch.Generator().manual_seed(0))
    return [{'input_ids': x, 'labels': x} for x in ids]

def train(stage:int, steps:int, out:str):
    plugin = DeepSpeedPlugin(zero_stage=stage, gradient_accumulation_steps=ACCUMULATION, gradient_clipping=0.5,
                             zero3_init_flag=stage == 3, zero3_save_16bit_model=True)
    if not torch.cuda.is_available(): PartialState(cpu=True)   # CPU ranks talk over gloo (the Trainer does this for use_cpu=True)
    accelerator = Accelerator(deepspeed_plugin=plugin)
    set_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0., embd_pdrop=0., attn_pdrop=0.,
                        bos_token_id=0, eos_token_id=0)
    model = AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1., (step + 1) / 3))
    loader = torch.utils.data.DataLoader(samples(MICRO * ACCUMULATION * accelerator.num_processes * steps), batch_size=MICRO)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    folder = os.path.join(os.path.dirname(os.path.abspath(out)), f'accelerate_stage{stage}')

    def run(skip:int)->list:
        "Train from micro-batch `skip` to the end; one record per optimizer step"
        records, losses = [], []
        for batch in accelerator.skip_first_batches(loader, skip) if skip else loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                norm = accelerator.clip_grad_norm_(model.parameters(), 0.5) if accelerator.sync_gradients else None
                optimizer.step(); scheduler.step(); optimizer.zero_grad()
            losses.append(accelerator.gather(loss.detach()).mean().item())
            if accelerator.sync_gradients:
                records.append({'loss': sum(losses) / len(losses), 'grad_norm': norm, 'learning_rate': scheduler.get_last_lr()[0]})
                losses = []
                if not skip and len(records) == steps // 2: accelerator.save_state(folder)
        return records

    first = run(0)
    state = accelerator.get_state_dict(model)
    accelerator.load_state(folder)
    resumed = run(ACCUMULATION * (steps // 2))
    if accelerator.is_main_process:
        weights = {k: [v.double().sum().item(), v.double().abs().sum().item()] for k, v in state.items()}
        engine = f'{type(model).__module__}.{type(model).__qualname__}'   # the engine accelerate.prepare built
        with open(out, 'w') as f: json.dump({'engine': engine, 'first': first, 'resumed': resumed, 'weights': weights}, f)
    accelerator.wait_for_everyone()
    accelerator.end_training()

if __name__ == '__main__':
    p = argparse.ArgumentParser()
    p.add_argument('--stage', type=int, required=True)
    p.add_argument('--steps', type=int, default=8)
    p.add_argument('--out', required=True)
    a = p.parse_args()
    train(a.stage, a.steps, a.out)
