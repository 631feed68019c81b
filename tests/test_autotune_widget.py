"""flexrt.widgets.autotune_widget, driven without a browser: the controls become `autotune` arguments; a real search on two
gloo ranks, launched in the background by `w.run()`, fills the trial table and the plots while it runs (its records
reach this process over the monitor channel); Stop ends it after the current trial with the best so far kept; the
folder it wrote reopens with the same trials; an interrupted search resumes from it."""
import json, os, time
import sys
from pathlib import Path
import pandas as pd, pytest, torch
from flexrt import monitor
from flexrt.autotuner.results import AutotuneResult
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
          'autotuning': {'fast': True, 'start_profile_step': 1, 'end_profile_step': 2}}

@pytest.fixture(autouse=True)
def clean():
    yield
    monitor.stop_serving()

def widget(tmp_path, **kwargs):
    w = AutotuneWidget(model_fn, train_step, CONFIG, results_dir=str(tmp_path / 'autotuning_results'), interval=0.1, **kwargs)
    w.controls['stages'].value, w.controls['micro_batch_range'].value = (0, 1), (1, 16)
    return w

def wait_for(condition, w, timeout=180):
    "Poll `condition` (records arrive on other threads) until true; raise what the ranks raised if they end first"
    deadline = time.time() + timeout
    while not condition():
        if w.launched.done: w.wait(); assert condition(), f'the search ended ({w.state}) first'
        assert time.time() < deadline, 'timed out'
        time.sleep(0.05)

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

def test_example_notebook_searches_on_two_ranks_and_asserts_its_result(tmp_path):
    from run_autotune import run
    nb = run(tmp_path)                                                 # raises if a cell (the notebook's asserts) failed
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
