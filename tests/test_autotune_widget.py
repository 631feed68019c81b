"""flexrt.widgets.autotune_widget, driven without a browser: the controls become `autotune` arguments; a real search on two
gloo ranks, launched in the background by `w.run()`, fills the trial table and the plots while it runs (its records
reach this process over the monitor channel); Stop ends it after the current trial with the best so far kept; the
folder it wrote reopens with the same trials; an interrupted search resumes from it. Synthetic records (no training)
check what the figure and the texts show of the search's confidence: the intervals, the playoff, the margin, the
throughput x peak-memory view with its Pareto front and budget, and an old result without any of them."""
import json, math, os, re, sqlite3
import sys
from pathlib import Path
import pandas as pd, pytest, torch
from flexrt import monitor
from flexrt.autotuner.results import AutotuneResult
from flexrt.monitor.anatomy import ANATOMY_PHASES
from flexrt.widgets.autotune_view import search_arguments
from flexrt.widgets import AutotuneWidget

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / 'examples'))

def model_fn():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))

def train_step(engine):
    x = torch.randn(engine.train_micro_batch_size_per_gpu(), 32)
    engine.backward(engine(x).pow(2).mean()); engine.step()

CONFIG = {'train_micro_batch_size_per_gpu': 2, 'gradient_accumulation_steps': 1, 'steps_per_print': 10**9,
          'optimizer': {'type': 'Adam', 'params': {'lr': 1e-3}},
          'autotuning': {'fast': True, 'start_profile_step': 1, 'end_profile_step': 2,
                         'max_profile_steps': 3}}   # 3 timed steps a trial at most: these tests check the widget

@pytest.fixture(autouse=True)
def clean():
    yield
    monitor.stop_serving()

def widget(tmp_path, **kwargs):
    w = AutotuneWidget(model_fn, train_step, CONFIG, results_dir=str(tmp_path / 'autotuning_results'), interval=0.1, **kwargs)
    w.controls['stages'].value, w.controls['micro_batch_range'].value = (0, 1), (1, 16)
    return w

def drawn_anatomy(panel):
    "The step anatomy the panel draws under its table: phase -> ms, read back from the drawing"
    return {p: float(ms) for p, ms in re.findall(r'data-phase="(\w+)" data-ms="([^"]+)"', panel.anatomy.value)}

def wait_for(condition, w, timeout=180):
    "Wait for a drawing after which `condition` holds (records arrive on other threads); raise what the ranks raised if they end first"
    assert w.wait_drawn(lambda: condition() or w.launched.done, timeout), 'timed out'
    if not condition(): w.wait(); assert condition(), f'the search ended ({w.state}) first'

def test_controls_become_autotune_arguments(tmp_path):
    w = widget(tmp_path, memory_budget='96MiB', num_processes=2)
    w.controls['metric'].value, w.controls['max_trials'].value, w.controls['time_budget'].value = 'latency', 7, 30.0
    config, kwargs = search_arguments(w.settings(), w.config)
    assert kwargs == {'stages': [0, 1], 'memory_budget': 96 * 2**20, 'max_trials': 7, 'time_budget': 30.0, 'bucket_sizes': None}
    assert config['autotuning'] == CONFIG['autotuning'] | {'metric': 'latency', 'min_train_micro_batch_size_per_gpu': 1,
                                                           'max_train_micro_batch_size_per_gpu': 16}
    assert not w.controls['bucket_sizes'].disabled and len(w.controls['bucket_sizes'].value) == 3   # the autotuner's, to choose from
    assert w.config == CONFIG                                          # the user's config is not touched
    w.controls['stages'].value = ()                                   # a bad control: Run says what to change
    w.run_button.click()
    assert 'stages=() must be a non-empty subset' in w.notice.value and w.launched is None and w.state == 'idle'
    w.close()

