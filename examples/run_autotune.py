"""Execute examples/autotune.ipynb headless (nbclient): the autotune widget searches the quickstart GPT on 2 CPU ranks.

Writes to $OUT (default `demo_out/`): the executed notebook `autotune.ipynb` (its widget state saved: open it in
JupyterLab to see the table and plots), the widget's plots `autotune.png`, the trials `trials.csv`, the best
configuration `ds_config_optimal.json`, and the search's own folder `autotuning_results/`.
"""
import os, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_notebook import execute

def run(out: Path, timeout: int = 600, edits: dict | None = None):
    "Execute the notebook in a fresh kernel and save the executed copy in `out` (`edits`: see `run_notebook.execute`)"
    return execute('autotune.ipynb', out, {'FLEXRT_AUTOTUNE_OUT': str(out.resolve())}, timeout, edits)

if __name__ == '__main__':
    out = Path(os.environ.get('OUT', 'demo_out'))
    start = time.time()
    run(out)
    print(f'autotune example executed in {time.time() - start:.0f} s; wrote to {out}/: autotune.ipynb, autotune.png, '
          'trials.csv, ds_config_optimal.json, autotuning_results/')
