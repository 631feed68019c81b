"""The autotuner's measured goals (issues #13, #24) on 2 gloo ranks (CPU), two workloads (a small GPT and a wide MLP).

    python bench/autotune.py [--quick] [--workloads gpt,mlp] [--reps 3] [--seeds 20] [--out bench_out/autotune]
    python bench/autotune.py --phases trust,gpt_time --workloads mlp     # the #24 goals only
    python bench/autotune.py --phases trust --workloads mlp --launcher kernel   # ranks launched from a kernel

Phases (each prints a table; all files go to --out):
1. surface: every rank runs `run_trial` over the grid stage x micro-batches x reduce x allgather/prefetch buckets, `--reps`
   repetitions, each timed as the search times a trial (until the median step time is within 3%, or 40 steps / 4 s), recording the metric, measured peak and the memory model's prediction -> surface_<workload>.csv.
   Prints the memory model's error (predicted vs measured per-rank peak) over every point.
2. search: the default `flexrt.autotune` at three budgets (30/60/90% of the range the grid's peaks span): trials, runs
   per stage to find the largest micro-batch, median per-experiment overhead (seconds - steps_seconds), total time, the
   winner's re-measured samples/s against the baseline's.
3. replay: the search (fast and knobs) replayed against the recorded surface (a measure that draws one of the recorded
   repetitions), over --seeds seeds x workloads x budgets; regret against the grid's best and experiments used, next to a
   re-implementation of DeepSpeed's fast mode and of its grid search with early stopping 5.
4. launch: the same experiments as one torchrun + initialize per experiment (the CLI's launch-per-experiment mode)
   against in-process, end to end.
5. trust (#24, #35): the default search repeated --searches times (10) on a budget-bound workload (--trust-budget,
   10 MiB: the MLP's stages fit 550-700 samples) while a load generator this script starts and stops keeps one core
   busy; then, in the same ranks, a brute-force sweep: every stage x every micro-batch of the search's ladder (its
   min/max_train_micro_batch_size_per_gpu: 1 .. 1024) x every thread count per rank the autotuner considers on CPU
   (`flexrt.autotuner.space.thread_counts`: up to cores // ranks), each with the knobs the search starts from, plus
   every search's winner; --sweep-rounds (7) interleaved rounds, each in a rotated order, each reading timed to 3% or
   1 s (as the playoff times its readings) under the budget (a point over it is measured once and out); after two
   rounds the points below --sweep-cull (0.8) of the best leave the later rounds (the winners stay; a point that left
   is not eligible as the best). A point's score is the median over rounds of its throughput over the stage-0
   reference's in the same round. Prints in how many searches the winner is within 5% of the sweep's best (goal >= 9
   of 10), the sweep's top points, and the runs per stage spent on the largest micro-batch (goal <= 3 on average).
6. gpt_time (#24): the default search on examples/autotune.py's GPT at its default budget, quiet machine (goal <= 60 s).
The ranks (2, gloo) start as --launcher says: `launch` (default: flexrt.launch from this process, the ranks sized as a
user's are), `kernel` (flexrt.launch in a cell of a Jupyter kernel, through nbclient), `torchrun`, or `spawn`
(multiprocessing, torch.set_num_threads(1) in each rank: how this bench ran before #35). Each phase says once how many
torch threads its ranks had. Phase 3 runs in this process. Phases 1-2 need flexrt.autotuner.memory.
"""
import argparse, dataclasses, json, math, os, random, statistics, sys, tempfile, time
from pathlib import Path
import pandas as pd
import torch
from torch import nn

VOCAB, SEQ = 256, 32
def gpt_model():
    torch.manual_seed(1234)
    block = lambda: nn.TransformerEncoderLayer(64, 4, dim_feedforward=256, batch_first=True, norm_first=True)
    return nn.Sequential(nn.Embedding(VOCAB, 64), block(), block(), nn.LayerNorm(64), nn.Linear(64, VOCAB))
def gpt_step(engine):
    tokens = torch.randint(0, VOCAB, (engine.train_micro_batch_size_per_gpu(), SEQ))
    logits = engine(tokens[:, :-1])
    engine.backward(nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)))
    engine.step()
