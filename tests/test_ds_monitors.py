"""The config's `tensorboard`, `csv_monitor` and `wandb` blocks: on 2 gloo ranks the files appear in DeepSpeed's layout
(`output_path/job_name/`), written by rank 0 only, holding the losses and learning rates the training script saw; the
same training under DeepSpeed 0.19.8 writes the same tags, steps and values (flexrt adds `Train/Samples/train_loss`,
which DeepSpeed's plain engine no longer writes). A block whose package is missing stops every rank with an error
naming the package; wandb (a dev requirement) in offline mode keeps its run on disk, read back here record by record."""
import csv, glob, importlib.util, math, os
import pytest, torch, torch.nn.functional as F
from helpers import run_distributed

STEPS, GAS, MICRO, WORLD = 3, 2, 2, 2
SAMPLES = [MICRO * GAS * WORLD * (s + 1) for s in range(STEPS)]   # the x-axis: global samples after each step

def config(out, **extra):
    return {'train_micro_batch_size_per_gpu': MICRO, 'gradient_accumulation_steps': GAS, 'steps_per_print': 1000,
            'optimizer': {'type': 'AdamW', 'params': {'lr': 1e-2, 'torch_adam': True}},
            'scheduler': {'type': 'WarmupLR', 'params': {'warmup_min_lr': 0, 'warmup_max_lr': 1e-2, 'warmup_num_steps': 3}},
            'tensorboard': {'enabled': True, 'output_path': str(out), 'job_name': 'tb'},
            'csv_monitor': {'enabled': True, 'output_path': str(out), 'job_name': 'csv'}, **extra}

def train(rank, world, out, impl, extra=None):
    "Train a tiny model; this rank's losses per micro-step, lr after each optimizer step, loss scale, whether it has sinks"
    if impl == 'deepspeed':
        from real_deepspeed import import_deepspeed   # quiet, no shared-memory comm op (see there)
        deepspeed = import_deepspeed()
    elif impl == 'dropin':
        import flexrt.deepspeed
        flexrt.deepspeed.use_as_deepspeed()
        import deepspeed
    else: import flexrt as deepspeed
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    cfg = config(out, **(extra or {}))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    half = cfg.get('fp16', {}).get('enabled', False)
    losses, lrs, scales = [], [], []
    for i in range(STEPS * GAS):
        g = torch.Generator().manual_seed(100 * i + rank)
        x, y = torch.randn(MICRO, 4, generator=g), torch.randn(MICRO, 2, generator=g)
        loss = F.mse_loss(engine(x.half() if half else x).float(), y)
        engine.backward(loss); engine.step()
        losses.append(loss.item())
        if (i + 1) % GAS == 0:
            lrs.append(engine.get_lr()[0])
            if impl != 'deepspeed': scales.append(engine.precision.loss_scale)
    engine.monitor.write_events([('Train/Samples/custom', 0.25 + rank, engine.global_samples)])   # a script's own event
    writes = (bool(engine.monitor), engine.monitor.enabled) if impl != 'deepspeed' else None
    if impl != 'deepspeed': engine.close()
    return losses, lrs, scales, writes

def read_csvs(folder)->dict:
    "{file name: rows} of a csv_monitor folder"
    out = {}
    for path in sorted(glob.glob(os.path.join(folder, '*.csv'))):
        with open(path, newline='') as f: out[os.path.basename(path)] = list(csv.reader(f))
    return out

def read_tensorboard(folder)->dict:
    "{tag: [(step, value)]} of the event files in `folder`"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(folder); acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()['scalars']}

def step_means(losses): return [sum(losses[s * GAS:(s + 1) * GAS]) / GAS for s in range(STEPS)]

@pytest.mark.parametrize('impl', ['flexrt', 'dropin'])
def test_rank0_writes_deepspeeds_layout_with_the_observed_values(tmp_path, impl):
    if impl == 'dropin' and importlib.util.find_spec('deepspeed') is not None:
        import sys
        if 'deepspeed' in sys.modules: pytest.skip('the real deepspeed is imported in this process')
    results = run_distributed(train, WORLD, args=(tmp_path, impl), timeout=180)
    assert [r[3] for r in results] == [(True, True), (False, True)]     # sinks on rank 0 only; enabled on both
    assert sorted(os.listdir(tmp_path)) == ['csv', 'tb']
    assert len(os.listdir(tmp_path / 'tb')) == 1                        # one event file: rank 1 opened no writer
    losses, lrs = results[0][0], results[0][1]
    files = read_csvs(tmp_path / 'csv')
    assert sorted(files) == ['Train_Samples_custom.csv', 'Train_Samples_lr.csv', 'Train_Samples_train_loss.csv']   # fp32: no loss scale
    assert files['Train_Samples_custom.csv'] == [['step', 'custom'], [str(SAMPLES[-1]), '0.25']]       # rank 0's own event only
    assert files['Train_Samples_lr.csv'] == [['step', 'lr'], *[[str(s), repr(lr)] for s, lr in zip(SAMPLES, lrs)]]
    assert files['Train_Samples_train_loss.csv'][0] == ['step', 'train_loss']
    assert [int(s) for s, _ in files['Train_Samples_train_loss.csv'][1:]] == SAMPLES
    torch.testing.assert_close([float(v) for _, v in files['Train_Samples_train_loss.csv'][1:]], step_means(losses), rtol=1e-6, atol=0)
    assert (tmp_path / 'csv' / 'Train_Samples_lr.csv').read_bytes().startswith(b'step,lr\r\n')
    tb = read_tensorboard(str(tmp_path / 'tb'))
    assert sorted(tb) == ['Train/Samples/custom', 'Train/Samples/lr', 'Train/Samples/train_loss']
    assert [s for s, _ in tb['Train/Samples/lr']] == SAMPLES
    torch.testing.assert_close([v for _, v in tb['Train/Samples/lr']], lrs, rtol=1e-6, atol=1e-9)           # stored as float32
    torch.testing.assert_close([v for _, v in tb['Train/Samples/train_loss']], step_means(losses), rtol=1e-6, atol=0)
    assert len(set(lrs)) == 3                                           # the warmup moved the rate: a real check

