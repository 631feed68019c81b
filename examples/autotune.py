"""Autotune a small GPT-style model on N ranks: the fastest ZeRO stage x micro-batch (x ZeRO knobs with --knobs) that
fits a per-rank memory budget, found inside the launched ranks, then a few training steps with the winner.

    torchrun --nproc_per_node 2 examples/autotune.py                       # default search, 2 CPU ranks
    torchrun --nproc_per_node 2 examples/autotune.py --memory-budget 8MiB --knobs
    flexrt autotune examples/autotune.py --config my_ds.json --nproc 2      # the same functions, from the command line

Results go to `autotuning_results/` (summary.txt, trials.csv, ds_config_optimal.json, exps/, study.db).
"""
import argparse, json
import torch
from torch import nn

CONFIG = {
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
    "autotuning": {"max_train_micro_batch_size_per_gpu": 64, "start_profile_step": 2, "end_profile_step": 4},
}
VOCAB, SEQ = 256, 32

def model_fn():
    "A small GPT-style model: embedding, transformer blocks, a head (a fresh one per experiment)"
    torch.manual_seed(1234)
    block = lambda: nn.TransformerEncoderLayer(64, 4, dim_feedforward=256, batch_first=True, norm_first=True)
    return nn.Sequential(nn.Embedding(VOCAB, 64), block(), block(), nn.LayerNorm(64), nn.Linear(64, VOCAB))

def train_step(engine):
    "One micro-step on random tokens: forward, backward, step"
    tokens = torch.randint(0, VOCAB, (engine.train_micro_batch_size_per_gpu(), SEQ), device=engine.device)
    logits = engine(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    engine.backward(loss)
    engine.step()
    return loss

def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--memory-budget', default='16MiB', help="per-rank budget, e.g. '16MiB'")
    p.add_argument('--knobs', action='store_true', help='also search the ZeRO knobs (autotuning.fast = false)')
    p.add_argument('--results-dir', default='autotuning_results')
    p.add_argument('--max-trials', type=int, default=None)
    args = p.parse_args()
    import flexrt
    from flexrt import comm
    comm.init_distributed()
    config = {**CONFIG, 'autotuning': {**CONFIG['autotuning'], 'fast': not args.knobs}}
    result = flexrt.autotune(model_fn, train_step, config, memory_budget=args.memory_budget,
                             results_dir=args.results_dir, max_trials=args.max_trials, resume=False)
    if comm.get_rank() == 0:
        print(open(f'{result.results_dir}/summary.txt').read())
        print('best_config:', json.dumps(result.best_config))
    engine, *_ = flexrt.initialize(model=model_fn(), config=result.best_config)   # the winner, as is
    for _ in range(3 * engine.gradient_accumulation_steps()): loss = train_step(engine)
    if comm.get_rank() == 0: print(f'trained {engine.global_steps} steps with the winner, loss {loss.item():.3f}')
    engine.close()
    comm.destroy_process_group()

if __name__ == '__main__':
    main()
