"""The autotuner's search against a deterministic surface (tests/autotune_surface.py): exact trial counts and winners,
largest micro-batch exact in few runs, fault injection, every settings knob that changes the path."""
import math, sys
import pytest
from autotune_surface import measure, faulty, predict, grid, P, WORLD
from flexrt.autotuner.space import TuneSettings, Candidate
from flexrt.autotuner.search import Search

def drive(search, measure_fn=measure, budget=None):
    gen = search.plan()
    try:
        batch = next(gen)
        while True:
            batch = gen.send([measure_fn(None, None, e.candidate.to_config({}, WORLD), memory_budget=budget,
                                         metric=search.s.metric) for e in batch])
    except StopIteration as stop: return stop.value

def new_search(budget, fast=True, max_trials=None, **kw):
    settings = TuneSettings(fast=fast, max_micro_batch=64, **kw)
    return Search(settings, predict=predict, memory_budget=budget, world_size=WORLD, num_params=P, max_trials=max_trials)

@pytest.mark.parametrize('budget', [20_000_000, 26_000_000, 40_000_000])
def test_max_micro_batch_exact_in_few_runs(budget):
    s = new_search(budget)
    drive(s, budget=budget)
    for stage, top in s.max_micro_batch.items():
        exact = max((m for m in range(1, 65) if predict(s.candidate(stage, m)) <= budget), default=None)
        assert top == exact, (stage, top, exact)
    runs = list(s.max_micro_batch_runs.values())
    assert max(runs) <= 4 and sum(runs) / len(runs) <= 3, runs

def test_search_exact_count_and_winner_within_ten_percent_of_grid():
    budget = 26_000_000
    s = new_search(budget, fast=False)
    rec, best = drive(s, budget=budget)
    # the grid's best feasible point, and the search's: same stage and micro-batch, metric within 2%
    feasible = [g for g in grid() if g['peak'] <= budget]
    assert s.runs <= 0.1 * len(list(grid())), (s.runs, len(list(grid())))
    assert rec['metric'] >= 0.98 * max(g['throughput'] for g in feasible)
    assert (best.stage, best.micro_batch, s.runs) == (EXPECTED['stage'], EXPECTED['micro_batch'], EXPECTED['runs'])
    assert rec['phase'] == 'remeasure' and rec['status'] == 'ok'
    assert s.baseline[1] == Candidate(0, 16, 1)   # the largest power of two under stage 0's max (20)

EXPECTED = dict(stage=2, micro_batch=32, runs=18)

def test_pruned_candidates_cost_no_runs():
    budget = 20_000_000
    s = new_search(budget)
    drive(s, budget=budget)
    pruned = [r for r in s.records if r['status'] == 'pruned']
    assert pruned and all(r['peak_bytes_predicted'] > budget or 'fits no larger' in r['reason'] for r in pruned)
    assert all(r['status'] != 'over_budget' or r['phase'] == 'max_micro_batch' for r in s.records)

def test_faults_best_feasible_still_returned():
    budget = 26_000_000
    for seed in range(5):
        fn = faulty(0.2, seed)
        s = new_search(budget, fast=False)
        rec, best = drive(s, fn, budget=budget)
        statuses = {r['status'] for r in s.records}
        ok = [r for r in s.records if r['status'] == 'ok' and r['phase'] != 'remeasure']
        assert rec['status'] == 'ok' and rec['metric'] >= max(r['metric'] for r in ok) * 0.999
        assert rec['peak_bytes_measured'] <= budget
    assert {'oom', 'timeout', 'error'} & statuses

def test_latency_lower_is_better():
    budget = 26_000_000
    s = new_search(budget, metric='latency')
    rec, best = drive(s, budget=budget)
    ok = [r for r in s.records if r['status'] == 'ok']
    assert rec['metric'] <= min(r['metric'] for r in ok) * 1.001

def test_progressive_stages_skip_a_stage_that_fits_no_more():
    s = new_search(None)   # no budget: stage 0 reaches the bound, higher stages cannot fit more
    drive(s)
    assert list(s.max_micro_batch) == [0]
    assert any('fits no larger micro-batch' in r['reason'] for r in s.records if r['status'] == 'pruned')

def test_max_trials_stops_the_plan():
    s = new_search(26_000_000, max_trials=4)
    rec, best = drive(s, budget=26_000_000)
    assert s.runs == 4 and 'max_trials' in s.stopped and rec['phase'] == 'remeasure'

@pytest.mark.parametrize('tuner', ['tpe', 'gp', 'random', 'grid'])
def test_every_sampler_runs(tuner):
    s = new_search(26_000_000, fast=False, tuner_type=tuner, tuner_num_trials=8)
    rec, best = drive(s, budget=26_000_000)
    assert rec['status'] == 'ok' and any(r['phase'] == 'knobs' for r in s.records)

def test_gp_without_scipy_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, 'scipy', None)   # as if scipy were not installed: `import scipy` raises ImportError
    with pytest.raises(ImportError, match='pip install scipy'): drive(new_search(26_000_000, fast=False, tuner_type='gp'), budget=26_000_000)

def test_chosen_bucket_sizes_are_the_only_ones_tried():
    "bucket_sizes (the widget's 'buckets tried') replaces the scaled choices in every knob experiment, and the pre-knob default"
    budget, chosen = 26_000_000, (P // 8, P // 2)
    s = new_search(budget, fast=False, bucket_sizes=chosen)
    drive(s, budget=budget)
    knob_runs = [r for r in s.records if r['phase'] == 'knobs' and r['status'] != 'pruned']
    assert knob_runs, 'the knob search ran'
    for r in s.records:
        if r['stage'] in (1, 2, 3) and r['status'] != 'pruned': assert r['reduce_bucket_size'] in chosen, r
        if r['stage'] in (1, 2) and r['status'] != 'pruned': assert r['allgather_bucket_size'] in chosen, r
    with pytest.raises(ValueError, match='positive ints'): new_search(budget, bucket_sizes=(0,)).candidate(2, 4)
