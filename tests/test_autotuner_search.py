"""The autotuner's search against a deterministic surface (tests/autotune_surface.py): exact trial counts and winners,
largest micro-batch exact in few runs, fault injection, every settings knob that changes the path; and against a noisy
one (tests/autotune_surface.py `noisy`): a lucky reading loses the playoff, a tie keeps the baseline; threads per rank
searched where they matter (`threaded`), and a winner far ahead of the baseline says which phase of the step got faster
(`step_bound`), in the engine's timers and in the step anatomy's phases."""
import math, sys
import pytest
from autotune_surface import measure, faulty, noisy, predict, grid, throughput, threaded, step_bound, P, WORLD
from flexrt.autotuner.space import TuneSettings, Candidate, global_batch_micro_batches
from flexrt.autotuner.search import Search

def drive(search, measure_fn=measure, budget=None):
    gen = search.plan()
    try:
        batch = next(gen)
        while True:
            batch = gen.send([measure_fn(None, None, e.candidate.to_config({}, WORLD), memory_budget=budget,
                                         metric=search.s.metric) for e in batch])
    except StopIteration as stop: return stop.value

def new_search(budget, fast=True, max_trials=None, micro_batches=None, threads_per_rank=None, thread_counts=(), **kw):
    settings = TuneSettings(**{'fast': fast, 'max_micro_batch': 64, **kw})
    return Search(settings, predict=predict, memory_budget=budget, world_size=WORLD, num_params=P, max_trials=max_trials,
                  micro_batches=micro_batches, threads_per_rank=threads_per_rank, thread_counts=thread_counts)

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
    assert rec['status'] == 'ok' and s.margin['baseline']['low'] > 1 and s.margin['rounds'] >= 5
    assert s.baseline[1] == Candidate(0, 16, 1)   # the largest power of two under stage 0's max (20)

EXPECTED = dict(stage=2, micro_batch=34, runs=12)

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
        ok = [r for r in s.records if r['status'] == 'ok' and r['phase'] != 'playoff']
        assert rec['status'] == 'ok' and rec['metric'] >= max(r['metric'] for r in ok) * 0.999
        assert rec['peak_bytes_measured'] <= budget
    assert {'oom', 'timeout', 'error'} & statuses

def test_latency_lower_is_better():
    budget = 26_000_000
    s = new_search(budget, metric='latency')
    rec, best = drive(s, budget=budget)
    ok = [r for r in s.records if r['status'] == 'ok']
    assert rec['metric'] <= min(r['metric'] for r in ok) * 1.001

def test_no_stage_skipped_on_a_guess():
    "No budget: every stage fits the bound stage 0 reached; each is measured once at the best size, and explored unless slower beyond noise"
    s = new_search(None)
    drive(s)
    probes = {r['stage']: r for r in s.records if r['phase'] == 'probe'}
    assert set(probes) == {1, 2, 3} and all(r['micro_batch'] == 64 for r in probes.values())
    assert 1 in s.max_micro_batch   # stage 1 is faster than stage 0 at the same size on this surface: explored, not skipped
    pruned = [r for r in s.records if r['status'] == 'pruned' and r['reason'].startswith('rule:')]
    assert {r['stage'] for r in pruned} == {3}, pruned   # stage 3's extra communication: slower beyond noise
    assert 'fits no micro-batch above 64' in pruned[0]['reason'] and 'slower beyond the noise' in pruned[0]['reason']

def test_max_trials_stops_the_plan():
    s = new_search(26_000_000, max_trials=4)
    rec, best = drive(s, budget=26_000_000)
    assert s.runs == 4 and 'max_trials' in s.stopped and s.playoff_state is not None and s.best[0] is rec

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
    with pytest.raises(ValueError, match='positive ints'): new_search(budget, bucket_sizes=(0,)).candidate(2, 4)

def test_a_lucky_reading_loses_the_playoff():
    "Stage 3's first readings are 40% high (a quiet moment) and top the search; the interleaved rounds, under the same noise for all, do not pick it"
    budget = 26_000_000
    for seed in range(5):
        s = new_search(budget)
        rec, best = drive(s, noisy(0.03, seed, lucky=lambda cfg: 1.4 if cfg['zero_optimization']['stage'] == 3 else 1.), budget=budget)
        searched = max((r for r in s.records if r['status'] == 'ok' and r['phase'] != 'playoff'), key=lambda r: r['metric'])
        assert searched['stage'] == 3, searched   # the search's best reading was a lucky one
        assert best.stage != 3 and s.margin['rounds'] >= 5, (seed, best, s.margin)
        truth = max(g['throughput'] for g in grid() if g['peak'] <= budget)   # the surface's best feasible point
        assert throughput(best.stage, best.micro_batch, best.reduce_bucket_size, best.allgather_bucket_size,
                          best.stage3_prefetch_bucket_size, best.overlap_comm) >= 0.97 * truth, (seed, best)