def test_planner_answers_for_any_world_size_before_running(tmp_path):
    from flexrt.autotuner.memory import estimate_memory, profile_model
    from flexrt.autotuner.space import format_bytes
    w = widget(tmp_path, memory_budget='1KiB')
    w.planner.stage.value, w.planner.micro_batch.value, w.planner.world_size.value = 3, 8, 1024
    big = w.planner.show()
    assert big is not None, w.planner.error
    expected = estimate_memory(profile_model(model_fn, CONFIG, train_step=train_step), {**CONFIG, 'zero_optimization': {'stage': 3},
                               'train_micro_batch_size_per_gpu': 8}, world_size=1024, micro_batch=8)
    assert (big.peak_bytes, big.breakdown) == (expected.peak_bytes, expected.breakdown)   # the autotuner's answer, shown
    assert f'per rank: {format_bytes(big.peak_bytes)}' in w.planner.output.value
    w.planner.stage.value = 0
    replicated = w.planner.show()
    # stage 0 replicates the optimizer state that stage 3 splits 1024 ways (this tiny model's parameters all stay
    # gathered at stage 3: below stage3_param_persistence_threshold, so its peak is not smaller)
    assert replicated.breakdown['optimizer_state'] > 100 * big.breakdown['optimizer_state'] and 'over the budget (1.00KiB)' in w.planner.output.value
    w.planner.world_size.value = 2000                                 # the control stops at 1024
    assert w.planner.world_size.value == 1024 and w.launched is None  # nothing ran
    w.close()

def test_search_fills_table_and_plots_live_and_reopens(tmp_path):
    w = widget(tmp_path, memory_budget='256MiB')
    w.controls['max_trials'].value = 6
    w.run_button.click()
    assert w.state == 'running' and w.stop_button.disabled is False and w.run_button.disabled
    wait_for(lambda: '<tr class="flexrt-trial"' in w.table.value, w)   # drawn by the widget's own thread as records come
    assert w.wait(180) and w.state == 'finished' and w.launched.error is None
    trials, stored = w.trials, AutotuneResult.load(w.results_dir)
    assert 1 <= len(trials[trials['phase'] != 'remeasure']) and list(trials['trial']) == list(stored.trials['trial'])
    assert list(trials['status']) == list(stored.trials['status'])
    assert w.table.value.count('<tr class="flexrt-trial"') == len(trials) and w.table.value.count('background:#c8f0c8') == 1
    assert w.plot.value.startswith('<img src="data:image/png') and w.num_plots >= 1
    # under the table, the best trial's step anatomy: each drawn phase is its record's (as the ranks measured it)
    best = trials[trials['trial'] == w.view.best['trial']].iloc[0]
    assert w.anatomy_trial.value == best['trial'] and drawn_anatomy(w) == {p: best['anatomy_ms'][p] for p in ANATOMY_PHASES}
    best = json.load(open(os.path.join(w.results_dir, 'ds_config_optimal.json')))
    assert w.best_config == best and w.stop_button.disabled and not w.run_button.disabled
    assert w.save(tmp_path / 'saved') == ['autotune.png', 'trials.csv', 'ds_config_optimal.json']
    assert len(pd.read_csv(tmp_path / 'saved' / 'trials.csv')) == len(trials)
    reopened = AutotuneWidget.load(w.results_dir)                      # the folder, browsed
    assert list(reopened.trials['trial']) == list(trials['trial']) and reopened.best_config == best
    assert reopened.run_button.disabled and 'best' in reopened.status.value
    for x in (w, reopened): x.close()

def test_stop_ends_the_search_after_the_current_trial_and_keeps_the_best(tmp_path):
    from autotune_widget_train import model_fn as gpt, train_step as gpt_step, CONFIG as GPT   # trials of seconds: time to stop
    w = AutotuneWidget(gpt, gpt_step, GPT, results_dir=str(tmp_path / 'autotuning_results'), interval=0.1)
    w.run()
    wait_for(lambda: '<tr class="flexrt-trial"' in w.table.value, w)   # a row on screen while the ranks search
    w.stop_button.click()
    assert w.stop_button.description == 'Stopping' and w.state == 'stopping'
    assert w.wait(180) and w.state == 'stopped'
    w.refresh()
    assert w.stop_button.description == 'Stopped' and w.view.end['stopped'] == 'stop requested'
    assert w.best_config is not None and w.best_config == AutotuneResult.load(w.results_dir).best_config
    w.close()

