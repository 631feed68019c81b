"""flexrt's CUDA paths on one GPU: what CI (CPU only) cannot run. One process, one rank, NCCL.

    python tools/gpu_check.py [--out DIR] [--dry-run]     # make gpu-check; --dry-run: on the CPU, to check the script itself

Each check prints PASS / FAIL with its numbers; the last lines are a table, and the exit status is the number of
failures. Checks:
- engine: ZeRO stages 0-3 in fp32 against plain torch (same model, AdamW, clipping, data) on the GPU; bf16 and fp16
  stages against each other and near fp32; parameters, gradients and optimizer state on the GPU.
- fp16 overflow: an inf loss skips the step, halves the scale, leaves the weights alone.
- non-finite: a nan planted in one layer's gradient is named (step, rank 0, parameter) and stops the run.
- checkpoints: save on the GPU, resume exactly (dropout's CUDA RNG too); a CPU-only process loads it.
- memory: snapshots and step records report the CUDA device; the memory model's prediction against the measured
  CUDA peak (`run_trial`) at every stage.
- comm: the comms logger times NCCL collectives with CUDA events (async ops included).
"""
import argparse, json, os, subprocess, sys, tempfile, time, traceback
from pathlib import Path
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
DEVICE = 'cuda' if torch.cuda.is_available() else 'cpu'   # CPU only for a dry run of the script itself (--dry-run)
sys.path.insert(0, str(ROOT))
RESULTS = []

def check(name):
    def wrap(fn):
        def run():
            start = time.perf_counter()
            try: detail, ok = fn(), True
            except Exception as e: detail, ok = f'{type(e).__name__}: {e}'.splitlines()[0][:300], False; traceback.print_exc()
            RESULTS.append((name, ok, detail, time.perf_counter() - start))
            print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
        return run
    return wrap

def model_fn(dropout=0.0, dim=64, layers=2):
    torch.manual_seed(0)
    block = lambda: nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=dropout, batch_first=True, norm_first=True)
    return nn.Sequential(nn.Embedding(256, dim), *[block() for _ in range(layers)], nn.LayerNorm(dim), nn.Linear(dim, 256))

def config(stage=0, precision='fp32', **extra):
    c = {'train_micro_batch_size_per_gpu': 8, 'gradient_clipping': 1.0, 'steps_per_print': 10**9,
         'optimizer': {'type': 'AdamW', 'params': {'lr': 1e-3, 'weight_decay': 0.01}},
         'zero_optimization': {'stage': stage, 'reduce_bucket_size': 20_000, 'stage3_prefetch_bucket_size': 20_000,
                               'stage3_param_persistence_threshold': 100}}
    if precision == 'fp16': c['fp16'] = {'enabled': True, 'initial_scale_power': 12}
    if precision == 'bf16': c['bf16'] = {'enabled': True}
    return {**c, **extra}

def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (8, 33), generator=g) for _ in range(n)]

def loss_of(out, idx): return nn.functional.cross_entropy(out.float().reshape(-1, 256), idx[:, 1:].reshape(-1))

def train(engine, data):
    losses = []
    for idx in data:
        idx = idx.to(engine.device)
        loss = loss_of(engine(idx[:, :-1]), idx)
        engine.backward(loss); engine.step(); losses.append(loss.item())
    return losses

def full_params(engine)->dict:
    "Every parameter whole, fp32, on the CPU (stage 3 gathers)"
    import flexrt
    with flexrt.zero.GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().float().cpu().clone() for n, p in engine.module.named_parameters()}

def engine_for(cfg, dropout=0.0):
    import flexrt
    model = model_fn(dropout)
    engine, *_ = flexrt.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine

def max_rel(a:dict, b:dict)->float:
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12)) for k in b)