def mlp_model():
    torch.manual_seed(1234)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(256, 256), nn.GELU())], nn.Linear(256, 1))
def mlp_step(engine):
    x = torch.randn(engine.train_micro_batch_size_per_gpu(), 256)
    engine.backward(engine(x).pow(2).mean()); engine.step()
WORKLOADS = {'gpt': (gpt_model, gpt_step), 'mlp': (mlp_model, mlp_step)}
CONFIG = {'optimizer': {'type': 'AdamW', 'params': {'lr': 1e-3}},
          'autotuning': {'start_profile_step': 2, 'end_profile_step': 4, 'max_train_micro_batch_size_per_gpu': 64}}

def grid_points(num_params, micro_batches, stages=(0, 1, 2, 3)):
    from flexrt.autotuner.space import Candidate, knob_choices
    buckets = knob_choices(num_params, stage=2)['reduce_bucket_size']
    for stage in stages:
        for mb in micro_batches:
            if stage == 0: yield Candidate(0, mb); continue
            for r in buckets:
                for a in buckets:
                    yield Candidate(stage, mb, 1, r, a, a if stage == 3 else Candidate(0, 1).stage3_prefetch_bucket_size)

# ---- phase 1 and 2 run on the ranks --------------------------------------------------------------------------------
def rank_surface(workload, micro_batches, reps, out):
    from flexrt import comm
    from flexrt.autotuner.measure import run_trial, TimingRule
    from flexrt.autotuner import memory
    model_fn, step = WORKLOADS[workload]
    comm.init_distributed()
    prof = memory.profile_model(model_fn, CONFIG, train_step=step)
    rows = []
    for c in grid_points(prof.num_params, micro_batches):
        cfg = c.to_config(CONFIG, comm.get_world_size())
        pred = memory.estimate_memory(prof, cfg, world_size=comm.get_world_size(), micro_batch=c.micro_batch).peak_bytes
        for rep in range(reps):
            r = run_trial(model_fn, step, cfg, warmup_steps=2, profile_steps=3, timing=TimingRule())   # as the search measures
            rows.append(dict(stage=c.stage, micro_batch=c.micro_batch, reduce=c.reduce_bucket_size, other=c.allgather_bucket_size,
                             rep=rep, status=r.status, metric=r.metric, peak=r.peak_bytes, predicted=pred,
                             seconds=r.seconds, steps_seconds=r.steps_seconds))
    if comm.get_rank() == 0: pd.DataFrame(rows).to_csv(out, index=False)
    return None

def rank_search(workload, budgets, out):
    from flexrt import comm
    from flexrt.autotuner import autotune
    model_fn, step = WORKLOADS[workload]
    comm.init_distributed()
    rows = []
    for b in budgets:
        t = time.perf_counter()
        res = autotune(model_fn, step, CONFIG, memory_budget=int(b), results_dir=f'{out}/search_{workload}_{int(b)}', resume=False)
        df = res.trials[res.trials.status != 'pruned']
        mx = df[df.phase == 'max_micro_batch'].groupby('stage').size()
        over = (df.seconds - df.steps_seconds).dropna()
        pred = df[(df.status == 'ok') & df.peak_bytes_predicted.notna()]
        err = ((pred.peak_bytes_predicted - pred.peak_bytes_measured) / pred.peak_bytes_measured)
        rows.append(dict(workload=workload, budget=int(b), trials=len(df), seconds=time.perf_counter() - t,
                         max_mb_runs_mean=mx.mean(), max_mb_runs_max=mx.max(), overhead_median=over.median(),
                         winner=f"z{res.best['stage']} mb{res.best['micro_batch']}" if res.best else None,
                         winner_sps=res.best and res.best['samples_per_s'], baseline_sps=res.baseline and res.baseline['samples_per_s'],
                         pred_err_max=err.abs().max(), pred_under_max=(-err).max()))
    return rows