def test_an_interrupted_search_resumes_with_its_earlier_trials_shown(tmp_path):
    first = widget(tmp_path)
    first.controls['max_trials'].value = 2                          # cut short: the space holds more
    first.run(); assert first.wait(180)
    earlier = first.trials
    first.close()
    again = widget(tmp_path)
    again.controls['max_trials'].value = len(earlier) + 3
    again.run(resume=True)
    assert list(again.trials['trial']) == list(earlier['trial'])     # shown before the ranks report anything
    assert again.wait(180) and again.state == 'finished'
    resumed = again.trials
    assert list(resumed['trial'])[:len(earlier)] == list(earlier['trial']) and len(resumed) > len(earlier)
    assert list(resumed['trial']) == list(range(len(resumed)))      # numbering went on where it stopped
    again.close()

# `make demo` runs the example's full search (stages 0-2, micro-batches 1-32, 14 trials, a playoff of up to 15 rounds);
# the test runs its cells with a smaller one (stages 0-1, micro-batches 1-8, 4 trials, 6 rounds): the same code path
SMALLER_SEARCH = {'(0, 1, 2), (1, 32), 14': '(0, 1), (1, 8), 4',
                  'CONFIG, num_processes=2': "{**CONFIG, 'autotuning': {**CONFIG['autotuning'], 'playoff_rounds': 6}}, "
                                             "num_processes=2"}

def test_example_notebook_searches_on_two_ranks_and_asserts_its_result(tmp_path):
    from run_autotune import run
    nb = run(tmp_path, edits=SMALLER_SEARCH)   # raises if a cell (the notebook's asserts) failed
    searched = next(c.source for c in nb.cells if c.cell_type == 'code' and 'AutotuneWidget(' in c.source)
    assert '(0, 1), (1, 8), 4' in searched and "'playoff_rounds': 6" in searched   # the edits reached the kernel
    printed = ''.join(o.get('text', '') for c in nb.cells if c.cell_type == 'code' for o in c.outputs)
    assert 'trials in' in printed and 'MiB per rank' in printed
    assert {'autotune.png', 'trials.csv', 'ds_config_optimal.json', 'autotuning_results'} <= {p.name for p in tmp_path.iterdir()}
    state = nb.metadata['widgets']['application/vnd.jupyter.widget-state+json']['state'].values()
    tables = [m['state']['value'] for m in state if m['model_name'] == 'HTMLModel' and 'flexrt-trials' in m['state'].get('value', '')]
    assert len(tables) == 1 and tables[0].count('<tr class="flexrt-trial"') == len(pd.read_csv(tmp_path / 'trials.csv'))

def test_a_search_that_cannot_start_shows_why_and_can_run_again(tmp_path):
    from flexrt.launch import RankError
    w = widget(tmp_path, memory_budget='1KiB')                        # below what the model needs at any stage
    w.run()
    with pytest.raises(RankError, match='memory_budget'): w.wait(180)
    assert w.state == 'failed' and 'memory_budget' in w.status.value and '<b>failed</b>' in w.status.value
    assert not w.run_button.disabled and w.stop_button.disabled       # fix the budget and Run again
    w.controls['memory_budget'].value = '256MiB'; w.controls['max_trials'].value = 1
    w.run(); assert w.wait(180) and w.state == 'finished' and len(w.trials) >= 1
    w.close()

# What the figure and the texts show of the search's confidence, from synthetic records (no training)
import re
from types import SimpleNamespace
from flexrt.widgets.autotune_view import SearchView, search_plot, MiB
from flexrt.widgets.autotune_panel import SearchPanel

