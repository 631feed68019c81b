"""flexrt.widgets: views are thin over a RecordStore that tests drive directly; the dashboard's Stop button stops a
background run on every rank at the same step; save() writes the plots and every record."""
import sys, threading
from pathlib import Path
import pandas as pd, pytest
from flexrt import monitor
from flexrt.launch import launch
from flexrt.widgets import RecordStore, GradNormTrace, MemoryMonitor, TrainingDashboard
from flexrt.widgets.plots import figure_html

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

def test_a_refresh_in_the_cell_sends_again_a_plot_the_redraw_thread_drew():
    """A plot the redraw thread drew between two cells went out under the earlier cell, which nbclient (make demo, the
    tests) no longer reads: the next cell's refresh() sends every drawn plot again, unchanged"""
    records = RecordStore()
    trace = GradNormTrace(clip=1.0, records=records)
    sent = []
    real = trace.plot._send
    trace.plot._send = lambda msg, buffers=None: (sent.append(msg['state']), real(msg, buffers))
    for n in range(1, 4): records(step(0, n))
    drawer = threading.Thread(target=trace.refresh)
    drawer.start(); drawer.join()
    assert [list(s) for s in sent] == [['value']] and trace.num_plots == 1     # drawn once, by the thread
    image = trace.plot.value
    again = threading.Thread(target=trace.refresh)                             # nothing new: the thread sends nothing
    again.start(); again.join()
    assert len(sent) == 1
    trace.refresh()                                                           # the cell's call: sent again, the same
    assert trace.num_plots == 1 and [s['value'] for s in sent[1:]] == [image]

# --- what the plots draw, read from the figure the PNG is made of ----------------------------------------------------
def drawn(figure)->dict:
    "{(panel title, line label): (x, y)} of every line in `figure`, as lists of floats"
    return {(ax.get_title(), line.get_label()): ([float(v) for v in line.get_xdata()], [float(v) for v in line.get_ydata()])
            for ax in figure.axes for line in ax.get_lines()}

