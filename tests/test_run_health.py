"""Issue 28's facts on real gloo ranks: the first non-finite gradient named (step, rank, parameter) and, when asked,
every rank stopped; a slowed rank named as the straggler from the ranks' own blocked times; layer norms; a dashboard
that watches gets all of it without extra code and keeps the launching cell quiet; "Train with this" trains with the
search's best configuration under a dashboard. Checked by content: records -> panel texts and plotted data."""
import math, time
import pandas as pd, pytest
import torch
from torch import nn
from helpers import run_distributed
from flexrt import monitor
from flexrt.widgets import RecordStore, TrainingDashboard
from flexrt.widgets.ranks import RankPanel, rank_table, straggler
from flexrt.widgets.layers import LayerNormHeatmap, layer_matrix

CONFIG = {'train_micro_batch_size_per_gpu': 4, 'gradient_clipping': 1.0, 'steps_per_print': 1,
          'optimizer': {'type': 'SGD', 'params': {'lr': 0.01}}}

def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))

def train(steps, config, plant_at=None, plant_rank=1, sleep_rank=None, sleep=0.0):
    "Train the MLP `steps` steps; a nan planted in layer 2's gradient on `plant_rank` at step `plant_at`; `sleep_rank` slowed"
    import flexrt
    from flexrt import comm as dist
    net = model()
    engine, *_ = flexrt.initialize(model=net, model_parameters=net.parameters(), config=config)
    rank = dist.get_rank()
    if rank == plant_rank and plant_at is not None:
        net[2].weight.register_hook(lambda g: g * float('nan') if engine.global_steps + 1 == plant_at else g)
    torch.manual_seed(rank)
    try:
        for _ in range(steps):
            if rank == sleep_rank: time.sleep(sleep)          # this rank's own work between its steps
            x = torch.randn(4, 8)
            engine.backward(engine(x).square().mean()); engine.step()
    finally: engine.close()

def ranked(rank, world_size, steps, config, **kwargs):
    "On each rank: train while listening; return (this rank's records, the error it stopped with)"
    from flexrt.engine.watch import NonFiniteError
    seen, error = [], None
    with monitor.listen(seen.append):
        try: train(steps, config, **kwargs)
        except NonFiniteError as e: error = (str(e), e.record)
    return [r for r in seen if r['kind'] in ('step', 'nonfinite', 'layer_norms', 'run')], error

@pytest.mark.parametrize('stage', [0, 1, 2, 3])
def test_nan_planted_in_one_layers_gradient_on_rank_1_is_named_with_step_and_parameter(stage):
    "Every stage names rank 1: its slot hands the watch each bucket's gradients before the reduction mixes the ranks'"
    config = {**CONFIG, 'zero_optimization': {'stage': stage}}
    (zero, _), (one, _) = run_distributed(ranked, 2, args=(5, config), kwargs=dict(plant_at=3))
    found, = [r for r in zero + one if r['kind'] == 'nonfinite']              # emitted once
    assert (found['step'], found['rank'], found['ranks'], found['what']) == (3, 1, [1], 'gradient')
    assert [r for r in zero if r['kind'] == 'nonfinite'] == []                 # by the rank named
    assert (found['parameter'], found['layer'], found['value']) == ('2.weight', '2', 'nan')
    steps = pd.DataFrame([r for r in zero if r['kind'] == 'step'])
    assert list(steps['step']) == [1, 2, 3, 4, 5] and steps['grad_norm'].iloc[:2].notna().all()
    assert not math.isfinite(steps['grad_norm'].iloc[2])                      # nan at stage 0, inf from sharded norms
    store = RecordStore()                                                     # the panel names it, by content
    for r in zero + one: store(r)
    from flexrt.widgets import GradNormTrace
    trace = GradNormTrace(records=store, redraw=False); trace.refresh()
    assert "step 3: non-finite values in rank 1&#x27;s own gradient; the first parameter whose gradient is non-finite: 2.weight (nan)" in trace.text.value
    assert list(trace._live.lines[(0, 'before clipping')].get_xdata())[:2] == [1, 2]   # the steps before it stay drawn
    trace.close()

def test_stop_on_nonfinite_stops_every_rank_at_that_step_zero_2():
    config = {**CONFIG, 'zero_optimization': {'stage': 2}, 'diagnostics': {'stop_on_nonfinite': True}}
    results = run_distributed(ranked, 2, args=(6, config), kwargs=dict(plant_at=2))
    for records, error in results:
        assert error is not None, 'every rank stops'
        message, record = error
        assert message.startswith("step 2: non-finite values in rank 1's own gradient; the first parameter whose gradient is non-finite: 2.")
        assert 'every rank stops here' in message and record['rank'] == 1
        assert [r['step'] for r in records if r['kind'] == 'step'] == [1]     # stopped inside step 2, before its record