def record(n, stage, mb, metric=None, peak=None, status='ok', phase='throughput', **more):
    "A trial record as the autotuner emits it"
    return {'kind': 'experiment', 'event': 'trial', 'trial': n, 'phase': phase, 'stage': stage, 'micro_batch': mb,
            'gradient_accumulation': 1, 'reduce_bucket_size': 2**20, 'allgather_bucket_size': 2**20, 'overlap_comm': False,
            'status': status, 'reason': '' if status == 'ok' else status, 'metric_name': 'throughput', 'metric': metric,
            'samples_per_s': metric, 'peak_bytes_measured': peak, 'peak_bytes_per_rank': [peak, peak], 'peak_bytes_predicted': peak,
            'seconds': 1.0, 'config': {'train_micro_batch_size_per_gpu': mb, 'zero_optimization': {'stage': stage}}} | more

# the search's points: stage, micro-batch, metric, measured per-rank peak in MiB (all distinct)
SEARCH = [(0, 4, 210., 60), (0, 8, 300., 95), (0, 16, 330., 170), (1, 4, 200., 45), (1, 8, 290., 70), (1, 16, 345., 120),
          (2, 8, 280., 58), (2, 16, 335., 100), (2, 32, 350., 190), (3, 16, 240., 52), (3, 32, 260., 88)]

def as_metric(samples_per_s, metric_name):
    "SEARCH's figure as `metric_name` (latency: seconds per step of 64 samples, lower is better)"
    return 64 / samples_per_s if metric_name == 'latency' else samples_per_s

def searched(budget_mib=640, metric_name='throughput', rounds=3):
    "A view of SEARCH (each point with its interval), an oom, and `rounds` playoff rounds whose metrics beat everything searched"
    view = SearchView()
    view({'kind': 'experiment', 'event': 'start', 'metric': metric_name, 'memory_budget': budget_mib * MiB})
    for n, (s, mb, m, p) in enumerate(SEARCH):
        m = as_metric(m, metric_name)
        view(record(n, s, mb, m, p * MiB, metric_name=metric_name, metric_low=m * 0.97, metric_high=m * 1.02, noise=0.03,
                    steps_measured=40, round=None))
    view(record(len(SEARCH), 0, 32, status='oom', metric_name=metric_name))
    n = len(SEARCH) + 1
    for r in range(1, rounds + 1):
        for s, mb, p in ((1, 16, 120), (2, 32, 190), (0, 8, 95)):
            good = 0.001 if metric_name == 'latency' else 999.
            view(record(n, s, mb, good, p * MiB + 1, phase='playoff', round=r, metric_name=metric_name, metric_low=good, metric_high=good))
            n += 1
    return view

def filled(view):
    "The panel's figure for `view`, drawn: a `Plot`"
    panel = SearchPanel(view=view, interval=3600)
    plot = panel.fill(search_plot()); plot.render(); panel.close()
    return plot

def standing(name, stage, mb, ratio, low=None, high=None, baseline=False, rounds=3):
    return {'name': name, 'stage': stage, 'micro_batch': mb, 'gradient_accumulation': 1, 'is_baseline': baseline,
            'ratio': ratio, 'low': low, 'high': high, 'rounds': rounds}

def test_interval_bars_are_the_records_intervals_and_the_playoff_is_no_search_point():
    view = searched()
    plot, trials = filled(view), view.trials
    for stage in range(4):
        rows = trials[(trials['stage'] == stage) & (trials['phase'] == 'throughput') & (trials['status'] == 'ok')]
        line, bars = plot.lines[(0, f'stage {stage}')], plot.lines[(0, f'_stage {stage} 95%')]
        assert list(line.get_xdata()) == list(rows['micro_batch']) and list(line.get_ydata()) == list(rows['metric'])
        xs, ys = bars.get_data()
        assert [x for x in xs if not math.isnan(x)] == [mb for mb in rows['micro_batch'] for _ in (0, 1)]
        assert list(zip(ys[0::3], ys[1::3])) == list(zip(rows['metric_low'], rows['metric_high']))   # each bar: the record's interval
        assert all(math.isnan(y) for y in ys[2::3]) and bars.get_color() == line.get_color()
    low, high = plot.axes[0].get_ylim()
    assert low <= min(m for *_, m, _ in SEARCH) * 0.97 and max(m for *_, m, _ in SEARCH) * 1.02 <= high < 999   # bars on the axis, repeats not
    drawn = sorted(y for s in range(4) for y in plot.lines[(1, f'stage {s}')].get_ydata())
    assert drawn == sorted(m for *_, m, _ in SEARCH)                  # the memory view too: no playoff point
    assert view.best['trial'] == 8 and view.best['phase'] == 'throughput'   # nor does a repeat pass for the best so far

