"`make demo`'s job, shortened: 2 ranks launched through accelerate.notebook_launcher train with the engine and report."
import os, subprocess, sys
from pathlib import Path
import pandas as pd

ROOT = Path(__file__).resolve().parent.parent

def test_demo_runs_on_two_ranks(tmp_path):
    env = dict(os.environ, STEPS='20', OUT=str(tmp_path))
    r = subprocess.run([sys.executable, str(ROOT / 'examples' / 'demo.py')], env=env, capture_output=True, text=True,
                       timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert '2 ranks' in r.stdout and 'all_reduce' in r.stdout      # the report and the comm log were printed
    steps, memory = pd.read_csv(tmp_path / 'steps.csv'), pd.read_csv(tmp_path / 'memory.csv')
    for rank in (0, 1):                                             # every rank emitted one event per optimizer step
        mine = steps[steps['rank'] == rank]
        assert list(mine.step) == list(range(1, 21)) and (mine.grad_norm > 0).all()
        assert (mine.grad_norm_post_clip <= 1.0 + 1e-6).all() and (mine.tensor_bytes > 0).all()
    # data parallel: after each step both ranks hold the same averaged gradient, hence the same global norm
    assert (steps[steps['rank'] == 0].grad_norm.values == steps[steps['rank'] == 1].grad_norm.values).all()
    assert sorted(memory['rank'].unique()) == [0, 1] and memory.tracked.all() and memory.allocated_bytes.max() > 0
