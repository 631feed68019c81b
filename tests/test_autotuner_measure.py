"run_trial on real 2-rank gloo groups: agreed status, failures survived, nothing left behind after many trials"
import gc, os, threading
import torch
from tests.helpers import run_distributed

def model_fn():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))

def train_step(engine):
    x = torch.randn(engine.train_micro_batch_size_per_gpu(), 16)
    engine.backward(engine(x).pow(2).mean()); engine.step()

def config(stage=0, micro=4):
    return {'train_micro_batch_size_per_gpu': micro, 'gradient_accumulation_steps': 1, 'steps_per_print': 10**9,
            'optimizer': {'type': 'Adam', 'params': {'lr': 1e-3}}, 'zero_optimization': {'stage': stage}}

class Fault:
    "train_step that fails in a chosen way on chosen ranks"
    def __init__(self, kind, ranks=(0, 1)): self.kind, self.ranks = kind, ranks
    def __call__(self, engine):
        from flexrt import comm
        mine = comm.get_rank() in self.ranks
        if self.kind == 'no_step' and mine: engine.backward(engine(torch.randn(4, 16)).mean()); return
        train_step(engine)
        if self.kind == 'oom' and mine: raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')
        if self.kind == 'user' and mine: raise ValueError('user bug in train_step')

def _status(rank, world_size):
    from flexrt.autotuner.measure import run_trial
    out = {}
    for name, kwargs in {'ok': {}, 'oom1': dict(train_step=Fault('oom', (1,))), 'user0': dict(train_step=Fault('user', (0,))),
                         'no_step': dict(train_step=Fault('no_step')), 'budget': dict(memory_budget=10_000),
                         'timeout': dict(timeout=1e-6), 'stage2': dict(ds_config=config(2))}.items():
        args = dict(train_step=train_step, ds_config=config(), warmup_steps=1, profile_steps=2) | kwargs
        out[name] = run_trial(model_fn, **args)
    return out

def test_status_agreed_over_the_group():
    a, b = run_distributed(_status, 2, timeout=120)
    assert a == b   # every rank reports the same result
    assert a['ok'].status == 'ok' and len(a['ok'].peak_bytes_per_rank) == 2 and a['ok'].samples_per_s > 0
    assert a['ok'].micro_steps == 3 and a['ok'].peak_bytes == max(a['ok'].peak_bytes_per_rank)
    assert (a['oom1'].status, a['oom1'].reason) == ('oom', 'out of memory: CUDA out of memory. Tried to allocate 2.00 GiB')
    assert (a['user0'].status, a['user0'].reason) == ('error', 'ValueError: user bug in train_step')
    assert a['no_step'].status == 'error' and 'without calling engine.step()' in a['no_step'].reason
    assert a['budget'].status == 'over_budget' and '10,000' in a['budget'].reason
    assert a['timeout'].status == 'timeout' and a['timeout'].micro_steps == 1   # stopped after its first micro-step
    assert a['stage2'].status == 'ok' and a['stage2'].peak_bytes < a['ok'].peak_bytes   # shards are smaller

def _live():
    gc.collect()
    from torch.distributed import distributed_c10d as c10d
    tensors = sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))
    return tensors, len(c10d._world.pg_map), threading.active_count(), len(os.listdir('/proc/self/fd'))

def _many(rank, world_size, n):
    from flexrt.autotuner.measure import run_trial
    kinds = [{}, dict(train_step=Fault('user')), dict(train_step=Fault('oom')), dict(memory_budget=10_000),
             dict(timeout=1e-6), dict(train_step=Fault('no_step')), dict(ds_config=config(1)), dict(ds_config=config(3))]
    run_trial(model_fn, train_step, config(), warmup_steps=1, profile_steps=1)   # first use: lazy imports, caches
    before, results = _live(), []
    for i in range(n):
        args = dict(train_step=train_step, ds_config=config(), warmup_steps=1, profile_steps=2) | kinds[i % len(kinds)]
        results.append(run_trial(model_fn, **args))
    return before, _live(), results

def test_fifty_trials_leave_nothing_behind():
    (before, after, results), _ = run_distributed(_many, 2, args=(50,), timeout=300)
    assert after[:3] == before[:3] and after[3] <= before[3], f'live (tensors, process groups, threads, fds) before {before}, after {after}'
    statuses = [r.status for r in results]
    assert statuses.count('ok') == 19 and {'error', 'oom', 'over_budget', 'timeout'} <= set(statuses)
    assert all(results[i].status == 'ok' for i in (0, 6, 7, 8))   # stages 0, 1, 3
    overhead = sorted(r.seconds - r.steps_seconds for r in results)
    print(f'per-trial overhead: median {overhead[len(overhead) // 2]:.3f} s, max {overhead[-1]:.3f} s')

def _subgroups(rank, world_size):
    from flexrt import comm
    from flexrt.autotuner.measure import run_trial
    from torch.distributed import distributed_c10d as c10d
    groups = [comm.new_group([r]) for r in range(world_size)]   # every rank makes every group
    before = len(c10d._world.pg_map)
    mine = run_trial(model_fn, train_step, config(stage=rank + 1, micro=4 * (rank + 1)), group=groups[rank], warmup_steps=1, profile_steps=2)
    return mine, len(c10d._world.pg_map) - before

def test_subgroups_run_different_trials_at_once():
    (a, leak_a), (b, leak_b) = run_distributed(_subgroups, 2, timeout=120)
    assert (a.status, b.status) == ('ok', 'ok') and (leak_a, leak_b) == (0, 0)
    assert len(a.peak_bytes_per_rank) == len(b.peak_bytes_per_rank) == 1   # each trial ran on its own rank
    assert a.samples_per_s > 0 and b.samples_per_s > 0 and a != b
