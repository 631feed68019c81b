"""Issue 36's step anatomy on real gloo ranks: each plant (a sleep in one rank's data loading, extra matmuls in one
rank's backward, more compute threads than cores, stage 3 with a tiny prefetch bucket) is named by the findings, on
the right rank and phase, from the step records the engine emits; and the phases add up to the step's wall time as
the training loop itself measures it. No timed assertions: the plants are large, and what is checked is which rank
and which phase the records and rules name."""
import json, os, subprocess, sys, time
from pathlib import Path
import pytest
import torch
from torch import nn
from helpers import run_distributed
from test_browser import chromium  # noqa: F401  (the fixture: Debian's Chromium, or a skip with the reason)
from flexrt import monitor
from flexrt.monitor.anatomy import ANATOMY_PHASES, anatomy, anatomy_frame

CONFIG = {
    'train_micro_batch_size_per_gpu': 4,
    'steps_per_print': 1000,
    'optimizer': {'type': 'SGD', 'params': {'lr': 0.01}},
}
SLEEP = 0.2  # seconds a planted rank sleeps or computes more per step: far above what a loaded machine adds


def mlp(width=32, depth=3):
    torch.manual_seed(0)
    layers = [nn.Linear(8, width), nn.Tanh()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def slow_backward(grad):
    "A hook adding compute to backward: matmuls until SLEEP seconds of this rank's own work have passed"
    a, start = torch.randn(128, 128), time.perf_counter()
    while time.perf_counter() - start < SLEEP:
        a = torch.tanh(a @ a)
    return grad


def train(rank, world_size, steps, config, sleep_rank=None, slow_rank=None, threads=None, width=32, depth=3,
          jsonl=None):
    """Train on every rank while listening (and writing a JSONL file per rank if `jsonl`, with '{rank}'); return this
    rank's step records and the loop's own times after each step() (the wall clock the phases must add up to)"""
    import flexrt
    records, ends = [], []
    sink = monitor.JSONLSink(jsonl) if jsonl else None
    if sink:
        monitor.add_listener(sink)
    with monitor.listen(records.append):  # listened to from the start: the engine records the anatomy
        net = mlp(width, depth)
        engine, *_ = flexrt.initialize(model=net, model_parameters=net.parameters(), config=config)
        if threads:
            torch.set_num_threads(threads)
        if rank == slow_rank:
            net[0].weight.register_hook(slow_backward)
        torch.manual_seed(rank)
        try:
            for _ in range(steps):
                if rank == sleep_rank:
                    time.sleep(SLEEP)  # the data loader of this rank is slow
                x = torch.randn(4, 8)
                engine.backward(engine(x).square().mean())
                engine.step()
                ends.append(time.perf_counter())
        finally:
            engine.close()
    if sink:
        monitor.remove_listener(sink)
        sink.close()
    return [r for r in records if r['kind'] == 'step'], ends


def run(steps, config, **kwargs):
    "Every rank's step records, in one list, and each rank's loop times"
    results = run_distributed(train, 2, args=(steps, config), kwargs=kwargs, timeout=120)
    return [r for records, _ in results for r in records], [ends for _, ends in results]


def rules(report, rule):
    return [f for f in report.findings if f.rule == rule]


def test_a_sleep_in_one_ranks_data_loading_is_named_data_wait_on_that_rank():
    records, _ = run(8, CONFIG, sleep_rank=1)
    report = anatomy(records, show=False)
    (found,) = rules(report, 'data_wait')
    assert (found.rank, found.phase) == (1, 'data_wait') and found.message.startswith('data wait ')
    assert found.message.endswith(' on rank 1') and found.value > 0.5
    table = report.table
    assert table.loc[0, 'comm'] > table.loc[1, 'comm']  # rank 0 waits for rank 1 in the reduction
    assert rules(report, 'straggler') == []  # not a compute straggler


@pytest.fixture(scope='module')
def slowed_backward():
    "Every rank's step records of 8 steps with rank 1's backward slowed by extra matmuls in a hook"
    return run(8, CONFIG, slow_rank=1)[0]


def test_a_slowed_backward_on_one_rank_is_named_compute_while_the_other_waits_in_communication(slowed_backward):
    report = anatomy(slowed_backward, show=False)
    (found,) = rules(report, 'straggler')
    assert (found.rank, found.phase) == (1, 'backward') and '(compute, not communication)' in found.message
    assert found.message.startswith("rank 1's backward is ") and found.value > 3
    table = report.table
    assert table.loc[0, 'comm'] > table.loc[0, 'backward']  # rank 0's time is blocked communication
    assert table.loc[0, 'comm'] > 5 * table.loc[1, 'comm']  # rank 1 hardly waits
    assert rules(report, 'data_wait') == []


def test_the_dashboard_names_the_slowed_rank_on_the_page_a_browser_shows(slowed_backward, chromium, tmp_path):
    """The dashboard's saved page, opened in Chromium: the step anatomy's findings line names rank 1's backward in
    words, above its table and plot; the picture is saved ($FLEXRT_ARTIFACTS/step_anatomy.png with `make screenshots`:
    the README's figure)"""
    from playwright.sync_api import sync_playwright
    from flexrt.widgets.dashboard import TrainingDashboard

    dash = TrainingDashboard(redraw=False)
    try:
        for record in slowed_backward:
            dash.records(record)
        page_file = dash.save_html(tmp_path / 'run.html')
    finally:
        dash.close()
    shots = Path(os.environ.get('FLEXRT_ARTIFACTS', tmp_path))
    shots.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium)
        try:
            page = browser.new_page(viewport={'width': 1150, 'height': 900})
            page.goto(Path(page_file).as_uri())
            sections = page.locator('section', has=page.locator('h2', has_text='Step anatomy'))
            found = sections.locator('.flexrt-findings')
            assert found.is_visible() and found.inner_text().startswith("rank 1's backward is "), found.inner_text()
            assert '(compute, not communication)' in found.inner_text()
            plot = page.locator('section', has=page.locator('h2', has_text='Plot: anatomy')).locator('img')
            assert plot.is_visible() and plot.evaluate('img => img.naturalWidth') > 0   # the figure decoded
            # the picture: the two sections of the step anatomy, the ones between them hidden
            page.evaluate('''() => { for (const s of document.querySelectorAll('section')) {
                const h = s.querySelector('h2').textContent;
                if (h !== 'Step anatomy' && h !== 'Plot: anatomy') s.style.display = 'none'; } }''')
            top, bottom = sections.bounding_box(), plot.bounding_box()
            clip = {'x': 0, 'y': top['y'] - 8, 'width': 1150, 'height': bottom['y'] + bottom['height'] - top['y'] + 16}
            page.screenshot(path=str(shots / 'step_anatomy.png'), clip=clip, full_page=True)
        finally:
            browser.close()