def test_fp16_writes_the_loss_scale_and_wall_clock_breakdown_the_phase_times(tmp_path):
    extra = {'fp16': {'enabled': True, 'initial_scale_power': 4}, 'wall_clock_breakdown': True}
    (losses, lrs, scales, writes), _ = run_distributed(train, WORLD, args=(tmp_path, 'flexrt', extra), timeout=180)
    files = read_csvs(tmp_path / 'csv')
    assert files['Train_Samples_loss_scale.csv'] == [['step', 'loss_scale'], *[[str(s), repr(x)] for s, x in zip(SAMPLES, scales)]]
    assert scales[0] == 16.0
    phases = [f'Train_Samples_elapsed_time_ms_{p}.csv' for p in ('forward', 'backward', 'backward_allreduce', 'step')]
    assert set(phases) <= set(files)
    for name in phases:
        assert [int(r[0]) for r in files[name][1:]] == SAMPLES and all(float(r[1]) >= 0 for r in files[name][1:])
    assert 'Train/Samples/loss_scale' in read_tensorboard(str(tmp_path / 'tb'))

def test_same_tags_steps_and_values_as_deepspeed(tmp_path):
    if importlib.util.find_spec('deepspeed') is None:   # not imported here: other tests put flexrt in its place in this process
        pytest.skip('DeepSpeed is a dev requirement: pip install -e ".[dev]"')
    env = {'DS_ACCELERATOR': 'cpu'}
    ds = run_distributed(train, WORLD, args=(tmp_path / 'ds', 'deepspeed'), timeout=300, env=env)
    fx = run_distributed(train, WORLD, args=(tmp_path / 'fx', 'flexrt'), timeout=180)
    torch.testing.assert_close(fx[0][0], ds[0][0], rtol=1e-5, atol=1e-6)     # the same training
    assert fx[0][1] == ds[0][1]                                              # the same learning rates
    ds_files, fx_files = read_csvs(tmp_path / 'ds' / 'csv'), read_csvs(tmp_path / 'fx' / 'csv')
    assert ds_files and set(ds_files) <= set(fx_files)                       # every file DeepSpeed writes, flexrt writes
    assert set(fx_files) - set(ds_files) == {'Train_Samples_train_loss.csv'}   # and one more: the loss curve
    for name in ds_files: assert fx_files[name] == ds_files[name], name      # byte-for-byte the same rows
    assert (tmp_path / 'fx' / 'csv' / 'Train_Samples_lr.csv').read_bytes() == (tmp_path / 'ds' / 'csv' / 'Train_Samples_lr.csv').read_bytes()
    ds_tb, fx_tb = read_tensorboard(str(tmp_path / 'ds' / 'tb')), read_tensorboard(str(tmp_path / 'fx' / 'tb'))
    assert set(ds_tb) == {'Train/Samples/lr', 'Train/Samples/custom'} and set(ds_tb) <= set(fx_tb)
    for tag in ds_tb: assert fx_tb[tag] == ds_tb[tag], tag
    assert [len(os.listdir(tmp_path / impl / 'tb')) for impl in ('ds', 'fx')] == [1, 1]

def _missing_package(rank, world, out, package, block):
    import sys
    sys.modules[package] = None              # importlib.util.find_spec now answers None: as if not installed
    import flexrt
    model = torch.nn.Linear(2, 1)
    flexrt.initialize(model=model, config={'train_batch_size': 2, 'optimizer': {'type': 'SGD', 'params': {'lr': 0.1}},
                                           block: {'enabled': True, 'output_path': str(out)} if block != 'wandb' else {'enabled': True}})

