"""Cost of watching an autotune search live: the same search on 2 ranks with and without an `AutotuneWidget`.

    python bench/autotune_widget_overhead.py [--rounds 2] [--max-trials 8]

This process plays the notebook kernel. Each round runs the search twice, in alternating order: once launched with plain
`notebook_launcher` and nobody watching (no hub: the ranks forward nothing), once through `AutotuneWidget.run()` at its
default settings (every trial's record goes to the widget, which updates its table and redraws its plots while the
ranks search). The search is the same (stage 0, micro-batches 1..16, fixed seed), so both runs time the same
configurations. Printed: per configuration the median over rounds of watched / unwatched samples/s (measured inside
the ranks), the search's wall time, and what the kernel spent (CPU seconds, plots drawn).
"""
import argparse, os, shutil, statistics, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / 'examples'))

def search(watched: bool, a, folder: str):
    "One search; returns (trials DataFrame, wall seconds, kernel CPU seconds, plots drawn)"
    from flexrt import monitor
    from flexrt.widgets.autotune_widget import AutotuneWidget, search_main
    from flexrt.autotuner.results import AutotuneResult
    from autotune_widget_train import model_fn, train_step, CONFIG
    monitor.stop_serving()
    shutil.rmtree(folder, ignore_errors=True)
    kwargs = dict(stages=[0], max_trials=a.max_trials, results_dir=folder, resume=False, seed=0)
    config = {**CONFIG, 'autotuning': {**CONFIG['autotuning'], 'min_train_micro_batch_size_per_gpu': 1, 'max_train_micro_batch_size_per_gpu': 16}}
    wall, cpu, plots = time.perf_counter(), time.process_time(), 0
    if watched:
        w = AutotuneWidget(model_fn, train_step, config, results_dir=folder)
        w.controls['stages'].value, w.controls['micro_batch_range'].value, w.controls['max_trials'].value = (0,), (1, 16), a.max_trials
        w.run(resume=False); w.wait(); plots = w.num_plots; w.close()
    else:   # plain notebook_launcher with no hub: the ranks forward nothing (flexrt.launch would start one)
        from accelerate import notebook_launcher
        from flexrt.launch import free_port
        notebook_launcher(search_main, (model_fn, train_step, config, kwargs), num_processes=2, use_port=str(free_port()))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return AutotuneResult.load(folder).trials, wall, cpu, plots

if __name__ == '__main__':
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--rounds', type=int, default=2); parser.add_argument('--max-trials', type=int, default=8)
    a = parser.parse_args()
    folder = tempfile.mkdtemp(prefix='flexrt-autotune-bench-')
    ratios, runs = [], {True: [], False: []}
    for round in range(a.rounds):
        out = {}
        for watched in ((False, True) if round % 2 == 0 else (True, False)):
            out[watched] = search(watched, a, os.path.join(folder, str(watched)))
            runs[watched].append(out[watched][1:])
        key = lambda t: t[t['status'] == 'ok'].groupby(['phase', 'stage', 'micro_batch'])['samples_per_s'].median()
        both = key(out[True][0]).to_frame('watched').join(key(out[False][0]).to_frame('alone'), how='inner')
        ratios += list(both['watched'] / both['alone'])
    shutil.rmtree(folder, ignore_errors=True)
    print(f"autotune search on 2 CPU ranks (stage 0, micro-batch 1..16, at most {a.max_trials} trials), {a.rounds} rounds, "
          f"watched by an AutotuneWidget vs nobody watching:")
    print(f"  samples/s of the same configuration, watched / alone: median {statistics.median(ratios):.3f} over {len(ratios)} "
          f"pairs (min {min(ratios):.3f}, max {max(ratios):.3f})")
    for watched in (False, True):
        walls, cpus, plots = zip(*runs[watched])
        print(f"  {'watched' if watched else 'alone':8s} search wall {statistics.median(walls):6.1f} s, kernel CPU "
              f"{statistics.median(cpus):5.2f} s ({statistics.median(c / w for c, w in zip(cpus, walls)):.1%} of one core), plots drawn {list(plots)}")