# ---- phase 3: replay (one process) ---------------------------------------------------------------------------------
def replay_measure(surface, rng):
    from types import SimpleNamespace as NS
    by = {k: g for k, g in surface.groupby(['stage', 'micro_batch', 'reduce', 'other'])}
    def fn(c):
        key = (c.stage, c.micro_batch, c.reduce_bucket_size if c.stage else 0, c.allgather_bucket_size if c.stage else 0)
        g = by.get(key)
        if g is None: return NS(status='error', reason='not on the surface', metric=None, peak_bytes=None)
        r = g.iloc[rng.randrange(len(g))]
        return NS(status=r.status, reason='', metric=r.metric if r.status == 'ok' else None, peak_bytes=r.peak)
    return fn

def ours(surface, budget, seed, fast, num_params, mbs):
    from flexrt.autotuner.space import TuneSettings
    from flexrt.autotuner.search import Search
    pred = {(r.stage, r.micro_batch, r.reduce, r.other): r.predicted for r in surface.itertuples()}
    predict = lambda c: pred.get((c.stage, c.micro_batch, c.reduce_bucket_size if c.stage else 0, c.allgather_bucket_size if c.stage else 0), 1 << 60)
    s = Search(TuneSettings(fast=fast, max_micro_batch=max(mbs)), predict=predict, memory_budget=budget, world_size=2,
               num_params=num_params, micro_batches=mbs, seed=seed)
    m, rng = None, random.Random(seed)
    m = replay_measure(surface, rng)
    def budgeted(c):
        r = m(c)
        if r.status == 'ok' and r.peak_bytes > budget: r.status, r.metric = 'over_budget', None
        return r
    gen = s.plan()
    try:
        batch = next(gen)
        while True: batch = gen.send([budgeted(e.candidate) for e in batch])
    except StopIteration: pass
    truth = surface.groupby(['stage', 'micro_batch', 'reduce', 'other']).metric.mean()
    c = s.best[1]
    playoff = sum(r['phase'] == 'playoff' for r in s.records)
    return truth[(c.stage, c.micro_batch, c.reduce_bucket_size if c.stage else 0, c.allgather_bucket_size if c.stage else 0)], s.runs + playoff