def test_the_baseline_stays_when_the_challengers_are_slower():
    """Every challenger 1% slower than the baseline, readings 4% noisy, the search's readings of them lucky (+10%) so they
    enter the playoff: their playoff medians sometimes favour one by chance, but never beyond the noise, so the baseline stays.
    A decision by the median alone (remove the guard in Playoff.winner) takes a slower challenger in some of these runs."""
    budget, median_only = 26_000_000, 0
    for seed in range(6):
        s = new_search(budget)
        rec, best = drive(s, noisy(0.04, seed, level=0.99, lucky=lambda cfg: 1.1 if cfg['zero_optimization']['stage'] else 1.), budget=budget)
        po = s.playoff_state
        assert len(po.entrants) == 4 and po.baseline == s.baseline[1]
        top = max((c for c in po.alive if c != po.baseline), key=lambda c: po.compare(c, po.baseline)['ratio'])
        median_only += po.compare(top, po.baseline)['ratio'] > 1
        assert best == s.baseline[1] and 'no other configuration beat it beyond the noise' in s.margin['verdict'], (seed, s.margin)
    assert median_only >= 2   # the guard, not the medians, kept the baseline

def test_global_batch_only_pairs_that_make_it():
    "train_batch_size fixed: every run is a micro-batch x accumulation pair that makes exactly it"
    budget, T = 26_000_000, 96
    settings = TuneSettings(max_micro_batch=64, train_batch=T)
    s = Search(settings, predict=predict, memory_budget=budget, world_size=WORLD, num_params=P,
               micro_batches=global_batch_micro_batches(T, WORLD, 1, 64))
    rec, best = drive(s, budget=budget)
    ran = [r for r in s.records if r['status'] != 'pruned']
    assert ran and all(r['micro_batch'] * r['gradient_accumulation'] * WORLD == T == r['config']['train_batch_size'] for r in s.records)
    assert {r['gradient_accumulation'] for r in ran} > {1}   # accumulation made up the rest
    assert best.micro_batch * best.gradient_accumulation * WORLD == T

@pytest.mark.parametrize('budget', [20_000_000, 26_000_000, 40_000_000, 10**12])
def test_largest_micro_batch_in_at_most_three_runs_on_average(budget):
    "Largest micro-batch from the model, confirmed by measurement: <= 3 runs per stage on average, budget-bound included"
    s = new_search(budget if budget < 10**12 else None, max_micro_batch=1024)
    drive(s, budget=budget)
    runs = [n for st, n in s.max_micro_batch_runs.items()]
    assert runs and sum(runs) / len(runs) <= 3, s.max_micro_batch_runs

def test_thread_sweep_picks_the_faster_count():
    "16 cores, 2 ranks: flexrt gives 8 threads a rank; on this surface 4 run faster: the sweep finds them in 2 extra runs"
    budget = 26_000_000
    plain = new_search(budget, threads_per_rank=8)
    drive(plain, budget=budget)
    s = new_search(budget, threads_per_rank=8, thread_counts=(1, 2, 4, 8))
    rec, best = drive(s, threaded({8: 1.0, 4: 0.8, 2: 0.9, 1: 1.3}), budget=budget)
    swept = [r['threads_per_rank'] for r in s.records if r['phase'] == 'threads']
    assert swept == [4, 2] and s.runs == plain.runs + 2, (swept, s.runs, plain.runs)   # 2 is slower than 4: no need for 1
    assert best.threads_per_rank == 4 and rec['config']['threads_per_rank'] == 4 and rec['phase'] == 'threads'
    assert (best.stage, best.micro_batch) == (plain.best[1].stage, plain.best[1].micro_batch)   # at the best point found
    assert 'with 4 threads per rank' in s.margin['verdict'], s.margin
    assert all(r['config']['threads_per_rank'] == 8 for r in s.records if r['phase'] not in ('threads', 'playoff'))