def test_pareto_line_is_exactly_the_pareto_optimal_trials():
    for metric_name in ('throughput', 'latency'):
        plot = filled(searched(metric_name=metric_name))
        better = (lambda a, b: a < b) if metric_name == 'latency' else (lambda a, b: a > b)
        points = [(p, as_metric(m, metric_name)) for *_, m, p in SEARCH]
        dominated = lambda p, m: any(q <= p and not better(m, n) and (q < p or better(n, m)) for q, n in points if (q, n) != (p, m))
        optimal = sorted((p, m) for p, m in points if not dominated(p, m))
        front = plot.lines[(1, 'Pareto front')]
        assert list(zip(front.get_xdata(), front.get_ydata())) == optimal, metric_name
        assert front.get_drawstyle() == 'steps-post' and len(optimal) == 8   # a front worth the name: not every point, not one
        drawn = sorted((x, y) for s in range(4) for x, y in zip(*plot.lines[(1, f'stage {s}')].get_data()))
        assert drawn == sorted(points)                                # a point per ok search trial, coloured by stage
        assert [plot.lines[(1, f'stage {s}')].get_color() for s in range(4)] == [plot.lines[(0, f'stage {s}')].get_color() for s in range(4)]

def test_budget_is_a_line_within_the_data_and_a_note_far_above_it():
    plot = filled(searched(budget_mib=150))
    assert list(plot.lines[(1, 'budget')].get_xdata()) == [150., 150.]   # the budget in MiB, on the axis
    assert plot.axes[1].get_xlim() == pytest.approx((0, 190 * 1.15))
    assert not [t for t in plot.axes[1].texts if t.get_gid() == 'budget' and t.get_visible()]
    far = filled(searched(budget_mib=1900))                          # 10x the largest peak: the axis stays with the data
    low, high = far.axes[1].get_xlim()
    assert low == 0 and 190 < high <= 1.2 * 190 and (1, 'budget') not in far.lines
    notes = [t for t in far.axes[1].texts if t.get_gid() == 'budget' and t.get_visible()]
    assert [t.get_text() for t in notes] == ['budget 1,900 MiB →'] and notes[0].xy[0] > 0.9   # at the right edge
    assert 190 < far.axes[2].get_ylim()[1] <= 1.2 * 190               # the per-trial memory panel too
    assert [t.get_text() for t in far.axes[2].texts if t.get_visible()] == ['budget 1,900 MiB ↑']

