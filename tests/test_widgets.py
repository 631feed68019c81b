"""flexrt.widgets: views are thin over a RecordStore that tests drive directly; the dashboard's Stop button stops a
background run on every rank at the same step; save() writes the plots and every record."""
import sys, time
from pathlib import Path
import pandas as pd, pytest
from flexrt import monitor
from flexrt.launch import launch
from flexrt.widgets import RecordStore, GradNormTrace, MemoryMonitor, TrainingDashboard

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / 'examples'))
from quickstart_train import count_until_stopped

@pytest.fixture(autouse=True)
def clean():
    yield
    monitor.stop_serving()

def step(rank, n, skipped=False):
    return {'kind': 'step', 'time': 10.0 + n, 'rank': rank, 'step': n, 'loss': 1.0 / n, 'grad_norm': 3.0 / n,
            'grad_norm_post_clip': min(1.0, 3.0 / n), 'lr': [0.1 * n], 'loss_scale': 2.0 ** 16, 'skipped': skipped,
            'samples': 4 * n, 'samples_per_s': 40.0, 'memory': {'allocated_bytes': n << 20,
            'max_allocated_bytes': 2 * n << 20, 'process_rss_bytes': 100 << 20}}

def test_views_show_the_latest_values_of_their_records():
    records = RecordStore()
    trace, memory = GradNormTrace(clip=1.0, records=records), MemoryMonitor(records=records)
    for n in range(1, 6):
        for rank in (0, 1): records(step(rank, n, skipped=n == 2))
    trace.refresh(); memory.refresh()
    assert 'step 5: grad norm 0.6 &rarr; 0.6' in trace.text.value and 'lr 0.5' in trace.text.value
    assert 'skipped 1' in trace.text.value and trace.plot.value.startswith('<img src="data:image/png;base64,')
    assert 'rank 0: 5.0 MiB (peak 10.0)' in memory.text.value and 'RSS 100 MiB' in memory.text.value

def test_dashboard_gets_kernel_records_and_saves_plots_and_history(tmp_path):
    dash = TrainingDashboard(total_steps=8, interval=0.05)
    for n in range(1, 5):
        for rank in (0, 1): monitor.emit(**{k: v for k, v in step(rank, n).items() if k != 'time'})
    dash.refresh()
    assert (dash.steps_seen.value, dash.progress.value, dash.progress.max) == (8, 4, 8)
    assert 'step 4/8' in dash.status.value
    assert dash.save(tmp_path) == ['grad_norm.png', 'memory.png', 'history.csv']
    saved = pd.read_csv(tmp_path / 'history.csv')
    assert list(saved[saved['rank'] == 1]['step']) == [1, 2, 3, 4] and (tmp_path / 'memory.png').stat().st_size > 1000
    dash.close()
    monitor.emit('step', rank=0, step=5)                             # closed: no longer listening
    assert len(dash.history) == 8 and isinstance(dash.history, pd.DataFrame)

def test_stop_button_stops_every_rank_at_the_same_step():
    dash = TrainingDashboard(interval=0.1)
    run = launch(count_until_stopped, (5000,), num_processes=2, background=True)
    deadline = time.time() + 90
    while len(dash.records._frame()) < 12 and time.time() < deadline: time.sleep(0.05)   # poll: records come from other processes
    dash.stop_button.click()
    assert dash.stop_button.description == 'Stopping'
    assert run.wait(90) and dash.stop_button.disabled
    logs = dash.records.frame('log')
    last = logs.groupby('rank')['step'].max()
    assert last[0] == last[1] < 4999 and len(logs) == 2 * (last[0] + 1)
    deadline = time.time() + 30                                      # the redraw thread sees the ranks gone
    while dash.stop_button.description != 'Stopped' and time.time() < deadline: time.sleep(0.05)   # poll: the redraw thread's change
    assert (dash.stop_button.description, dash.stop_button.disabled) == ('Stopped', True)
    dash.close()

def sample_memory_in_rank(seconds):
    "A rank that only samples its memory, through the monitor (module-level: forked ranks run it)"
    from flexrt import comm, monitor
    comm.init_distributed()
    with monitor.sample_memory(interval_ms=10): time.sleep(seconds)   # the rank's work: sampling goes on meanwhile
    comm.destroy_process_group()

def test_memory_monitor_fills_from_samplers_in_the_ranks():
    from accelerate import notebook_launcher
    from flexrt.launch import free_port
    view = MemoryMonitor(interval=3600)
    notebook_launcher(sample_memory_in_rank, (0.3,), num_processes=2, use_port=str(free_port()))
    view.refresh()
    memory = view.records.frame('memory')
    assert sorted(memory['rank'].unique()) == [0, 1] and (memory.groupby('rank').size() >= 2).all()   # at start and at stop
    assert (memory['memory.process_rss_bytes'] > 0).all() and view.num_plots >= 1   # drawn on its own with the first records
    assert view._plotted == view._plot_key()                          # and refresh() drew every record
    assert 'rank 0:' in view.text.value and 'rank 1:' in view.text.value and view.plot.value.startswith('<img')
    view.close()

class FakeClock:
    "A clock the test sets"
    def __init__(self): self.now = 0.
    def __call__(self): return self.now

class SteppingClock:
    "A CPU clock that advances `step` at every reading: each plot (read before and after) costs exactly `step`"
    def __init__(self, step): self.now, self.step = 0., step
    def __call__(self): self.now += self.step; return self.now

def test_plots_keep_to_their_cpu_budget_while_texts_follow_every_record():
    """A flood of records, one every 1/64 s for 2 s of a fake clock, each followed by what the redraw loop does: the
    first plot at once, then plots costing 1/32 CPU-second with cpu_share 1/16 are due every 0.5 s (records 1, 33, 65,
    97), texts after every record"""
    dash = TrainingDashboard(total_steps=10_000, interval=1 / 128, cpu_share=1 / 16, redraw=False)   # the test drives
    dash.clock, dash.cpu_clock = FakeClock(), SteppingClock(1 / 32)
    drawn_at = []
    for n in range(1, 129):
        dash.clock.now = n / 64
        for rank in (0, 1): dash.records(step(rank, n))
        before = dash.grad_norm.num_plots
        dash.refresh(plots=dash.plot_stale() and dash.plot_due())   # one pass of the redraw loop
        if dash.grad_norm.num_plots > before: drawn_at.append(n)
        assert dash.steps_seen.value == 2 * n and f'step {n}/10000' in dash.status.value   # the texts follow every record
    assert drawn_at == [1, 33, 65, 97] and dash.memory.num_plots == 4
    dash.close()
    plots = dash.grad_norm.num_plots
    dash.records(step(0, 129)); dash.refresh()                       # refresh() draws the latest records at once
    assert dash.grad_norm.num_plots == plots + 1 and 'step 129:' in dash.grad_norm.text.value