@pytest.mark.parametrize('package', ['tensorboard', 'wandb'])
def test_missing_package_stops_every_rank_naming_it(tmp_path, package):
    with pytest.raises(RuntimeError) as e: run_distributed(_missing_package, WORLD, args=(tmp_path, package, package), timeout=120)
    text = str(e.value)
    assert 'failure on ranks 0, 1' in text                               # no rank is left waiting in a collective
    assert text.count(f'ImportError: the "{package}" config block is enabled but the {package} package is not installed: pip install {package}') == 2
    assert not os.listdir(tmp_path)                                      # nothing was written

def _wandb_run(rank, world, out):
    os.environ.update(WANDB_MODE='offline', WANDB_DIR=str(out), WANDB_SILENT='true')
    return train(rank, world, out / 'files', 'flexrt', {'wandb': {'enabled': True, 'project': 'flexrt-test', 'group': 'g'}})

def wandb_records(path)->list:
    "The protobuf Records of an offline run's `.wandb` file (leveldb-log chunks), as wandb wrote them"
    import struct
    from wandb.proto import wandb_internal_pb2 as pb
    data, pos, pending, records = open(path, 'rb').read(), 7, b'', []   # 7: the file's ':W&B' header
    assert data[:4] == b':W&B', data[:7]
    while pos + 7 <= len(data):
        space = 32768 - pos % 32768                                  # chunks never cross a 32 KiB block
        if space < 7: pos += space; continue
        length, kind = struct.unpack('<HB', data[pos + 4:pos + 7])
        pending, pos = pending + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):                                           # a full record, or the last chunk of one
            record = pb.Record(); record.ParseFromString(pending); pending = b''
            records.append(record)
    return records

def wandb_history(records)->list:
    "[(step, {key: value})] of the history records (wandb's own `_step`, `_runtime`, ... left out)"
    import json
    rows = []
    for record in records:
        if record.WhichOneof('record_type') != 'history': continue
        items = {i.key or '/'.join(i.nested_key): json.loads(i.value_json) for i in record.history.item}   # 'a/b' is stored nested
        rows.append((record.history.step.num, {k: v for k, v in items.items() if not k.startswith('_')}))
    return rows

def test_wandb_offline_run_on_rank0(tmp_path):
    "The block's settings name the run; each step's loss and learning rate are logged at its step (samples seen)"
    results = run_distributed(_wandb_run, WORLD, args=(tmp_path,), timeout=240)
    runs = glob.glob(str(tmp_path / 'wandb' / 'offline-run-*' / 'run-*.wandb'))
    assert len(runs) == 1                                                # rank 0 only
    records = wandb_records(runs[0])
    run, = [r.run for r in records if r.WhichOneof('record_type') == 'run']
    assert (run.project, run.run_group) == ('flexrt-test', 'g')
    assert records[-1].WhichOneof('record_type') == 'exit'              # engine.close() finished the run
    losses, lrs = results[0][0], results[0][1]
    history = wandb_history(records)
    assert [step for step, _ in history] == SAMPLES
    assert [sorted(row) for _, row in history] == [['Train/Samples/lr', 'Train/Samples/train_loss']] * (STEPS - 1) + [
        ['Train/Samples/custom', 'Train/Samples/lr', 'Train/Samples/train_loss']]   # the script's own event: at its step
    assert [row['Train/Samples/lr'] for _, row in history] == lrs and len(set(lrs)) == 3
    torch.testing.assert_close([row['Train/Samples/train_loss'] for _, row in history], step_means(losses), rtol=1e-6, atol=0)
    assert history[-1][1]['Train/Samples/custom'] == 0.25                # rank 0's (rank 1 would have written 1.25)

def _trial_and_run(rank, world, out):
    "An autotuner trial with the user's monitor blocks, then the run itself"
    import flexrt
    from flexrt.autotuner.measure import run_trial
    model = lambda: torch.nn.Linear(4, 1)
    def step(engine): engine.backward(engine(torch.randn(2, 4)).pow(2).mean()); engine.step()
    cfg = {'train_micro_batch_size_per_gpu': 2, 'optimizer': {'type': 'SGD', 'params': {'lr': 0.1}}, 'steps_per_print': 10**9,
           'csv_monitor': {'enabled': True, 'output_path': str(out), 'job_name': 'run'},
           'tensorboard': {'enabled': True, 'output_path': str(out), 'job_name': 'run_tb'}}
    status = run_trial(model, step, cfg, warmup_steps=1, profile_steps=1).status
    after_trial = sorted(os.listdir(out))
    engine, *_ = flexrt.initialize(model=model(), config=cfg)
    step(engine); engine.close()
    return status, after_trial, sorted(os.listdir(out / 'run'))

def test_autotuner_trials_write_no_run_logs(tmp_path):
    (status, after_trial, files), = run_distributed(_trial_and_run, 1, args=(tmp_path,), timeout=120)
    assert status == 'ok' and after_trial == []                          # the trial engines wrote nothing
    assert files == ['Train_Samples_lr.csv', 'Train_Samples_train_loss.csv']   # the run itself does