def test_status_line_and_standings_from_playoff_and_end_records():
    view = searched()
    panel = SearchPanel(view=view, interval=3600); panel.refresh()
    assert '<br>' not in panel.status.value and panel.standings.value == ''   # before the playoff: no margin
    view({'kind': 'experiment', 'event': 'playoff', 'round': 3, 'max_rounds': 9, 'reference': 'baseline',
          'standings': [standing('z1 mb16', 1, 16, 1.12, 1.08, 1.16), standing('z2 mb32', 2, 32, 1.09, 1.05, 1.13),
                        standing('z0 mb8', 0, 8, 1.0, baseline=True), standing('z3 mb32', 3, 32, 0.74, rounds=1)]})
    panel.refresh()
    assert panel.status.value.endswith('<br>playoff round 3/9: leader z1 mb16 1.12× [1.08–1.16]')
    cells = lambda: [re.findall(r'<td>(.*?)</td>', row) for row in re.findall(r'<tr class="flexrt-standing".*?</tr>', panel.standings.value)]
    assert cells() == [['&#9733; leader', 'z1 mb16', '1', '16', '1', '1.12× [1.08–1.16]', '3'],
                       ['&asymp; tie', 'z2 mb32', '2', '32', '1', '1.09× [1.05–1.13]', '3'],
                       ['', 'z0 mb8 <i>(baseline)</i>', '0', '8', '1', '1.00×', '3'],
                       ['', 'z3 mb32', '3', '32', '1', '0.74×', '1']]
    verdict = ('stage 1, micro-batch 16: 1.12× the baseline [1.08–1.16], 1.03× the runner-up (stage 2, micro-batch 32) '
               '[0.99–1.06]: a tie with stage 2, micro-batch 32 within noise')
    best = {k: v for k, v in record(5, 1, 16, 345., 120 * MiB).items() if k not in ('kind', 'event')}
    view({'kind': 'experiment', 'event': 'end', 'best': best, 'best_config': best['config'],
          'margin': {'baseline': {'ratio': 1.12, 'low': 1.08, 'high': 1.16}, 'ties': [],
                     'runner_up': {'name': 'z2 mb32', 'ratio': 1.03, 'low': 0.99, 'high': 1.06}, 'verdict': verdict}})
    panel.refresh()
    assert panel.status.value.endswith(f'(trial 5)<br>{verdict}')      # the winner, then the margin it won by
    assert [c[0] for c in cells()] == ['&#9733; leader', '', '', '']    # the standings stay; the end's ties decide
    panel.close()

def test_the_selected_trials_anatomy_is_drawn_as_recorded(tmp_path):
    "Each trial the user selects under the table is drawn with its record's anatomy_ms; the pick survives new records"
    view, anatomy = searched(), {}
    for n in (1, 5, 8, 12):                                            # search points and a playoff round, each its own
        anatomy[n] = {'data_wait': 0.1 * n, 'forward': 4.0 + n, 'backward': 17.5, 'comm': 6.0 / n, 'optimizer': 12.0 - n / 2,
                      'rest': 0.25, 'wall': 40.0 + n, 'comm_gather': 0.0, 'comm_reduce': 6.0 / n}
        old = view.trials.set_index('trial').loc[n].to_dict()
        view({**old, 'trial': n, 'kind': 'experiment', 'event': 'trial', 'anatomy_ms': anatomy[n]})
    panel = SearchPanel(view=view, interval=3600); panel.refresh()
    assert [n for _, n in panel.anatomy_trial.options] == [1, 5, 8, 12]  # the trials with an anatomy, in order
    assert panel.anatomy_trial.value == view.best['trial'] == 8           # the best one, before the user picks
    for n in (12, 1, 5):
        panel.anatomy_trial.value = n                                     # the user selects trial n
        assert drawn_anatomy(panel) == {p: anatomy[n][p] for p in ANATOMY_PHASES}, n
        assert f'Step anatomy of trial {n}</b>' in panel.anatomy.value
    view(record(40, 2, 64, 400., 10 * MiB, anatomy_ms=anatomy[8]))       # a new best arrives: the pick stays
    panel.refresh()
    assert panel.anatomy_trial.value == 5 and drawn_anatomy(panel) == {p: anatomy[5][p] for p in ANATOMY_PHASES}
    saved = open(panel.save_html(tmp_path / 'search.html')).read()
    assert 'Step anatomy of trial 5' in saved and saved.count('class="flexrt-phase"') == len(ANATOMY_PHASES)
    panel.close()

