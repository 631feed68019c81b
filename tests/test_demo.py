"`make demo`'s job, shortened: 2 ranks launched through accelerate.notebook_launcher train and write their report."
import os, subprocess, sys
from pathlib import Path
import pandas as pd

ROOT = Path(__file__).resolve().parent.parent

def test_demo_runs_on_two_ranks(tmp_path):
    env = dict(os.environ, STEPS='30', OUT=str(tmp_path))
    r = subprocess.run([sys.executable, str(ROOT / 'examples' / 'demo.py')], env=env, capture_output=True, text=True,
                       timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert '2 ranks' in r.stdout and 'all_reduce' in r.stdout      # the report and the comm log were printed
    steps, memory = pd.read_csv(tmp_path / 'steps.csv'), pd.read_csv(tmp_path / 'memory.csv')
    assert len(steps) == 30 and steps.grad_norm.notna().all() and (steps.grad_norm > 0).all()
    assert sorted(memory['rank'].unique()) == [0, 1] and memory.tracked.all() and memory.allocated_bytes.max() > 0