def test_a_close_thread_count_competes_in_the_playoff_and_a_fixed_one_is_not_searched():
    budget = 26_000_000
    s = new_search(budget, threads_per_rank=8, thread_counts=(1, 2, 4, 8), playoff_size=1)   # only the best search reading ...
    rec, best = drive(s, threaded({8: 1.0, 4: 1.01}), budget=budget)   # ... and, 1% behind it (within the noise), 4 threads
    four = [c for c in s.playoff_state.entrants if c.threads_per_rank == 4]
    assert len(four) == 1 and (four[0].stage, four[0].micro_batch) == (best.stage, best.micro_batch)   # interleaved with the rest
    assert sum(r['phase'] == 'playoff' and r['threads_per_rank'] == 4 for r in s.records) == len(s.playoff_state.rounds)
    fixed = new_search(budget, threads_per_rank=2)   # yours (threads_per_rank in the config): no counts to search
    rec, best = drive(fixed, threaded({1: 0.5}), budget=budget)
    assert not [r for r in fixed.records if r['phase'] == 'threads'] and best.threads_per_rank == rec['config']['threads_per_rank'] == 2
    assert 'with 2 threads per rank' in fixed.margin['verdict']

def test_a_far_ahead_winner_names_the_phase_that_got_faster():
    "The optimizer step dominates and runs 4x faster above stage 0: the verdict says so from the playoff's phase times"
    budget = 26_000_000
    s = new_search(budget)
    rec, best = drive(s, step_bound(), budget=budget)
    m = s.margin
    assert best.stage > 0 and m['baseline']['ratio'] > 1.5, m
    assert 'against the baseline, the optimizer step ' in m['verdict'] and ' faster (' in m['verdict'], m['verdict']
    assert 'backward unchanged' in m['verdict'] and m['why'] in m['verdict'], m['verdict']
    s = new_search(budget)
    rec, best = drive(s, budget=budget)   # the plain surface: phases timed, the winner 1.2x the baseline: the ratio alone
    assert 1 < s.margin['baseline']['ratio'] < 1.5 and s.margin['why'] == '' and 'against the baseline' not in s.margin['verdict'], s.margin

def with_anatomy(measure_fn):
    "A `measure` whose readings carry the step anatomy their phases make (`anatomy_ms`, as `run_trial` records it)"
    def fn(*args, **kwargs):
        r = measure_fn(*args, **kwargs)
        if r.status == 'ok':
            p = r.phases_ms   # the reduction wait is time blocked in communication; the optimizer step, the optimizer
            r.anatomy_ms = {'data_wait': 0.0, 'forward': p['forward'], 'backward': p['backward'], 'comm': p['allreduce'],
                            'optimizer': p['step'], 'rest': 0.0, 'wall': sum(p.values())}
        return r
    return fn

def test_a_large_win_is_explained_in_step_anatomy_phases():
    """A winner 1.2x the baseline or more names the anatomy phase whose median time fell the most, with its percentage
    (per sample: the two run different micro-batches); one below 1.2x gives its ratio alone"""
    budget = 26_000_000
    s = new_search(budget)
    rec, best = drive(s, with_anatomy(step_bound(optimizer=0.040, speedup=4.)), budget=budget)
    m, base = s.margin, s.baseline[1]
    shorter = 1 - (0.040 / 4 / best.micro_batch) / (0.040 / base.micro_batch)   # the optimizer step per sample
    assert best.micro_batch != base.micro_batch and m['baseline']['ratio'] >= 1.2, m
    assert m['anatomy'].startswith(f"its optimizer step is {shorter * 100:.0f} % shorter than the baseline's ("), m
    assert m['anatomy'].endswith(' ms per sample)') and m['verdict'].endswith(f"; {m['anatomy']}"), m['verdict']
    assert m['why'] and 'against the baseline' not in m['verdict'], m   # the timers' account is not given twice
    s = new_search(budget)
    drive(s, with_anatomy(measure), budget=budget)                    # the plain surface: 1.19x, below the rule's 1.2x
    assert 1 < s.margin['baseline']['ratio'] < 1.2 and s.margin['anatomy'] == '' and 'shorter' not in s.margin['verdict']

def test_one_disturbed_round_does_not_change_the_playoff_winner():
    "The playoff ranks by the median of paired ratios: one round read 3x off (a neighbour's burst) moves no winner"
    from flexrt.autotuner.playoff import Playoff
    a, b = Candidate(1, 64, 1), Candidate(0, 64, 1)
    playoff = Playoff([a, b], min_rounds=8, max_rounds=8)
    for r in range(8):   # a is 5 % faster every round, except round 3, where its reading came out 3x low
        playoff.add_round({a.key: 1050.0 / (3 if r == 3 else 1), b.key: 1000.0})
    assert playoff.compare(a, b)['ratio'] == pytest.approx(1.05)   # the mean of the ratios would be 0.96
    assert playoff.winner() == a
    assert playoff.standings()[0]['key'] == a.key