def test_an_old_result_without_the_new_columns_still_shows(tmp_path):
    "A folder written before the playoff: no intervals, a 'remeasure' row, no margin"
    folder = tmp_path / 'autotuning_results'; folder.mkdir()
    old = lambda *a, **k: {key: v for key, v in record(*a, **k).items() if key not in ('kind', 'event')}
    records = [old(n, s, mb, m, p * MiB) for n, (s, mb, m, p) in enumerate(SEARCH)] + [old(11, 2, 32, 360., 190 * MiB, phase='remeasure')]
    meta = {'best_config': records[11]['config'], 'best': records[11], 'baseline': records[0], 'memory_budget': 640 * MiB,
            'mode': 'in-process', 'results_dir': str(folder), 'stopped': '', 'mode_reason': '', 'seconds': 12.0}
    with sqlite3.connect(folder / 'study.db') as db:
        db.execute('CREATE TABLE flexrt_trials (trial INTEGER PRIMARY KEY, record TEXT)')
        db.execute('CREATE TABLE flexrt_meta (name TEXT PRIMARY KEY, value TEXT)')
        db.executemany('INSERT INTO flexrt_trials VALUES (?, ?)', [(r['trial'], json.dumps(r)) for r in records])
        db.execute('INSERT INTO flexrt_meta VALUES (?, ?)', ('result', json.dumps(meta)))
    panel = SearchPanel.load(str(folder))
    assert panel.table.value.count('<tr class="flexrt-trial"') == 12 and panel.standings.value == ''
    assert panel.status.value.startswith('12 trials (12 ok); best 360 samples/s') and '<br>' not in panel.status.value
    plot = panel.fill(search_plot()); plot.render()
    assert not [n for _, n in plot.lines if n.endswith('95%')]                 # no intervals, no bars
    assert 360. not in list(plot.lines[(0, 'stage 2')].get_ydata())           # the re-measurement is no search point
    assert len(plot.lines[(1, 'Pareto front')].get_xdata()) >= 3
    assert panel.plot.value.startswith('<img src="data:image/png')
    panel.close()
    margin = {'baseline': {'ratio': 1.2, 'low': 1.1, 'high': 1.3}, 'runner_up': None, 'ties': [], 'verdict': 'stage 2: 1.20× the baseline'}
    result = SimpleNamespace(trials=panel.trials, best_config=meta['best_config'], best=meta['best'], memory_budget=None,
                             results_dir=str(folder), margin=margin, verdict=margin['verdict'])
    decided = SearchPanel.from_result(result, interval=3600)              # a result that has a margin but no standings
    assert decided.status.value.endswith('<br>stage 2: 1.20× the baseline')
    assert '<td>the baseline</td><td>1.20× [1.10–1.30]</td>' in decided.standings.value
    decided.close()

# ---- issue #35: the widget's search runs at the threads the training will use, and "Train with this" keeps them ----
import subprocess
ROOT = Path(__file__).resolve().parent.parent

WIDGET_SEARCH = """
import json, sys
sys.path[:0] = [{examples!r}]
from flexrt.widgets import AutotuneWidget
from autotune_widget_train import model_fn, train_step, CONFIG
config = {{**CONFIG, 'autotuning': {{**CONFIG['autotuning'], 'playoff_rounds': 6, 'max_profile_seconds': 2.0}}}}   # shorter: the test's
w = AutotuneWidget(model_fn, train_step, config, num_processes=2, memory_budget='512MiB', results_dir={results!r}, interval=1)
w.controls['stages'].value, w.controls['micro_batch_range'].value = (0, 1), (32, 32)
w.run(resume=False)
assert w.wait(400), 'the search did not end'
trials = w.trials[['phase', 'stage', 'micro_batch', 'status', 'metric', 'metric_low', 'metric_high', 'threads', 'threads_per_rank']]
json.dump(dict(trials=trials.to_dict('records'), verdict=w.result.verdict, threads=w.result.threads, best_config=w.best_config),
          open({out!r}, 'w'), default=float)
w.close()
"""

def _median(xs): xs = sorted(xs); return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2

