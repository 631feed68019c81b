"""bench/autotune.py's brute-force grid for the trust phase covers every stage × micro-batch (× threads per rank).
(The notebook path itself, a kernel whose cell calls flexrt.launch, is tested in tests/test_threads_launch.py.)"""
import importlib.util, pathlib, sys

BENCH = pathlib.Path(__file__).parent.parent / 'bench'
sys.path.insert(0, str(BENCH))

def _load(name):
    spec = importlib.util.spec_from_file_location(f'bench_{name}', BENCH / f'{name}.py')
    module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)
    return module

def test_trust_sweep_covers_every_stage_by_micro_batch():
    autotune = _load('autotune')
    cfg = {**autotune.CONFIG, 'autotuning': {**autotune.CONFIG['autotuning'], 'max_train_micro_batch_size_per_gpu': 16}}
    grid = autotune.sweep_grid(autotune.mlp_model, cfg, world=2)
    threads = autotune.thread_choices(2)
    configs = [c['config'] for c in grid.values()]
    points = {(c['zero_optimization']['stage'], c['train_micro_batch_size_per_gpu']) for c in configs}
    assert points == {(s, m) for s in range(4) for m in (1, 2, 4, 8, 16)}
    assert len(grid) == 4 * 5 * len(threads)
    from flexrt.utils.threads import available_cores
    assert threads[0] == 1 and threads[-1] == max(1, available_cores() // 2), threads
    assert {c['threads_per_rank'] for c in configs} == set(threads), 'each point says its threads per rank'