@check('engine fp32 stages 0-3 = plain torch on the GPU')
def engine_fp32():
    data = batches(6)
    model = model_fn().to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    for idx in data:
        idx = idx.to(DEVICE)
        loss_of(model(idx[:, :-1]), idx).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0); opt.step(); opt.zero_grad()
    ref = {n: p.detach().cpu() for n, p in model.named_parameters()}
    errors = {}
    for stage in range(4):
        engine = engine_for(config(stage))
        assert engine.device.type == DEVICE, f'engine on {engine.device}'
        on = {p.device.type for p in engine.module.parameters()}
        assert on == {DEVICE}, f'stage {stage}: parameters on {on}'
        train(engine, data)
        errors[stage] = max_rel(full_params(engine), ref)
        engine.close()
    assert max(errors.values()) < 1e-4, f'relative weight error vs torch: {errors}'
    return 'max relative weight error vs torch after 6 steps: ' + ', '.join(f'stage {s} {e:.1e}' for s, e in errors.items())

@check('engine bf16 / fp16 stages 0-3: agree, near fp32')
def engine_half():
    data = batches(6)
    fp32 = train(engine_for(config(0)), data)
    out = []
    for precision in ('bf16', 'fp16'):
        losses, params = {}, {}
        for stage in range(4):
            engine = engine_for(config(stage, precision))
            dtypes = {p.dtype for p in engine.module.parameters()}
            assert dtypes == {torch.bfloat16 if precision == 'bf16' else torch.float16}, f'{precision} stage {stage}: {dtypes}'
            losses[stage] = train(engine, data)
            params[stage] = full_params(engine)
            assert engine.skipped_steps == 0, f'{precision} stage {stage}: {engine.skipped_steps} skipped'
            engine.close()
        spread = max(max_rel(params[s], params[0]) for s in range(1, 4))
        drift = max(abs(a - b) / b for a, b in zip(losses[0], fp32))
        assert spread < 1e-2, f'{precision}: stages differ from stage 0 by {spread:.2e}'
        assert drift < 2e-2, f'{precision}: loss differs from fp32 by {drift:.2%}'
        out.append(f'{precision}: stages within {spread:.1e} of stage 0, loss within {drift:.2%} of fp32')
    return '; '.join(out)

@check('fp16 overflow skips the step and halves the scale')
def fp16_overflow():
    cfg = config(2, 'fp16'); cfg['fp16']['hysteresis'] = 1     # DeepSpeed's default, 2, halves at the second overflow
    engine = engine_for(cfg)
    train(engine, batches(2))
    before, scale = full_params(engine), engine.precision.loss_scale
    idx = batches(1, seed=7)[0].to(DEVICE)
    loss = loss_of(engine(idx[:, :-1]), idx) * float('inf')
    engine.backward(loss); engine.step()
    after = engine.precision.loss_scale
    assert engine.skipped_steps == 1, f'skipped {engine.skipped_steps}'
    assert after == scale / 2, f'scale {scale} -> {after}'
    assert max_rel(full_params(engine), before) == 0, 'weights changed on an overflow step'
    train(engine, batches(1, seed=8))
    engine.close()
    return f'scale {scale:g} -> {after:g}, weights unchanged, next step trains'

@check('non-finite gradient named and stops (stage 2, fp32)')
def nonfinite():
    from flexrt import monitor
    from flexrt.engine.watch import NonFiniteError
    records = []
    monitor.add_listener(records.append)
    try:
        engine = engine_for(config(2, diagnostics={'stop_on_nonfinite': True}))
        target = engine.module[1].linear2.weight
        target.register_hook(lambda g: g * float('nan') if engine.global_steps == 3 else g)
        try: train(engine, batches(6)); raise AssertionError('no NonFiniteError')
        except NonFiniteError as e: record = e.record
        engine.close()
    finally: monitor.remove_listener(records.append)
    assert record['step'] in (3, 4) and record['rank'] == 0 and record['parameter'] == '1.linear2.weight', record
    steps = [r for r in records if r.get('kind') == 'step']
    devices = {str((r.get('memory') or {}).get('device')) for r in steps}
    assert steps and all(d.startswith(DEVICE) for d in devices), (len(steps), devices)
    return f"step {record['step']}, rank {record['rank']}, parameter {record['parameter']} ({record.get('value', record.get('kind'))})"

LOAD_ON_CPU = """
import sys, torch, flexrt
sys.path.insert(0, {root!r}); sys.path.insert(0, {tools!r})
from gpu_check import model_fn, config
model = model_fn()
engine, *_ = flexrt.initialize(model=model, model_parameters=model.parameters(), config=config(2))
engine.load_checkpoint({path!r}, tag='t3')
assert engine.device.type == 'cpu' and engine.global_steps == 3, (engine.device, engine.global_steps)
ref = torch.load({ref!r})
err = max(float((p.detach() - ref[n]).abs().max()) for n, p in engine.module.named_parameters())
assert err == 0, err
print('loaded on CPU', engine.global_steps, err)
"""

