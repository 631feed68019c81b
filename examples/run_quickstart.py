"""`make demo`: execute examples/quickstart.ipynb headless (2 CPU ranks, the engine, the dashboard) with nbclient.

Writes to $OUT (default `demo_out/`): the executed notebook `quickstart.ipynb` (open it in JupyterLab to see the
dashboard's final state), the dashboard's plots `grad_norm.png` and `memory.png`, its step history `history.csv`, a
CSV per other kind of record (`memory.csv`, `comm.csv`, ...) and the run's config and versions `run.json`.
STEPS sets the number of optimizer steps (default 30).
"""
import os, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_notebook import execute

def run(out: Path, steps: int, timeout: int = 600):
    "Execute the quickstart in a fresh kernel and save the executed copy in `out`"
    return execute('quickstart.ipynb', out, {'FLEXRT_QUICKSTART_OUT': str(out.resolve()), 'STEPS': str(steps)}, timeout)

if __name__ == '__main__':
    out, steps = Path(os.environ.get('OUT', 'demo_out')), int(os.environ.get('STEPS', 30))
    start = time.time()
    run(out, steps)
    print(f'quickstart executed in {time.time() - start:.0f} s ({steps} steps on 2 ranks); wrote to {out}/:')
    for f in sorted(out.iterdir()): print(f'  {f.name:20s} {f.stat().st_size:>9,d} bytes')
    print('open it live: .venv/bin/jupyter lab examples/quickstart.ipynb')