def deepspeed_fast(mean, feasible, mbs):
    "DeepSpeed's fast mode on the surface: per stage binary-search the largest mbs, try 3 sizes from max/2, stop when a stage does not beat the previous"
    runs, best, prev = 0, -1, -1
    for stage in range(4):
        ok = [m for m in mbs if feasible.get((stage, m, 0, 0) if stage == 0 else (stage, m, *DEFAULT[stage]), False)]
        lo, hi = 0, len(mbs) - 1
        while lo <= hi: mid = (lo + hi) // 2; runs += 1; (lo := mid + 1) if mbs[mid] in ok else (hi := mid - 1)
        if not ok: continue
        top = max(ok); tried = [m for m in mbs if top // 2 <= m <= top][-3:]
        runs += len(tried)
        key = lambda m: (stage, m, 0, 0) if stage == 0 else (stage, m, *DEFAULT[stage])
        stage_best = max(mean[key(m)] for m in tried)
        best = max(best, stage_best)
        if stage_best <= prev: break
        prev = stage_best
    return best, runs

def grid_early_stop(mean, feasible, keys, patience=5):
    best, since, runs = -1, 0, 0
    for k in keys:
        runs += 1
        v = mean[k] if feasible.get(k) else -1
        if v > best: best, since = v, 0
        else: since += 1
        if since >= patience: break
    return best, runs

DEFAULT = {}
def replay(out, workloads, seeds):
    rows = []
    for w in workloads:
        surface = pd.read_csv(f'{out}/surface_{w}.csv')
        surface.loc[surface.stage == 0, ['reduce', 'other']] = 0
        ok = surface[surface.status == 'ok']
        mean = ok.groupby(['stage', 'micro_batch', 'reduce', 'other']).metric.mean()
        noise = (ok.groupby(['stage', 'micro_batch', 'reduce', 'other']).metric.std() / mean).median()
        peak = surface.groupby(['stage', 'micro_batch', 'reduce', 'other']).peak.max()
        mbs = sorted(surface.micro_batch.unique())
        lo, hi = peak.min(), peak.max()
        num_params = int(surface.reduce[surface.reduce > 0].max())
        for stage in (1, 2, 3):
            sub = [k for k in mean.index if k[0] == stage]
            sizes = sorted({k[2] for k in sub}); DEFAULT[stage] = (sizes[-1], sizes[-1])   # one bucket: DeepSpeed's 5e8 on a model this small
        for frac in (0.3, 0.6, 0.9):
            budget = lo + frac * (hi - lo)
            feasible = {k: (k in mean.index and peak[k] <= budget) for k in peak.index}
            best = max(mean[k] for k in mean.index if feasible[k])
            grid = len(peak)
            for fast in (True, False):
                res = [ours(surface, budget, seed, fast, num_params, mbs) for seed in range(seeds)]
                regret = [1 - v / best for v, _ in res]
                rows.append(dict(workload=w, budget_frac=frac, method=f"flexrt {'fast' if fast else 'knobs'}", grid=grid,
                                 noise=noise, regret_median=statistics.median(regret), regret_max=max(regret),
                                 within=sum(r <= max(0.02, noise) for r in regret) / len(regret),
                                 runs_median=statistics.median(r for _, r in res)))
            v, n = deepspeed_fast(mean, feasible, mbs)
            rows.append(dict(workload=w, budget_frac=frac, method='deepspeed fast', grid=grid, noise=noise, regret_median=1 - v / best,
                             regret_max=1 - v / best, within=float(1 - v / best <= max(0.02, noise)), runs_median=n))
            v, n = grid_early_stop(mean, feasible, sorted(peak.index))
            rows.append(dict(workload=w, budget_frac=frac, method='deepspeed grid (early stop 5)', grid=grid, noise=noise,
                             regret_median=1 - v / best, regret_max=1 - v / best, within=float(1 - v / best <= max(0.02, noise)), runs_median=n))
    return pd.DataFrame(rows)

# ---- phase 5: trust (#24) -----------------------------------------------------------------------------------------------
def load_generator():
    "A process that keeps one core busy until killed"
    import subprocess
    return subprocess.Popen([sys.executable, '-c', 'while True: pass'])

def thread_choices(world:int)->list:
    "Threads per rank the sweep tries on CPU: the autotuner's own candidates, else 1 .. cores // ranks on the node"
    from flexrt.utils.threads import available_cores
    from flexrt.autotuner import space
    if torch.cuda.is_available(): return [None]
    if hasattr(space, 'thread_counts'): return space.thread_counts(available_cores(), world)
    return list(range(1, max(1, available_cores() // world) + 1))

def sweep_grid(model_fn, cfg:dict, world:int)->dict: # key -> {'config', 'name'}
    "Every stage x every micro-batch of the search's ladder (x threads per rank on CPU), with the search's first knobs"
    from flexrt.autotuner.space import (Candidate, tune_settings, micro_batch_ladder, gradient_accumulation,
                                        default_knobs)
    s = tune_settings(cfg)
    sizes = [p.numel() for p in model_fn().parameters()]
    carries_threads = 'threads_per_rank' in {f.name for f in dataclasses.fields(Candidate)}
    grid = {}
    for stage in s.stages:
        knobs = default_knobs(sum(sizes), stage, sizes, s.bucket_sizes) if stage else {}
        for m in micro_batch_ladder(s.min_micro_batch, s.max_micro_batch):
            c = Candidate(stage, m, gradient_accumulation(s, m, world), **knobs)
            for t in thread_choices(world):
                if carries_threads:   # the autotuner's own candidate: its key and config say the threads
                    point = dataclasses.replace(c, threads_per_rank=t)
                    key, config = point.key, point.to_config(cfg, world)
                else:                 # the config key flexrt.initialize honours
                    key, config = f'{c.key}_t{t}', {**c.to_config(cfg, world), 'threads_per_rank': t}
                grid[key] = dict(config=config, name=f"z{stage} mb{m}" + (f" t{t}" if t else ''))
    return grid

def _stage(point:dict)->int: return point['config']['zero_optimization']['stage']
def _micro_batch(point:dict)->int: return point['config']['train_micro_batch_size_per_gpu']

def sweep(model_fn, step, grid:dict, keep:set, budget:int, rounds:int, cull:float)->dict:
    "Every point of `grid` in `rounds` interleaved rounds (rotated orders); each one's median ratio to stage 0's"
    from flexrt.autotuner.measure import run_trial, TimingRule
    keys = sorted(grid)
    alive, ratios, status, threads, culled, reference = list(keys), {k: [] for k in keys}, {}, {}, set(), None
    for r in range(rounds):
        order = alive[r % len(alive):] + alive[:r % len(alive)]
        got = {}
        for k in order:   # timed as the playoff times its readings: to 3 % or 1 s
            got[k] = run_trial(model_fn, step, grid[k]['config'], warmup_steps=2, profile_steps=5,
                               timing=TimingRule(max_seconds=1.0), memory_budget=budget)
            threads[k] = torch.get_num_threads()   # what the trial ran with (flexrt.initialize sizes it)
            if got[k].status != 'ok': status[k] = got[k].status   # over the budget (or failed): measured once
        alive = [k for k in alive if k not in status]
        if reference is None:   # a point of the grid: stage 0 at its largest micro-batch that fits, the most threads
            zero = [k for k in alive if _stage(grid[k]) == 0 and not grid[k].get('winner')]
            reference = max(zero, key=lambda k: (_micro_batch(grid[k]), threads[k]), default=None)
        if reference is None or got.get(reference) is None or got[reference].status != 'ok': continue
        for k, g in got.items():
            if g.status == 'ok': ratios[k].append(g.metric / got[reference].metric)
        if cull and r == 1:   # after two readings, points far below the best leave the later rounds (winners stay)
            best = max(statistics.median(v) for v in ratios.values() if v)
            low = lambda k: statistics.median(ratios[k] or [0]) < cull * best
            culled = {k for k in alive if k not in keep and k != reference and low(k)}
            alive = [k for k in alive if k not in culled]
    score = {k: statistics.median(v) for k, v in ratios.items() if v}
    return dict(score=score, status=status, threads=threads, culled=culled,
                readings={k: len(v) for k, v in ratios.items()})

def rank_trust(workload, budget, searches, rounds, out, cull=0.8, max_micro_batch=1024):
    from flexrt import comm
    from flexrt.autotuner import autotune
    from flexrt.autotuner.results import record_candidate
    model_fn, step = WORKLOADS[workload]
    comm.init_distributed()
    cfg = {**CONFIG, 'autotuning': {**CONFIG['autotuning'], 'max_train_micro_batch_size_per_gpu': max_micro_batch}}
    rows, grid = [], sweep_grid(model_fn, cfg, comm.get_world_size())
    ladder, sized = len(grid), f'_t{max(thread_choices(comm.get_world_size()))}'
    for i in range(searches):
        t = time.perf_counter()
        res = autotune(model_fn, step, cfg, memory_budget=int(budget), results_dir=f'{out}/trust_{workload}_{i}',
                       resume=False)
        df, winner = res.trials, record_candidate(res.best).key
        if winner + sized in grid: winner += sized   # a winner without a count ran with the sized threads
        grid.setdefault(winner, dict(config=res.best_config, winner=True,
                                     name=f"z{res.best['stage']} mb{res.best['micro_batch']} (a winner)"))
        mx = df[(df.phase == 'max_micro_batch') & (df.status != 'pruned')].groupby('stage').size()
        rows.append(dict(search=i, seconds=time.perf_counter() - t, winner=winner, name=grid[winner]['name'],
                         threads=res.best.get('threads_per_rank') or torch.get_num_threads(), verdict=res.verdict,
                         runs=int(((df.status != 'pruned') & (df.phase != 'playoff')).sum()),
                         playoff_runs=int((df.phase == 'playoff').sum()),
                         max_mb_runs={int(k): int(v) for k, v in mx.items()}))
    t = time.perf_counter()
    got = sweep(model_fn, step, grid, {row['winner'] for row in rows}, int(budget), rounds, cull)
    score, culled = got['score'], got['culled']
    best = max((k for k in score if k not in culled), key=score.get)   # among the points read in every round
    for row in rows: row['vs_sweep_best'] = score.get(row['winner'], float('nan')) / score[best]
    table = [dict(name=grid[k]['name'], score=score[k] / score[best], readings=got['readings'][k],
                  threads=got['threads'][k], culled=k in culled) for k in sorted(score, key=score.get, reverse=True)]
    return dict(rows=rows, grid=ladder, points=len(grid), rounds=rounds, best=grid[best]['name'], table=table,
                over=sorted(grid[k]['name'] + f" ({v})" for k, v in got['status'].items()),
                sweep_seconds=time.perf_counter() - t, cull=cull, culled=len(culled))

def rank_gpt_time(out):
    from flexrt import comm
    from flexrt.autotuner import autotune
    import importlib.util
    spec = importlib.util.spec_from_file_location('example_autotune', Path(__file__).parent.parent / 'examples' / 'autotune.py')
    example = importlib.util.module_from_spec(spec); spec.loader.exec_module(example)
    comm.init_distributed()
    t = time.perf_counter()
    res = autotune(example.model_fn, example.train_step, example.CONFIG, memory_budget='16MiB', results_dir=f'{out}/gpt_time', resume=False)
    return dict(seconds=time.perf_counter() - t, trials=int((res.trials.status != 'pruned').sum()), verdict=res.verdict)

# ---- phase 4: in-process vs one launch per experiment ---------------------------------------------------------------
SCRIPT = '''import argparse, sys, torch
sys.path.insert(0, {bench!r})
import flexrt as deepspeed
from autotune import WORKLOADS
p = argparse.ArgumentParser(); p.add_argument('--local_rank', type=int, default=-1); p = deepspeed.add_config_arguments(p)
args = p.parse_args(); deepspeed.init_distributed(dist_backend='gloo')
model_fn, step = WORKLOADS[{w!r}]
engine, *_ = deepspeed.initialize(args=args, model=model_fn())
for _ in range(1000): step(engine)
'''
def launch_compare(out, workload, candidates):
    from flexrt.autotuner.cli import LaunchMeasure
    script = Path(out) / f'script_{workload}.py'
    script.write_text(SCRIPT.format(bench=str(Path(__file__).parent), w=workload))
    lm = LaunchMeasure(str(script), [], 2, str(Path(out) / f'launch_{workload}'))
    t = time.perf_counter()
    results = [lm(None, None, c.to_config(CONFIG, 2), warmup_steps=2, profile_steps=3) for c in candidates]
    return time.perf_counter() - t, [r.status for r in results]

def rank_inprocess(workload, candidates):
    from flexrt import comm
    from flexrt.autotuner.measure import run_trial
    from flexrt.autotuner.space import Candidate
    model_fn, step = WORKLOADS[workload]
    comm.init_distributed()
    t = time.perf_counter()
    for c in candidates:   # Candidates, or their fields (from a launcher's JSON)
        c = Candidate(**c) if isinstance(c, dict) else c
        run_trial(model_fn, step, c.to_config(CONFIG, 2), warmup_steps=2, profile_steps=3)
    return time.perf_counter() - t

def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--quick', action='store_true', help='fewer micro-batches and repetitions, 5 seeds')
    p.add_argument('--workloads', default='gpt,mlp'); p.add_argument('--reps', type=int, default=3)
    p.add_argument('--seeds', type=int, default=20); p.add_argument('--out', default='bench_out/autotune')
    p.add_argument('--micro-batches', default=None, help='the surface\'s micro-batches, e.g. 1,4,16,32 (default: 1..64, --quick 1,4,16,32)')
    p.add_argument('--phases', default='surface,search,replay,launch,trust,gpt_time')
    p.add_argument('--searches', type=int, default=10); p.add_argument('--sweep-rounds', type=int, default=7)
    p.add_argument('--trust-budget', default='10MiB', help="the budget-bound search's per-rank budget")
    p.add_argument('--trust-max-micro-batch', type=int, default=1024,
                   help="the trust searches' (and sweep's) largest micro-batch")
    p.add_argument('--sweep-cull', type=float, default=0.8,
                   help='after two sweep rounds, points below this share of the best leave the later rounds (0: none)')
    p.add_argument('--launcher', default='launch', choices=['launch', 'kernel', 'torchrun', 'spawn'],
                   help="how the ranks start: flexrt.launch from this process (a user's ranks), flexrt.launch in a "
                        "Jupyter kernel, torchrun, or spawn (multiprocessing, torch.set_num_threads(1) in each rank)")
    a = p.parse_args()
    a.out = os.path.abspath(a.out)   # ranks under torchrun or in a kernel write there too
    os.makedirs(a.out, exist_ok=True)
    workloads, phases = a.workloads.split(','), a.phases.split(',')
    mbs = [int(m) for m in a.micro_batches.split(',')] if a.micro_batches else [1, 4, 16, 32] if a.quick else [1, 2, 4, 8, 16, 32, 48, 64]
    reps, seeds = (2, 5) if a.quick else (a.reps, a.seeds)
    print(f'# bench/autotune.py {"--quick " if a.quick else ""}workloads={workloads} micro_batches={mbs} reps={reps} '
          f'seeds={seeds} launcher={a.launcher}')
    import multiprocessing as mp
    ctx = mp.get_context('spawn')
    from launchers import open_launcher
    launcher = open_launcher(a.launcher, f'{a.out}/ranks') if a.launcher != 'spawn' else None
    said = set()
    def ranks(fn, *args):
        "Rank 0's `fn(*args)`, run on 2 ranks started by --launcher; says once how many threads the ranks had"
        if launcher is not None:
            got = launcher.run(__file__, fn.__name__, args, tag=fn.__name__)
            notes = [r['notes'] for r in got]
            given = ','.join(str(n['threads_given']) for n in notes)
            line = (f"(ranks started by {a.launcher}: torch threads per rank {given} on entry, "
                    f"{','.join(str(n['threads_at_end']) for n in notes)} at the end; OMP_NUM_THREADS "
                    f"{notes[0]['omp_num_threads'] or 'unset'}; it said: {launcher.launch_line})")
            if line not in said: said.add(line); print(line, flush=True)
            return got[0]['result']
        import socket
        with socket.socket() as s: s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port), WORLD_SIZE='2')
        q = ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(r, fn, args, q)) for r in range(2)]
        for pr in procs: pr.start()
        out = dict(q.get() for _ in procs)
        for pr in procs: pr.join()
        if any(isinstance(v, str) and v.startswith('ERROR') for v in out.values()): raise RuntimeError(out)
        if not said:
            said.add('spawn')
            print('(ranks started by multiprocessing spawn, torch.set_num_threads(1) in each)', flush=True)
        return out[0]
    try: run_phases(a, workloads, phases, mbs, seeds, reps, ranks)
    finally:
        if launcher is not None: launcher.close()