def test_a_slowed_rank_is_named_the_straggler_and_layer_norms_are_sampled():
    config = {**CONFIG, 'diagnostics': {'layer_norms_every': 3, 'layer_norms_top': 2}}
    # 200 ms: far above what a busy machine's scheduling adds to either rank (a 30 ms plant judged against 20 ms
    # thresholds failed under load)
    results = run_distributed(ranked, 2, args=(12, config), kwargs=dict(sleep_rank=1, sleep=0.2))
    store = RecordStore()
    for records, _ in results:
        for r in records: store(r)
    table = rank_table(store.frame('step'))
    assert table.loc[0, 'wait'] > 0.1 and table.loc[1, 'wait'] < table.loc[0, 'wait'] / 2   # rank 0 waits for rank 1
    found = straggler(table)
    assert (found['rank'], found['waiter']) == (1, 0) and found['lag'] > 1.15
    panel = RankPanel(records=store, redraw=False); panel.refresh()
    assert panel.straggler.value.startswith('rank 1: ') and 'rank 0 waits' in panel.straggler.value
    assert panel.widget.layout.display == '' and panel.num_plots == 1
    norms = store.frame('layer_norms')
    assert list(norms['step']) == [3, 6, 9, 12] and set(norms['rank']) == {0} and (norms['num_layers'] == 3).all()
    matrix = layer_matrix(norms)
    assert len(matrix) == 2 and set(matrix.index) <= {'0', '2', '4'} and (matrix.to_numpy() > 0).all()
    heatmap = LayerNormHeatmap(records=store, redraw=False); heatmap.refresh()
    assert heatmap.live_figure.axes[0].images[0].get_array().shape == (2, 4)
    panel.close(); heatmap.close()

def watched_train(steps=12):
    from flexrt import comm as dist
    dist.init_distributed()
    try: train(steps, CONFIG, sleep_rank=1, sleep=0.1)   # the straggler by a margin no machine's load hides
    finally: dist.destroy_process_group()

def test_a_watching_dashboard_gets_every_panel_and_keeps_the_cell_quiet(capfd, tmp_path):
    from flexrt.launch import launch
    dash = TrainingDashboard(interval=3600, redraw=False)
    launch(watched_train, (20,), num_processes=2)
    dash.refresh()
    out = capfd.readouterr().out
    assert '[flexrt] step=' not in out                                        # steps_per_print=1, yet the cell is quiet
    assert '[flexrt] step=20 ' in dash.log.value and dash.log_section.layout.display == ''
    assert dash.ranks.widget.layout.display == '' and dash.ranks.straggler.value.startswith('rank 1: ')
    assert list(dash.records.frame('layer_norms')['step']) == [10, 20]        # a dashboard watches: every 10 steps
    assert dash.layers.widget.layout.display == '' and 'step 20: largest' in dash.layers.text.value
    assert [ax.get_title() for ax in dash.grad_norm.live_figure.axes] == ['gradient norm', 'loss', 'learning rate']   # no fp16
    page = (tmp_path / 'run.html').read_text() if dash.save_html(tmp_path / 'run.html') else ''
    assert page.count('data:image/png;base64,') == 5 and '&quot;train_micro_batch_size_per_gpu&quot;: 4' in page
    dash.close()

def train_with(config):
    "What 'Train with this' launches: the MLP with the search's best configuration"
    from flexrt import comm as dist
    dist.init_distributed()
    try: train(4, {**config, 'optimizer': CONFIG['optimizer']})
    finally: dist.destroy_process_group()

def test_train_with_this_launches_the_best_configuration_under_a_dashboard():
    from flexrt.widgets import AutotuneWidget
    from flexrt.widgets.autotune_view import SearchView
    view = SearchView()
    for n, (stage, mb, metric) in enumerate([(0, 2, 100.), (1, 4, 180.)]):
        view({'kind': 'experiment', 'event': 'trial', 'trial': n, 'phase': 'throughput', 'stage': stage, 'micro_batch': mb,
              'gradient_accumulation': 1, 'status': 'ok', 'metric_name': 'throughput', 'metric': metric, 'samples_per_s': metric,
              'peak_bytes_measured': 2**20, 'peak_bytes_per_rank': [2**20, 2**20], 'peak_bytes_predicted': 2**20, 'seconds': 1.0,
              'config': {'train_micro_batch_size_per_gpu': mb, 'zero_optimization': {'stage': stage}}})
    w = AutotuneWidget(view=view, train=train_with, interval=3600)
    w.refresh()
    assert not w.train_button.disabled
    w.train_button.click()
    assert w.error is None and w.training_area.children[1] is w.dashboard.widget and w.train_button.disabled
    assert w.training_run.wait(90)
    w.dashboard.refresh()
    steps = w.dashboard.records.frame('step')
    assert sorted(steps['rank'].unique()) == [0, 1] and steps['step'].max() == 4
    assert (steps['samples'] == steps['step'] * 4 * 2).all()                  # micro-batch 4 (the best) x 2 ranks
    run = w.dashboard.records.last('run')
    assert run['config.zero_optimization.stage'] == 1 and run['world_size'] == 2
    w.refresh(); assert not w.train_button.disabled                          # done: it can train again
    w.dashboard.close(); w.close()
