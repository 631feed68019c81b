"""flexrt.autotune inside real gloo groups: ranks agree, records, sub-groups, stop file, resume, best_config round trip,
failures survived, bad input. Experiments run through the real `run_trial` unless a test replays the surface."""
import os, tempfile
from types import SimpleNamespace
import pytest, torch, torch.nn as nn
from helpers import run_distributed
from autotune_surface import measure as surface_measure, predict as surface_predict, P
import flexrt
from flexrt import monitor
from flexrt.autotuner.runner import autotune
from flexrt.autotuner.results import AutotuneResult

PROFILE = SimpleNamespace(num_params=P, estimates=False)   # parameter count only: the surface's `predict` is the memory model

def model_fn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 1))

def train_step(engine):
    x = torch.randn(engine.train_micro_batch_size_per_gpu(), 16)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()

def config(**autotuning):
    "The tests' search: up to micro-batch 8; 3 timed steps a trial at most (they check no time's precision)"
    return {'optimizer': {'type': 'Adam', 'params': {'lr': 1e-3}},
            'autotuning': {'max_train_micro_batch_size_per_gpu': 8, 'start_profile_step': 1, 'end_profile_step': 2,
                           'max_profile_steps': 3, **autotuning}}

def _tune_and_train(rank, world, results_dir):
    records = []
    with monitor.listen(lambda r: records.append(r) if r['kind'] == 'experiment' else None):
        result = autotune(model_fn, train_step, config(), results_dir=results_dir, stages=[0, 1])
    engine, *_ = flexrt.initialize(model=model_fn(), config=result.best_config)   # accepted as is
    train_step(engine); engine.close() if hasattr(engine, 'close') else None
    return result.best, len(result.trials), [r.get('event') for r in records], engine.train_micro_batch_size_per_gpu()

def test_two_ranks_agree_and_best_config_initializes(tmp_path):
    out = run_distributed(_tune_and_train, world_size=2, args=(str(tmp_path),), timeout=240)
    (best0, n0, events0, mb0), (best1, n1, events1, mb1) = out
    assert best0 == best1 and n0 == n1 and mb0 == mb1 == best0['micro_batch']
    assert events0[0] == 'start' and events0[-1] == 'end' and events0.count('trial') == n0 and events1 == []
    assert best0['phase'] in ('remeasure', 'baseline', 'throughput', 'max_micro_batch') and best0['status'] == 'ok'
    for name in ('summary.txt', 'trials.csv', 'ds_config_optimal.json', 'study.db', 'exps'):
        assert os.path.exists(tmp_path / name), name
    assert 'mode: in-process' in (tmp_path / 'summary.txt').read_text()
    loaded = AutotuneResult.load(str(tmp_path))
    assert loaded.best_config == best0['config'] and len(loaded.trials) == n0

def is_playoff(kw)->bool:
    "Whether `measure` was called for a playoff round: those time a quarter of a search trial's seconds (1 s by default)"
    return kw['timing'].max_seconds < 4.0

def _subgroups(rank, world, results_dir):
    ran = []
    def measure(model_fn, train_step, cfg, **kw):
        from flexrt.autotuner.measure import run_trial
        if not is_playoff(kw):   # a search trial (the playoff re-measures the same candidates on purpose)
            ran.append((cfg['zero_optimization']['stage'], cfg['train_micro_batch_size_per_gpu'],
                        cfg['zero_optimization'].get('overlap_comm'), cfg['zero_optimization'].get('reduce_bucket_size')))
        return run_trial(model_fn, train_step, cfg, **kw)
    result = autotune(model_fn, train_step, config(fast=False, tuner_num_trials=4), results_dir=results_dir, stages=[1],
                      ranks_per_experiment=1, measure=measure)
    return ran, result.best, len(result.trials)

def test_sub_groups_run_different_candidates(tmp_path):
    (ran0, best0, n0), (ran1, best1, n1) = run_distributed(_subgroups, world_size=2, args=(str(tmp_path),), timeout=240)
    assert best0 == best1 and n0 == n1
    assert ran1 and not set(ran0) & set(ran1)   # the two sub-groups never ran the same candidate
    assert all(r['peak_bytes_per_rank'] and len(r['peak_bytes_per_rank']) == 1
               for r in AutotuneResult.load(str(tmp_path)).trials.to_dict('records') if r['status'] == 'ok')