def run_phases(a, workloads, phases, mbs, seeds, reps, ranks):
    "The phases asked for, in order; `ranks(fn, *args)` runs a rank function on 2 ranks and returns rank 0's result"
    for w in workloads:
        if 'surface' in phases:
            t = time.perf_counter(); ranks(rank_surface, w, mbs, reps, f'{a.out}/surface_{w}.csv')
            s = pd.read_csv(f'{a.out}/surface_{w}.csv'); ok = s[s.status == 'ok']
            err = (ok.predicted - ok.peak) / ok.peak
            print(f'\n## surface {w}: {len(s)} trials in {time.perf_counter() - t:.0f} s; memory model error over {len(ok)} ok trials: '
                  f'max |err| {err.abs().max():.2%}, most under {max(0, -err.min()):.2%}, median |err| {err.abs().median():.2%}')
            print(ok.assign(err=err).groupby('stage').err.agg(['min', 'max', 'count']).to_string())
        if 'search' in phases:
            s = pd.read_csv(f'{a.out}/surface_{w}.csv'); lo, hi = s.peak.min(), s.peak.max()
            rows = ranks(rank_search, w, [lo + f * (hi - lo) for f in (0.3, 0.6, 0.9)], a.out)
            print(f'\n## default search, {w}\n' + pd.DataFrame(rows).to_string(index=False))
        if 'launch' in phases:
            from flexrt.autotuner.space import Candidate
            cands = [Candidate(st, mb) for st in (0, 1) for mb in (4, 8)]
            t_in = ranks(rank_inprocess, w, [dataclasses.asdict(c) for c in cands])
            t_launch, st = launch_compare(a.out, w, cands)
            print(f'\n## {len(cands)} experiments, {w}: in-process {t_in:.1f} s, one torchrun each {t_launch:.1f} s '
                  f'({t_launch / t_in:.1f}x slower; statuses {st})')
    if 'trust' in phases:
        from flexrt.autotuner.space import parse_bytes
        for w in workloads:
            busy = load_generator()
            try: got = ranks(rank_trust, w, parse_bytes(a.trust_budget), a.searches, a.sweep_rounds, a.out,
                             a.sweep_cull, a.trust_max_micro_batch)
            finally: busy.kill(); busy.wait()
            df = pd.DataFrame(got['rows'])
            df.to_csv(f'{a.out}/trust_{w}.csv', index=False)
            pd.DataFrame(got['table']).to_csv(f'{a.out}/trust_sweep_{w}.csv', index=False)
            runs = [n for d in df.max_mb_runs for n in d.values()]
            within = int((df.vs_sweep_best >= 0.95).sum())
            cull = (f"; after 2 rounds {got['culled']} points below {got['cull']:.0%} of the best left the rest "
                    f"(not eligible as the best)" if got['cull'] else '')
            threads = sorted({r['threads'] for r in got['table']})
            print(f"\n## trust, {w}, budget {a.trust_budget}, one core kept busy: winner within 5 % of the brute-force "
                  f"best in {within} of {len(df)} searches (goal >= 9 of 10)")
            print(f"   brute force: {got['grid']} points (every stage x every micro-batch of the ladder x threads per "
                  f"rank {threads}) + the winners = {got['points']}, {got['rounds']} interleaved rounds in rotated "
                  f"orders, {got['sweep_seconds']:.0f} s{cull}; best {got['best']}; measured once and out: "
                  f"{', '.join(got['over']) or 'none'}")
            print(f"   largest micro-batch: {statistics.mean(runs):.2f} runs per stage on average, at most {max(runs)} "
                  f"(goal <= 3)")
            columns = ['search', 'name', 'threads', 'vs_sweep_best', 'runs', 'playoff_runs', 'seconds', 'verdict']
            print(df[columns].to_string(index=False))
            print("   the sweep's top 8 (score: median over rounds of throughput / the stage-0 reference's, over the "
                  "best's):")
            print(pd.DataFrame(got['table'][:8]).to_string(index=False))
    if 'gpt_time' in phases:
        got = ranks(rank_gpt_time, a.out)
        print(f"\n## default search on examples/autotune.py's GPT (16 MiB, 2 ranks, quiet): {got['seconds']:.1f} s, {got['trials']} runs "
              f"(goal <= 60 s); {got['verdict']}")
    if 'replay' in phases:
        df = replay(a.out, workloads, seeds)
        df.to_csv(f'{a.out}/replay.csv', index=False)
        print('\n## replay against the recorded surfaces (regret = 1 - chosen/grid best, mean of the repetitions)\n' + df.to_string(index=False))

def _rank(rank, fn, args, q):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE='2')
    torch.set_num_threads(1)
    try: q.put((rank, fn(*args)))
    except BaseException:
        import traceback; q.put((rank, 'ERROR ' + traceback.format_exc()))
    finally:
        from flexrt import comm
        if comm.is_initialized() and comm.get_world_size() > 1: comm.destroy_process_group()

if __name__ == '__main__':
    sys.path.insert(0, str(Path(__file__).parent))
    main()