def assert_axes_hold_their_lines(figure):
    "Each panel's x and y ranges cover every point of its lines (nothing drawn off the visible area)"
    for ax in figure.axes:
        points = [(x, y) for line in ax.get_lines() for x, y in zip(line.get_xdata(), line.get_ydata())]
        if not points: continue
        (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
        xs, ys = [float(x) for x, _ in points], [float(y) for _, y in points]
        assert x0 <= min(xs) and max(xs) <= x1 and y0 <= min(ys) and max(ys) <= y1, (ax.get_title(), (x0, x1), (y0, y1), xs, ys)

def noisy_step(rank, n, skipped=False):
    "`step` whose numbers differ by rank: rank 1's are 10x rank 0's"
    record, k = step(rank, n, skipped), 10.0 ** rank
    return record | {'loss': k / n, 'grad_norm': 3.0 * k / n, 'grad_norm_post_clip': min(1.0, 3.0 * k / n), 'lr': [0.1 * k * n]}

def test_gradient_norm_plot_draws_rank0s_steps_the_clip_and_the_skipped_steps():
    records = RecordStore()
    trace = GradNormTrace(clip=1.0, records=records, redraw=False)
    for n in range(1, 6):
        for rank in (0, 1): records(noisy_step(rank, n, skipped=n == 2))
    trace.refresh()
    figure = trace.live_figure
    assert trace.plot.value == figure_html(figure)                      # the PNG shown is this figure
    steps = [1., 2., 3., 4., 5.]
    assert drawn(figure) == {
        ('gradient norm', 'before clipping'): (steps, [3.0 / n for n in range(1, 6)]),     # rank 0's view only
        ('gradient norm', 'after clipping'): (steps, [min(1.0, 3.0 / n) for n in range(1, 6)]),
        ('gradient norm', 'clip 1'): ([1., 5.], [1., 1.]),                                 # the threshold, first to last step
        ('gradient norm', 'skipped (overflow)'): ([2.], [1.5]),                           # at the skipped step's norm
        ('loss', '_loss'): (steps, [1.0 / n for n in range(1, 6)]),
        ('learning rate', '_lr'): (steps, [0.1 * n for n in range(1, 6)]),
        ('loss scale', '_loss scale'): (steps, [2.0 ** 16] * 5)}
    assert_axes_hold_their_lines(figure)
    for n in range(6, 41):                                               # more steps: the same lines, longer, axes rescaled
        for rank in (0, 1): records(noisy_step(rank, n))
    trace.refresh()
    assert trace.live_figure is figure and trace.num_plots == 2
    lines = drawn(figure)
    assert lines[('gradient norm', 'before clipping')][0] == [float(n) for n in range(1, 41)]
    assert lines[('gradient norm', 'clip 1')] == ([1., 40.], [1., 1.]) and lines[('learning rate', '_lr')][1][-1] == 4.0
    assert_axes_hold_their_lines(figure)
    assert drawn(trace.figure()) == lines                                # save() draws the same as the live view
    trace.close()

def test_memory_plot_draws_each_ranks_bytes_over_time():
    records = RecordStore()
    memory = MemoryMonitor(records=records, redraw=False)
    for n in range(1, 5):
        for rank in (0, 1):
            records(step(rank, n) | {'memory': {'allocated_bytes': (n + 10 * rank) << 20, 'max_allocated_bytes': (2 * n + 10 * rank) << 20,
                                                 'process_rss_bytes': (100 + 50 * rank + n) << 20}})
    memory.refresh()
    figure, seconds = memory.live_figure, [0., 1., 2., 3.]              # x: seconds since the first record
    assert memory.plot.value == figure_html(figure)
    assert drawn(figure) == {
        ('tensor memory', f'rank {r} allocated'): (seconds, [n + 10. * r for n in range(1, 5)]) for r in (0, 1)} | {
        ('tensor memory', f'rank {r} peak'): (seconds, [2. * n + 10 * r for n in range(1, 5)]) for r in (0, 1)} | {
        ('process RSS', f'rank {r}'): (seconds, [100. + 50 * r + n for n in range(1, 5)]) for r in (0, 1)}
    assert_axes_hold_their_lines(figure)
    assert [ax.get_ylabel() for ax in figure.axes] == ['MiB', 'MiB'] and [ax.get_xlabel() for ax in figure.axes] == ['s', 's']
    memory.close()

def test_memory_plot_without_tensor_bytes_draws_the_rss_alone():
    records = RecordStore()
    memory = MemoryMonitor(records=records, redraw=False)
    for n in (1, 2):
        for rank in (0, 1):
            records(step(rank, n) | {'memory': {'allocated_bytes': 0, 'max_allocated_bytes': 0, 'tracked': False,
                                                 'process_rss_bytes': (200 + rank) << 20}})
    memory.refresh()
    assert drawn(memory.live_figure) == {('process RSS', f'rank {r}'): ([0., 1.], [200. + r] * 2) for r in (0, 1)}
    assert_axes_hold_their_lines(memory.live_figure)
    memory.close()

def test_dashboard_gets_kernel_records_and_saves_plots_and_history(tmp_path):
    dash = TrainingDashboard(total_steps=8, interval=0.05)
    for n in range(1, 5):
        for rank in (0, 1): monitor.emit(**{k: v for k, v in step(rank, n).items() if k != 'time'})
    dash.refresh()
    assert (dash.steps_seen.value, dash.progress.value, dash.progress.max) == (8, 4, 8)
    assert 'step 4/8' in dash.status.value
    assert dash.save(tmp_path) == ['grad_norm.png', 'memory.png', 'history.csv']   # steps only came
    saved = pd.read_csv(tmp_path / 'history.csv')
    assert list(saved[saved['rank'] == 1]['step']) == [1, 2, 3, 4] and (tmp_path / 'memory.png').stat().st_size > 1000
    norms, rss = drawn(dash.grad_norm.figure()), drawn(dash.memory.figure())   # what the PNGs were drawn from
    assert norms[('gradient norm', 'before clipping')] == ([1., 2., 3., 4.], [3.0, 1.5, 1.0, 0.75])
    assert rss[('tensor memory', 'rank 1 allocated')][1] == [1., 2., 3., 4.] and rss[('process RSS', 'rank 0')][1] == [100.] * 4
    dash.close()
    monitor.emit('step', rank=0, step=5)                             # closed: no longer listening
    assert len(dash.history) == 8 and isinstance(dash.history, pd.DataFrame)

def test_stop_button_stops_every_rank_at_the_same_step():
    dash = TrainingDashboard(interval=0.1)
    twelve, stopped, seen = threading.Event(), threading.Event(), []
    def count(record): seen.append(record); len(seen) >= 12 and twelve.set()   # after the dashboard's store, which listens first
    dash.stop_button.observe(lambda change: change['new'] == 'Stopped' and stopped.set(), names='description')
    with monitor.listen(count):
        run = launch(count_until_stopped, (5000,), num_processes=2, background=True)
        assert twelve.wait(90)                                       # records from the ranks reached the dashboard
    dash.stop_button.click()
    assert dash.stop_button.description == 'Stopping'
    assert run.wait(90) and dash.stop_button.disabled
    logs = dash.records.frame('log')
    last = logs.groupby('rank')['step'].max()
    assert last[0] == last[1] < 4999 and len(logs) == 2 * (last[0] + 1)
    assert stopped.wait(30)                                          # the redraw thread saw the ranks gone
    assert (dash.stop_button.description, dash.stop_button.disabled) == ('Stopped', True)
    dash.close()

def sample_memory_in_rank(num_samples):
    "A rank that only samples its memory, through the monitor, until its sampler took `num_samples` (module-level: forked ranks run it)"
    from flexrt import comm, monitor
    comm.init_distributed()
    taken, seen = threading.Event(), []
    def count(record): record['kind'] == 'memory' and seen.append(record); len(seen) >= num_samples and taken.set()
    with monitor.listen(count), monitor.sample_memory(interval_ms=10): assert taken.wait(60)   # the sampler's thread at work
    comm.destroy_process_group()

def test_memory_monitor_fills_from_samplers_in_the_ranks():
    from accelerate import notebook_launcher
    from flexrt.launch import free_port
    view = MemoryMonitor(interval=3600)
    notebook_launcher(sample_memory_in_rank, (3,), num_processes=2, use_port=str(free_port()))
    view.refresh()
    memory = view.records.frame('memory')
    assert sorted(memory['rank'].unique()) == [0, 1] and (memory.groupby('rank').size() >= 4).all()   # 3 while it ran, 1 at stop
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

def _flood(records:int, idle_cores:float)->tuple: # (the dashboard, the records after which a plot was drawn)
    """A flood of records, one every 1/64 s of a fake clock, each followed by what the redraw loop does; plots cost
    1/32 CPU-second, cpu_share is 1/16, and `idle_cores` of the machine's cores stay idle meanwhile"""
    dash = TrainingDashboard(total_steps=10_000, interval=1 / 128, cpu_share=1 / 16, redraw=False)   # the test drives
    dash.clock, dash.cpu_clock = FakeClock(), SteppingClock(1 / 32)
    dash.idle_clock = lambda: idle_cores * dash.clock.now
    drawn_at = []
    for n in range(1, records + 1):
        dash.clock.now = n / 64
        for rank in (0, 1): dash.records(step(rank, n))
        before = dash.grad_norm.num_plots
        dash.refresh(plots=dash.plot_stale() and dash.plot_due())   # one pass of the redraw loop
        if dash.grad_norm.num_plots > before: drawn_at.append(n)
        assert dash.steps_seen.value == 2 * n and f'step {n}/10000' in dash.status.value   # the texts follow every record
    return dash, drawn_at

def test_plots_keep_to_their_cpu_budget_while_texts_follow_every_record():
    """2 s of records with two cores idle: the first plot at once, then plots costing 1/32 CPU-second with cpu_share
    1/16 are due every 0.5 s (records 1, 33, 65, 97), texts after every record"""
    dash, drawn_at = _flood(128, idle_cores=2.)
    assert drawn_at == [1, 33, 65, 97] and dash.memory.num_plots == 4
    dash.close()
    plots = dash.grad_norm.num_plots
    dash.records(step(0, 129)); dash.refresh()                       # refresh() draws the latest records at once
    assert dash.grad_norm.num_plots == plots + 1 and 'step 129:' in dash.grad_norm.text.value

def test_a_panel_gets_its_first_look_at_once():
    "Layer norms first come at step 10, after the plots' budget was spent: the heatmap is drawn at the next pass, once"
    dash, drawn_at = _flood(8, idle_cores=0.)   # plotted at record 1; the budget then waits 2.5 s
    assert drawn_at == [1] and not dash.plot_due() and not dash.layers.first_drawn()
    dash.records({'kind': 'layer_norms', 'time': 18.0, 'step': 8, 'rank': 0, 'norms': {'0': 1.0, '1': 0.5},
                  'num_layers': 2, 'nonfinite_layers': []})
    assert dash.plot_due()
    dash.refresh(plots=dash.plot_stale() and dash.plot_due())
    assert dash.layers.first_drawn() and not dash.plot_due()   # the other plots wait for their budget again
    dash.close()

def test_plots_yield_when_the_training_keeps_the_cores_busy():
    """With a quarter of a core idle the plots get a quarter of their budget (one every 2 s instead of 0.5 s); with
    none idle, the floor: a fifth (one every 2.5 s); the texts still follow every record"""
    for idle, expected in ((0.25, [1, 129]), (0., [1, 161])):
        dash, drawn_at = _flood(192, idle_cores=idle)
        assert drawn_at == expected, (idle, drawn_at)
        dash.close()