@check('checkpoint: exact resume on the GPU (dropout), loads in a CPU-only process')
def checkpoint():
    data = batches(6)
    with tempfile.TemporaryDirectory() as tmp:
        engine = engine_for(config(2), dropout=0.1)
        train(engine, data[:3])
        engine.save_checkpoint(tmp, tag='t3')
        torch.save(full_params(engine), f'{tmp}/ref.pt')
        after = train(engine, data[3:]); engine.close()
        torch.cuda.manual_seed_all(999); torch.manual_seed(999)      # the checkpoint's RNG state must win
        engine = engine_for(config(2), dropout=0.1)
        engine.load_checkpoint(tmp, tag='t3')
        resumed = train(engine, data[3:]); engine.close()
        assert resumed == after, f'resumed losses {resumed} != {after}'
        engine = engine_for(config(3), dropout=0.1)                  # another stage
        engine.load_checkpoint(tmp, tag='t3')
        other = train(engine, data[3:]); engine.close()
        assert max(abs(a - b) for a, b in zip(other, after)) < 1e-5, f'stage 3 resume {other} vs {after}'
        script = LOAD_ON_CPU.format(root=str(ROOT), tools=str(ROOT / 'tools'), path=tmp, ref=f'{tmp}/ref.pt')
        env = {**os.environ, 'CUDA_VISIBLE_DEVICES': '', 'RANK': '0', 'WORLD_SIZE': '1', 'LOCAL_RANK': '0',
               'MASTER_ADDR': '127.0.0.1', 'MASTER_PORT': '29611'}
        p = subprocess.run([sys.executable, '-c', script], env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
    return f'stage 2 resume bit-exact over 3 steps ({after[-1]:.5f}); stage 3 within 1e-5; CPU process: {p.stdout.strip()}'

@check('memory: snapshots report CUDA; memory model vs measured CUDA peak')
def memory():
    from flexrt.memory import memory_snapshot
    from flexrt.autotuner.memory import profile_model, calibrate, estimate_memory
    from flexrt.autotuner.measure import run_trial
    s = memory_snapshot()
    assert s.device.startswith(DEVICE) and (DEVICE == 'cpu' or s.tracked and s.allocated_bytes > 0), s
    step = lambda engine: train(engine, batches(1, seed=engine.global_steps + 11))
    c = lambda stage, m, precision='fp32': {**config(stage, precision), 'train_micro_batch_size_per_gpu': m}
    rows = []
    for dim, layers in ((64, 2), (512, 4)) if DEVICE == 'cuda' else ((64, 2),):
        fn = lambda: model_fn(dim=dim, layers=layers)
        trial = lambda cfg: run_trial(fn, step, cfg, warmup_steps=1, profile_steps=1)
        for precision in ('fp32', 'bf16'):      # profiled and calibrated in the precision it predicts, as autotune does
            profile = profile_model(fn, c(0, 8, precision), train_step=step, micro_batches=(4, 8))
            uncalibrated = estimate_memory(profile, c(0, 8, precision), 1, 8, device=DEVICE).peak_bytes
            profile = calibrate(profile, [(c(0, m, precision), 1, trial(c(0, m, precision)).peak_bytes) for m in (4, 8)])
            for stage in range(4):
                base = torch.cuda.memory_allocated() if DEVICE == 'cuda' else 0
                r = trial(c(stage, 8, precision))
                assert r.status == 'ok', r.reason
                e = estimate_memory(profile, c(stage, 8, precision), 1, 8, device=DEVICE)
                rows.append((f'{profile.num_params / 1e6:.1f}M {precision}', stage, e.peak_bytes, r.peak_bytes,
                             (e.peak_bytes - r.peak_bytes) / r.peak_bytes))
                print('  %s stage %d: predicted %11d measured %11d %+.2f%%' % (*rows[-1][:4], 100 * rows[-1][4]),
                      f'(base {base:,}; uncalibrated stage 0 {uncalibrated:,}; {e.moment}: {e.breakdown})' if stage == 0 else '', flush=True)
    worst = max(rows, key=lambda r: abs(r[4]))
    assert all(-0.02 <= r[4] <= 0.05 for r in rows), f'worst: {worst}'
    return f'{s.device_name}; memory model error: ' + ', '.join(f'{p} s{st} {100*e:+.1f}%' for p, st, _, _, e in rows)

@check('comm: NCCL collectives timed with CUDA events')
def comm():
    from flexrt import comm as dist
    dist.configure(enabled=True, prof_all=True, verbose=False)
    dist.reset_log()
    t = torch.ones(1 << 20, device=DEVICE)
    for _ in range(3): dist.all_reduce(t)
    dist.all_reduce(t, async_op=True).wait()
    dist.broadcast(t, 0); dist.all_gather_into_tensor(torch.empty_like(t), t)
    rows = dist.comms_logger.summary()
    dist.configure(enabled=False)
    counts = dict(zip(rows['op'], rows['count']))
    assert counts.get('all_reduce') == 4 and counts.get('broadcast') == 1, counts
    assert (rows['avg_latency_ms'] > 0).all() and float(t[0]) == 1.0, rows
    return f'{dist.get_backend()}: ' + '; '.join(f"{r['op']} x{r['count']} {r['avg_latency_ms']:.3f} ms" for r in rows.to_dict('records'))

@check('step anatomy: CUDA events on sampled steps, no device sync')
def anatomy():
    from flexrt import monitor
    records, syncs, real_sync = [], [], torch.cuda.synchronize
    engine = engine_for(config(0, diagnostics={'anatomy': {'enabled': True, 'cuda_every': 2}}))
    torch.cuda.synchronize = lambda *a, **k: (syncs.append(1), real_sync(*a, **k))[1]   # counts the engine's syncs
    try:
        with monitor.listen(lambda r: records.append(r) if r.get('kind') == 'step' else None):
            train(engine, batches(8))
    finally:
        torch.cuda.synchronize = real_sync
        engine.close()
    sampled = [r['anatomy'] for r in records if 'device_step' in r.get('anatomy', {})]
    if DEVICE == 'cuda':
        assert sampled and not syncs, f'{len(sampled)} records with device times, {len(syncs)} device syncs'
        times = {k: v for k, v in sampled[-1].items() if k.startswith('device_') and k != 'device_step'}
        assert times and all(v > 0 for v in times.values()), times
        return f"{len(sampled)} of {len(records)} step records with device times (every 2nd step sampled), no sync; " \
               + ', '.join(f'{k} {1e3 * v:.2f} ms' for k, v in times.items())
    return f'{len(records)} step records (CPU dry run: no events)'

def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--out', default=os.environ.get('OUT'))
    ap.add_argument('--dry-run', action='store_true', help='run on the CPU (checks the script, not the GPU paths)')
    a = ap.parse_args()
    if not (torch.cuda.is_available() or a.dry_run): sys.exit('no CUDA device: this script checks the GPU paths (--dry-run runs it on the CPU)')
    for k, v in dict(RANK='0', WORLD_SIZE='1', LOCAL_RANK='0', MASTER_ADDR='127.0.0.1', MASTER_PORT='29610').items(): os.environ.setdefault(k, v)
    from flexrt import comm as dist
    dist.init_distributed(dist_init_required=DEVICE == 'cuda')   # on the GPU a real NCCL group of one, not the single-process stand-in
    print(f'torch {torch.__version__}, {torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (dry run)"}, backend {dist.get_backend()}', flush=True)
    for fn in (engine_fp32, engine_half, fp16_overflow, nonfinite, checkpoint, memory, comm, anatomy): fn()
    dist.destroy_process_group()
    print('\n| check | result | s |\n| --- | --- | --- |')
    for name, ok, detail, s in RESULTS: print(f"| {name} | {'PASS' if ok else 'FAIL'}: {detail} | {s:.1f} |")
    if a.out: Path(a.out, 'gpu_check.json').write_text(json.dumps(RESULTS, indent=1))
    sys.exit(sum(not ok for _, ok, _, _ in RESULTS))

if __name__ == '__main__': main()