def _stop_after_two(rank, world, results_dir, stop_file):
    def on_trial(rec):
        if rec['status'] != 'pruned' and sum(1 for _ in open(stop_file + '.n', 'a+')) >= 0:
            with open(stop_file + '.n', 'a') as f: f.write('x\n')
            if len(open(stop_file + '.n').read().split()) >= 2: open(stop_file, 'w').close()
    result = autotune(None, train_step, config(), results_dir=results_dir, measure=surface_measure,
                      predict=surface_predict, memory_budget=26_000_000, on_trial=on_trial,
                      profile=PROFILE)
    return result.stopped, int((result.trials.status != 'pruned').sum())

def test_stop_file_stops_between_trials(tmp_path):
    stop = str(tmp_path / 'stop')
    out = run_distributed(_stop_after_two, world_size=2, args=(str(tmp_path / 'res'), stop), timeout=120,
                          env={'FLEXRT_STOP_FILE': stop})
    assert out[0] == out[1] == ('stop requested', 2)

class Counting:
    "The surface's measure, counting search runs (`calls`) and playoff runs (`playoff`) apart"
    def __init__(self): self.calls = self.playoff = 0
    def __call__(self, *args, **kw):
        if is_playoff(kw): self.playoff += 1
        else: self.calls += 1
        return surface_measure(*args, **kw)

def _surface_tune(results_dir, measure, **kw):
    return autotune(None, train_step, config(fast=False, max_train_micro_batch_size_per_gpu=64), results_dir=results_dir,
                    measure=measure, predict=surface_predict, memory_budget=26_000_000,
                    profile=PROFILE, **kw)

def test_resume_from_study_db(tmp_path):
    whole = Counting()
    full = _surface_tune(str(tmp_path / 'whole'), whole)
    first, second = Counting(), Counting()
    part = _surface_tune(str(tmp_path / 'split'), first, max_trials=7)
    assert first.calls == 7 and first.playoff >= 5 and 'max_trials' in part.stopped   # 7 runs, then the playoff
    rest = _surface_tune(str(tmp_path / 'split'), second)
    assert (tmp_path / 'split' / 'study.db').exists() and rest.study.startswith('resumed')
    assert first.calls + second.calls <= whole.calls + 2  # the resumed search runs only what is left (Optuna may differ)
    assert rest.best['stage'] == full.best['stage'] and rest.best['micro_batch'] == full.best['micro_batch']
    assert len(rest.trials) > len(part.trials)

def test_failures_are_recorded_and_the_best_feasible_returned(tmp_path):
    def flaky_step(engine):
        mb = engine.train_micro_batch_size_per_gpu()
        if mb == 8: raise torch.OutOfMemoryError('CUDA out of memory (injected)')
        if mb == 6: raise ValueError('a user error (injected)')
        if mb == 5: keep = torch.zeros(10**7)   # 40 MB live during the step: over the budget
        train_step(engine)
    result = autotune(model_fn, flaky_step, config(max_train_micro_batch_size_per_gpu=8), results_dir=str(tmp_path),
                      stages=[0], memory_budget='30MB', profile=PROFILE)   # no predictions: the path is 1, 2, 4, 8, 6, 5
    statuses = dict(zip(result.trials.micro_batch, result.trials.status))
    assert (statuses[8], statuses[6], statuses[5]) == ('oom', 'error', 'over_budget'), statuses
    assert all(result.trials.reason[result.trials.status != 'ok'].str.len() > 0)
    assert result.best['status'] == 'ok' and result.best['micro_batch'] in (1, 2, 4)
    assert result.best['peak_bytes_measured'] <= 30 * 10**6

def test_train_step_without_engine_step_is_an_error(tmp_path):
    def forgetful(engine):
        loss = engine(torch.randn(engine.train_micro_batch_size_per_gpu(), 16)).sum(); engine.backward(loss)
    with pytest.raises(ValueError, match='engine.step'):
        autotune(model_fn, forgetful, config(), results_dir=str(tmp_path), stages=[0])

def test_budget_errors_say_what_to_change(tmp_path):
    prof = PROFILE
    kw = dict(results_dir=str(tmp_path), measure=surface_measure, predict=surface_predict, profile=prof)
    with pytest.raises(ValueError, match='raise memory_budget'): autotune(None, train_step, config(), memory_budget='1MB', **kw)
    with pytest.raises(ValueError, match='add it to the stage scope'):
        autotune(None, train_step, config(), memory_budget='15MB', stages=[0], **kw)
    with pytest.raises(ValueError, match='space is empty'):
        autotune(None, train_step, config(), memory_budget='26MB', micro_batches=[128], **kw)
    with pytest.raises(ValueError, match='memory_budget'): autotune(None, train_step, config(), memory_budget='lots', **kw)