def test_the_widgets_stage_0_and_stage_1_readings_agree_at_micro_batch_32(tmp_path):
    """The example's GPT at micro-batch 32, stages 0 and 1, searched from the widget in a fresh process as a kernel starts
    it (no OMP_NUM_THREADS, torch's default threads): each stage's reading, the medians of its trials' intervals (the
    search's and the playoff's interleaved rounds), within 2x of the other's. With every rank at torch's default threads
    (as many as the cores: before flexrt sized them) stage 0 read 3-20x slower than stage 1 and this fails."""
    out = tmp_path / 'search.json'
    script = WIDGET_SEARCH.format(examples=str(ROOT / 'examples'), results=str(tmp_path / 'autotuning_results'), out=str(out))
    env = {k: v for k, v in os.environ.items() if k not in ('OMP_NUM_THREADS', 'MKL_NUM_THREADS')}
    done = subprocess.run([sys.executable, '-c', script], env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=480)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = json.loads(out.read_text())
    ok = [t for t in found['trials'] if t['status'] == 'ok' and t['micro_batch'] == 32]
    threads = found['threads']
    assert threads['source'] == 'sized' and all(t['threads'] == t['threads_per_rank'] for t in ok), (threads, ok)   # trials at their count
    assert found['best_config']['threads_per_rank'] in threads['counts'] and ' thread' in found['verdict'], found
    reading = {s: [(t['metric_low'], t['metric_high']) for t in ok if t['stage'] == s and t['threads_per_rank'] == threads['threads_per_rank']]
               for s in (0, 1)}
    assert all(len(r) >= 6 for r in reading.values()), reading                 # the search's reading and the playoff's rounds
    (low0, high0), (low1, high1) = [(_median([l for l, _ in reading[s]]), _median([h for _, h in reading[s]])) for s in (0, 1)]
    # On a quiet machine the two intervals overlap. A busy one (another process on a core) moves single readings by up
    # to 1.5x (seen: stage 0 [1360-1604], stage 1 [813-1135] while a docs build ran), so the check is the artefact's
    # size: oversubscribed ranks read 3-20x apart, sized ones within 2x even under load.
    ratio = (low0 + high0) / (low1 + high1)
    assert 1 / 2 <= ratio <= 2, (f'stage 0 [{low0:.0f}-{high0:.0f}], stage 1 [{low1:.0f}-{high1:.0f}] samples/s: '
                                 f'{ratio:.2f}x apart; verdict: {found["verdict"]}')

def train_with_threads(config):
    "What 'Train with this' launches: the MLP with the search's best configuration, a few steps; each rank notes its threads"
    import flexrt
    from flexrt import comm as dist
    dist.init_distributed()
    try:
        engine, *_ = flexrt.initialize(model=model_fn(), config={**config, 'optimizer': CONFIG['optimizer']})
        for _ in range(2): train_step(engine)
        Path(os.environ['THREADS_NOTE'] + str(dist.get_rank())).write_text(str(torch.get_num_threads()))
        engine.close()
    finally: dist.destroy_process_group()

def test_train_with_this_runs_the_best_configurations_threads(tmp_path, monkeypatch):
    "best_config's threads_per_rank (a count neither torch's nor flexrt's plan would give here) is what the ranks train with"
    from flexrt.utils.threads import plan_threads
    want = max(torch.get_num_threads(), plan_threads(local_ranks=2).threads) + 1
    monkeypatch.setenv('THREADS_NOTE', str(tmp_path / 'threads'))
    view = SearchView()
    view(record(0, 0, 4, 100., 2**20, config={'train_micro_batch_size_per_gpu': 4, 'zero_optimization': {'stage': 0},
                                             'steps_per_print': 10**9, 'threads_per_rank': want}))
    w = AutotuneWidget(view=view, train=train_with_threads, interval=3600)
    w.refresh()
    assert w.best_config['threads_per_rank'] == want and not w.train_button.disabled
    w.train_button.click()
    assert w.error is None and w.training_run.wait(90) and w.training_run.error is None
    assert [int((tmp_path / f'threads{r}').read_text()) for r in (0, 1)] == [want, want]
    w.dashboard.refresh()
    run = w.dashboard.records.last('run')
    assert (run['threads.threads'], run['threads.source']) == (want, 'config'), run
    w.dashboard.close(); w.close()