def test_more_compute_threads_than_cores_on_every_rank_is_named_oversubscribed():
    cores = len(os.sched_getaffinity(0))
    records, _ = run(4, CONFIG, threads=cores)
    (found,) = rules(anatomy(records, show=False), 'oversubscribed')
    plural = 's' if cores > 1 else ''
    assert found.message == f'2 ranks × {cores} compute thread{plural} on {cores} core{plural}: oversubscribed'
    sized, _ = run(3, CONFIG)  # the helper's ranks run one thread each: 2 on 2 cores or more is not
    assert cores < 2 or rules(anatomy(sized, show=False), 'oversubscribed') == []


def test_stage_3_with_a_tiny_prefetch_bucket_names_the_gather_wait():
    config = {**CONFIG, 'zero_optimization': {'stage': 3, 'stage3_prefetch_bucket_size': 1,
                                              'stage3_param_persistence_threshold': 0}}
    records, _ = run(6, config, width=256, depth=8)
    report = anatomy(records, show=False)
    (found,) = rules(report, 'gather_wait')
    assert found.message.startswith('stage 3: ') and 'of the step waits on parameter gathers' in found.message
    assert 'prefetch bucket 1e0 is smaller than one layer (6.6e4 elements)' in found.message
    table = report.table
    assert (table['comm_gather'] > table['comm_reduce']).all() and (table['zero_stage'] == 3).all()