def test_bucket_sizes_reach_the_knob_search(tmp_path):
    "autotune(bucket_sizes=...) (the widget's 'buckets tried'): every knob experiment and the files use only those sizes"
    chosen = [P // 8, P // 2]
    result = _surface_tune(str(tmp_path), Counting(), bucket_sizes=chosen)
    ran = result.trials[(result.trials['stage'] > 0) & (result.trials['status'] != 'pruned')]
    assert len(ran) and set(ran['reduce_bucket_size']) <= set(chosen)
    with pytest.raises(ValueError, match='positive ints'): _surface_tune(str(tmp_path / 'bad'), Counting(), bucket_sizes=[-1])

# ---- issue #24: runs wherever the README says, never a quiet None, resumes only the same search, a fixed global batch ----
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

def readme_autotune_snippet()->str:
    "The README's autotuning example, verbatim (the python block of its 'Autotuning' section)"
    text = open(os.path.join(ROOT, 'README.md')).read()
    section = text[text.index('## Autotuning'):]
    return section[section.index('```python\n') + 10:section.index('\n```', section.index('```python\n'))]

def test_readme_snippet_under_torchrun_without_init_distributed(tmp_path):
    "The README's snippet as is, 2 ranks under torchrun, no init_distributed(): the world comes from the environment"
    import json, sys
    from helpers import run_torchrun
    snippet = readme_autotune_snippet()
    assert 'init_distributed' not in snippet
    script = tmp_path / 'readme_autotune.py'
    script.write_text(snippet + '\nimport json, pathlib, torch.distributed as td\n'   # a file per rank: the ranks' stdout lines can interleave
                      'pathlib.Path(f"result_{td.get_rank()}.json").write_text(json.dumps(dict(rank=td.get_rank(), world=td.get_world_size(), best=result.best_config["train_micro_batch_size_per_gpu"], '
                      'stage=result.best_config["zero_optimization"]["stage"], ok=int((result.trials.status == "ok").sum()), verdict=result.verdict)))\n')
    done = run_torchrun([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node', '2', str(script)],
                        capture_output=True, text=True, timeout=400, cwd=str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob('result_*.json'))]
    assert sorted(r['rank'] for r in results) == [0, 1] and all(r['world'] == 2 for r in results)
    assert results[0]['best'] == results[1]['best'] and results[0]['ok'] > 0 and results[0]['verdict'], results

def _all_fail(rank, world, results_dir):
    def broken(model_fn, train_step, cfg, **kw):
        return SimpleNamespace(status='error', reason='ValueError: the data loader is empty (injected)', metric=None, peak_bytes=None,
                               peak_bytes_per_rank=[])
    try: autotune(None, train_step, config(), results_dir=results_dir, measure=broken, profile=PROFILE, stages=[0, 1])
    except flexrt.autotuner.AutotuneError as e: return str(e), len(e.trials)
    return None

def test_no_trial_succeeds_raises_autotune_error_on_every_rank(tmp_path):
    out = run_distributed(_all_fail, world_size=2, args=(str(tmp_path),), timeout=120)
    assert out[0] == out[1] and out[0] is not None, out
    message, n = out[0]
    assert 'no configuration that runs' in message and 'ValueError: the data loader is empty (injected)' in message
    assert 'Fix: run flexrt.autotuner.measure.run_trial' in message and n > 0
    assert (tmp_path / 'trials.csv').exists()   # the failed trials stay readable

def test_a_study_of_another_model_is_not_resumed(tmp_path):
    def other_model(): return nn.Sequential(nn.Linear(16, 8), nn.GELU(), nn.Linear(8, 1))
    kw = dict(results_dir=str(tmp_path / 'res'), measure=surface_measure, predict=surface_predict, memory_budget=26_000_000, profile=PROFILE)
    first = autotune(model_fn, train_step, config(), **kw)
    again = autotune(model_fn, train_step, config(), **kw)
    assert again.study.startswith('resumed') and len(again.trials) > len(first.trials)
    with pytest.warns(UserWarning, match='not resumed'):
        other = autotune(other_model, train_step, config(), **kw)
    assert 'model (its parameter shapes)' in other.study and other.trials.trial.min() == 0 and len(other.trials) < len(again.trials)
    moved = other.study.split('moved to ')[1]
    assert len(AutotuneResult.load(moved).trials) == len(again.trials)   # the other search kept, aside
    assert 'study: new search' in open(os.path.join(kw['results_dir'], 'summary.txt')).read()

def test_fixed_global_batch(tmp_path):
    "train_batch_size given: every trial's config makes exactly it (micro-batch x accumulation)"
    cfg = {**config(max_train_micro_batch_size_per_gpu=64), 'train_batch_size': 48}
    result = autotune(None, train_step, cfg, results_dir=str(tmp_path), measure=surface_measure, predict=surface_predict,
                      memory_budget=26_000_000, profile=PROFILE)
    ran = result.trials[result.trials.status != 'pruned']
    assert all(c['train_batch_size'] == 48 for c in result.trials.config) and set(ran.gradient_accumulation) > {1}
    assert all(48 % m == 0 for m in result.trials.micro_batch) and result.best_config['train_batch_size'] == 48
    out = run_distributed(_odd_global_batch, world_size=2, args=(str(tmp_path / 'odd'),), timeout=60)
    assert out[0] == out[1] and 'train_batch_size=47 is not a multiple of the 2 data-parallel ranks' in out[0], out

def _odd_global_batch(rank, world, results_dir):
    try: autotune(None, train_step, {**config(), 'train_batch_size': 47}, results_dir=results_dir, measure=surface_measure, profile=PROFILE)
    except ValueError as e: return str(e)

# ---- issue #35: trials run at the threads the training uses; on CPU the count is part of the answer ----
def _sized_search(rank, world, results_dir):
    "A rank as a notebook launch starts it: torch's default threads, no choice of yours (helpers' ranks set 1)"
    from flexrt.utils.threads import available_cores
    torch.set_num_threads(available_cores())
    result = autotune(model_fn, train_step, config(max_train_micro_batch_size_per_gpu=4), results_dir=results_dir, stages=[0])
    after = torch.get_num_threads()
    torch.set_num_threads(available_cores())   # whatever ran last: the config decides
    engine, *_ = flexrt.initialize(model=model_fn(), config=result.best_config)
    trained = torch.get_num_threads()
    engine.close()
    ran = result.trials[result.trials.status == 'ok']
    return (result.threads, result.best_config.get('threads_per_rank'), trained, after,
            sorted(zip(ran.threads_per_rank, ran.threads)), result.verdict, open(os.path.join(results_dir, 'summary.txt')).read())

def test_best_config_carries_the_threads_and_initialize_applies_them(tmp_path):
    out = run_distributed(_sized_search, world_size=2, args=(str(tmp_path),), timeout=240)
    threads, best, trained, after, ran, verdict, summary = out[0]
    assert threads['source'] == 'sized' and threads['device'] == 'cpu' and threads['local_ranks'] == 2, threads
    assert best in threads['counts'] and trained == best and out[1][2] == best   # flexrt.initialize applied it on both ranks
    assert after == threads['threads_per_rank']                                  # autotune leaves the plan's count, not the last trial's
    assert ran and all(asked == computed for asked, computed in ran), ran        # every trial computed with the count it carries
    assert f"with {best} thread{'' if best == 1 else 's'} per rank" in verdict, verdict
    assert f'threads per rank: {best} (' in summary, summary

def _fixed_threads(rank, world, results_dir):
    "helpers' ranks run torch.set_num_threads(1): your choice, kept and not searched; then threads_per_rank in the config"
    kw = dict(measure=surface_measure, predict=surface_predict, memory_budget=26_000_000, profile=PROFILE)
    yours = autotune(None, train_step, config(), results_dir=results_dir + '/yours', **kw)
    keyed = autotune(None, train_step, {**config(), 'threads_per_rank': 2}, results_dir=results_dir + '/keyed', **kw)
    return [(r.threads['source'], r.threads['counts'], r.best_config.get('threads_per_rank'), set(r.trials.phase),
             torch.get_num_threads()) for r in (yours, keyed)]

def test_threads_you_fixed_are_kept_and_not_searched(tmp_path):
    out = run_distributed(_fixed_threads, world_size=2, args=(str(tmp_path),), timeout=120)
    assert out[0] == out[1], out
    (source, counts, best, phases, _), (keyed_source, keyed_counts, keyed_best, keyed_phases, left) = out[0]
    assert (source, counts, best) == ('torch.set_num_threads', [], None) and 'threads' not in phases   # no key: yours stays yours
    assert (keyed_source, keyed_counts, keyed_best, left) == ('config', [], 2, 2) and 'threads' not in keyed_phases
