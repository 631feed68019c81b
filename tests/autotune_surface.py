"""A deterministic performance surface for the autotuner's tests: what `run_trial` would measure for each candidate.

Memory per rank follows the ZeRO formulas for fp32 Adam on 2 ranks (16P, 12P, 10P, 8P bytes of model states for
stages 0-3) plus activations per sample and the bucket buffers; throughput falls with the communication the stage and
knobs imply (not `allgather_bucket_size`, which flexrt's stages 1-2 do not read). `measure` answers like `flexrt.autotuner.measure.run_trial` (same keyword arguments); `grid` lists the
surface's points as a table (the "recorded" surface the search is replayed against); `faulty` makes a share of
trials fail in the four ways a real trial fails; `noisy` reads each run with seeded noise, as a busy machine does.
Every reading carries its step's phases (`phases_ms`: forward, backward, allreduce, step, summing to the step) as
`run_trial` times them on CPU; `threaded` makes the config's `threads_per_rank` matter; `step_bound` is a model whose
optimizer step dominates and runs faster at stages above 0, so the winner is far ahead of the baseline.
"""
import itertools, zlib
from types import SimpleNamespace

P, WORLD, ACT = 1_000_000, 2, 400_000  # parameters, ranks, activation bytes per sample
STATES = {0: 16 * P, 1: 4 * P + 4 * P + 8 * P // WORLD, 2: 4 * P + 12 * P // WORLD, 3: 16 * P // WORLD}

def peak(stage, mb, reduce_bucket_size, allgather_bucket_size, prefetch, overlap):
    buckets = 0 if stage == 0 else 4 * reduce_bucket_size * (2 if overlap else 1) + (4 * prefetch if stage == 3 else 0)
    return STATES[stage] + ACT * mb + buckets + 2_000_000

def phases(stage, mb, reduce_bucket_size, allgather_bucket_size, prefetch, overlap, optimizer=0.004):
    "Seconds of each phase of one step: compute in forward (1/3) and backward (2/3), the reduction wait, the optimizer step"
    comm = {0: 0.010, 1: 0.008, 2: 0.009, 3: 0.016}[stage]
    buckets = 0 if stage == 0 else 0.002 * abs(reduce_bucket_size / P - 0.25)
    if stage == 3: buckets += 0.002 * abs(prefetch / P - 0.0625)
    return {'forward': 0.0007 * mb, 'backward': 0.0014 * mb, 'allreduce': (comm + buckets) * (0.7 if overlap and stage else 1),
            'step': optimizer}

def throughput(stage, mb, reduce_bucket_size, allgather_bucket_size, prefetch, overlap):
    return WORLD * mb / sum(phases(stage, mb, reduce_bucket_size, allgather_bucket_size, prefetch, overlap).values())

def _point(config):
    z = config['zero_optimization']
    return (z['stage'], config['train_micro_batch_size_per_gpu'], z.get('reduce_bucket_size', 5 * 10**8),
            z.get('allgather_bucket_size', 5 * 10**8), z.get('stage3_prefetch_bucket_size', 5 * 10**7), z.get('overlap_comm', False))

def result(status, reason='', metric=None, peak_bytes=None, phases_ms=None, threads=None):
    return SimpleNamespace(status=status, reason=reason, metric=metric, samples_per_s=metric, peak_bytes=peak_bytes,
                           peak_bytes_per_rank=[peak_bytes] * WORLD if peak_bytes else [], seconds=0.01, steps_seconds=0.005,
                           phases_ms=phases_ms, threads=threads)

def _ms(seconds:dict, scale=1.)->dict: return {k: v * 1e3 * scale for k, v in seconds.items()}

def measure(model_fn, train_step, config, *, group=None, memory_budget=None, metric='throughput', **kwargs):
    "What a trial of `config` measures on the surface"
    point = _point(config)
    p = peak(*point)
    if memory_budget is not None and p > memory_budget:
        return result('over_budget', f'peak {p} bytes exceeds the budget {memory_budget}', peak_bytes=p)
    t = throughput(*point)
    return result('ok', metric=(WORLD * config['train_micro_batch_size_per_gpu'] / t) if metric == 'latency' else t, peak_bytes=p,
                  phases_ms=_ms(phases(*point)), threads=config.get('threads_per_rank'))

FAULTS = ('oom', 'over_budget', 'timeout', 'error')

def faulty(share=0.2, seed=0):
    "A `measure` where `share` of the candidates (chosen by a hash of the config) fail, in turn in the four ways"
    def fn(model_fn, train_step, config, **kwargs):
        h = zlib.crc32(repr((_point(config), seed)).encode()) % 1000
        if h < share * 1000:
            kind = FAULTS[h % 4]
            return result(kind, f'injected {kind}')
        return measure(model_fn, train_step, config, **kwargs)
    return fn

def predict(c):
    "The memory model on this surface: exact"
    return peak(c.stage, c.micro_batch, c.reduce_bucket_size, c.allgather_bucket_size, c.stage3_prefetch_bucket_size, c.overlap_comm)

def grid(micro_batches=(1, 2, 4, 8, 16, 32, 48, 64), buckets=(P // 16, P // 4, P)):
    "Every point of the surface's grid: stage x micro-batch x reduce x allgather/prefetch"
    for stage, mb, r, a in itertools.product(range(4), micro_batches, buckets, buckets):
        yield dict(stage=stage, micro_batch=mb, reduce=r, other=a, peak=peak(stage, mb, r, a, a, False),
                   throughput=throughput(stage, mb, r, a, a, False))

def noisy(share=0.03, seed=0, lucky=None, level=None):
    """A `measure` whose every reading is off by a random factor in [1 - share, 1 + share] (seeded); `lucky(config)`: a
    factor for a configuration's first reading only; `level`: every configuration reads `level` x what stage 0 reads (1000)"""
    import random
    rng, seen = random.Random(seed), set()
    def fn(model_fn, train_step, config, **kwargs):
        r = measure(model_fn, train_step, config, **kwargs)
        if r.status != 'ok': return r
        point = _point(config)
        base = r.metric if level is None else 1000. * (1. if point[0] == 0 else level)
        boost = lucky(config) if lucky and point not in seen else 1.
        seen.add(point)
        return result('ok', metric=base * boost * rng.uniform(1 - share, 1 + share), peak_bytes=r.peak_bytes)
    return fn

def threaded(factors):
    """A `measure` where the config's `threads_per_rank` scales every phase (and so the step) by `factors[count]`
    (smaller is faster; a count not in `factors`, or none, by 1)"""
    def fn(model_fn, train_step, config, *, metric='throughput', **kwargs):
        r = measure(model_fn, train_step, config, metric=metric, **kwargs)
        if r.status != 'ok': return r
        f = factors.get(config.get('threads_per_rank'), 1.)
        return result('ok', metric=r.metric * f if metric == 'latency' else r.metric / f, peak_bytes=r.peak_bytes,
                      phases_ms={k: v * f for k, v in r.phases_ms.items()}, threads=r.threads)
    return fn

def step_bound(optimizer=0.040, speedup=4.):
    "A `measure` of a model whose optimizer step takes `optimizer` seconds at stage 0 and is `speedup` x faster above it"
    def fn(model_fn, train_step, config, *, memory_budget=None, **kwargs):
        r = measure(model_fn, train_step, config, memory_budget=memory_budget, **kwargs)
        if r.status != 'ok': return r
        point = _point(config)
        seconds = phases(*point, optimizer=optimizer / (speedup if point[0] else 1.))
        return result('ok', metric=WORLD * point[1] / sum(seconds.values()), peak_bytes=r.peak_bytes, phases_ms=_ms(seconds))
    return fn
