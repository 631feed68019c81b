"""`flexrt autotune` (python -m flexrt.autotuner) on sample scripts, in both modes, 2 local ranks, a few trials."""
import json, os, shutil, subprocess, sys
from pathlib import Path
import pytest
from flexrt.autotuner.results import AutotuneResult
from helpers import TORCH_EXIT_ABORT

DATA = Path(__file__).parent / 'data'
CONFIG = {'optimizer': {'type': 'Adam', 'params': {'lr': 1e-3}},
          'autotuning': {'max_train_micro_batch_size_per_gpu': 8, 'start_profile_step': 1, 'end_profile_step': 2,
                         'max_profile_steps': 3}}   # 3 timed steps a trial at most: these tests check the modes

def run_cli(tmp_path, script, *extra):
    cfg = tmp_path / 'ds.json'
    cfg.write_text(json.dumps(CONFIG))
    env = {**os.environ, 'PYTHONPATH': os.pathsep.join([str(Path(__file__).parent.parent), os.environ.get('PYTHONPATH', '')])}
    cmd = [sys.executable, '-m', 'flexrt.autotuner', 'autotune', str(DATA / script), '--config', str(cfg), '--nproc', '2',
           '--results-dir', str(tmp_path / 'results'), *extra]
    for attempt in range(2):   # once more, from an empty results folder, when torch aborted a rank at exit (helpers.py)
        shutil.rmtree(tmp_path / 'results', ignore_errors=True)
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
        if done.returncode == 0 or TORCH_EXIT_ABORT not in done.stdout + done.stderr: break
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout, AutotuneResult.load(str(tmp_path / 'results'))

def test_in_process_mode_one_launch(tmp_path):
    out, result = run_cli(tmp_path, 'autotune_inprocess.py', '--max-trials', '3')
    assert 'mode: in-process' in out and result.mode == 'in-process'
    searched = result.trials[(result.trials.status != 'pruned') & (result.trials.phase != 'playoff')]
    assert len(searched) == 3 and result.best['status'] == 'ok'   # 3 runs, then the playoff decides among them
    assert result.margin['rounds'] >= 5 and (result.trials.phase == 'playoff').sum() >= 5 * 2 and 'playoff' in out
    assert json.loads((tmp_path / 'results' / 'ds_config_optimal.json').read_text()) == result.best_config
    assert not (tmp_path / 'results' / 'launches').exists()

def test_launch_per_experiment_mode(tmp_path):
    out, result = run_cli(tmp_path, 'autotune_deepspeed.py', '--max-trials', '1', '--', '--steps', '6')
    assert 'mode: launch-per-experiment' in out and 'defines no model_fn and train_step' in out
    assert result.best['status'] == 'ok' and result.best['metric'] > 0 and len(result.best['peak_bytes_per_rank']) == 2
    launches = sorted((tmp_path / 'results' / 'launches').iterdir())
    assert len(launches) == 1 and result.margin['rounds'] == 0   # the one experiment (one torchrun): nothing to play off
    assert json.loads((launches[0] / 'ds_config.json').read_text())['train_batch_size'] == 2 * result.trials.micro_batch[0]