@pytest.mark.parametrize('stage', [0, 2])
def test_phases_add_up_to_the_steps_wall_time_as_the_loop_measures_it(stage):
    config = {**CONFIG, 'zero_optimization': {'stage': stage}}
    records, ends = run(6, config, sleep_rank=0)
    frame = anatomy_frame(records)
    assert len(frame) == 12 and set(frame['rank']) == {0, 1}
    for rank in (0, 1):
        mine = frame[frame['rank'] == rank].sort_values('step')
        summed = mine[list(ANATOMY_PHASES)].sum(axis=1)
        assert (abs(summed - mine['wall']) < 1e-9).all()  # the record's phases make its wall time
        loop = ends[rank][-1] - ends[rank][0]  # steps 2..6 as the training loop timed them
        recorded = summed.iloc[1:].sum()
        assert abs(recorded - loop) <= 0.02 * loop, (recorded, loop)
        assert (mine[['data_wait', 'forward', 'backward', 'optimizer']] >= 0).all().all()
        assert mine['threads'].iloc[-1] == torch.get_num_threads() or mine['threads'].iloc[-1] >= 1


def test_the_script_path_reads_the_ranks_jsonl_files_and_prints_the_table_and_findings(tmp_path, capsys):
    import flexrt
    run(5, CONFIG, sleep_rank=0, jsonl=str(tmp_path / 'steps{rank}.jsonl'))
    report = flexrt.anatomy(sorted(str(p) for p in tmp_path.glob('steps*.jsonl')))
    printed = capsys.readouterr().out
    assert printed.startswith('step anatomy, mean of the latest 20 steps') and '- data wait ' in printed
    assert printed.rstrip().endswith(' on rank 0') and list(report.table.index) == [0, 1]
    assert [f.rule for f in report.findings] == ['data_wait']
    # the same files from a shell: `python -m flexrt.monitor.anatomy`, its options, its errors
    paths = sorted(str(p) for p in tmp_path.glob('steps*.jsonl'))
    shell = lambda *args: subprocess.run([sys.executable, '-m', 'flexrt.monitor.anatomy', *args], capture_output=True,
                                         text=True, timeout=120)
    done = shell(*paths)
    assert (done.returncode, done.stdout, done.stderr) == (0, printed, '')   # what flexrt.anatomy(paths) printed
    done = shell(*paths, '--window', '3', '--rank', '0')
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and lines[0].startswith('step anatomy, mean of the latest 3 steps'), done
    assert [line.split()[0] for line in lines[2:] if not line.startswith('-')] == ['0']   # rank 0's row alone
    assert lines[-1].startswith('- data wait ') and lines[-1].endswith(' on rank 0')
    done = shell(str(tmp_path / 'steps5.jsonl'))
    assert done.returncode == 2 and done.stdout == ''
    assert 'no such file: ' in done.stderr and 'steps5.jsonl' in done.stderr
    via = subprocess.run([sys.executable, '-m', 'flexrt.autotuner', 'anatomy', str(tmp_path / 'steps5.jsonl')],
                         capture_output=True, text=True, timeout=120)   # `flexrt anatomy` as a module: the same status
    assert via.returncode == 2 and 'no such file: ' in via.stderr, via
    (tmp_path / 'other.jsonl').write_text(json.dumps({'kind': 'memory', 'rank': 0}) + '\n')
    done = shell(str(tmp_path / 'other.jsonl'))
    assert done.returncode == 1 and "hold no step record with an anatomy (records: 1 'memory')" in done.stderr, done


def anatomy_settings(rank, world_size, blocks):
    """For each `diagnostics.anatomy` block: this rank's engine.anatomy (on, cuda_every), and whether the step record
    of a watched step carried an anatomy"""
    import flexrt
    out = []
    for block in blocks:
        records = []
        with monitor.listen(records.append):  # watched: without the block, the anatomy would be on
            net = mlp()
            config = {**CONFIG, 'diagnostics': {'anatomy': block}}
            engine, *_ = flexrt.initialize(model=net, model_parameters=net.parameters(), config=config)
            engine.backward(engine(torch.randn(4, 8)).square().mean())
            engine.step()
            settings = (engine.anatomy.on, engine.anatomy.cuda_every)
            engine.close()
        out.append((settings, ['anatomy' in r for r in records if r['kind'] == 'step']))
    return out


def test_the_configs_anatomy_block_reaches_each_ranks_engine():
    blocks = [{'enabled': True, 'cuda_every': 7}, {'enabled': False}]
    for settings in run_distributed(anatomy_settings, 2, args=(blocks,), timeout=120):
        assert settings == [((True, 7), [True]), ((False, 0), [False])], settings
