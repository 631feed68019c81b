"""Execute examples/autotune.ipynb headless (nbclient): the autotune widget searches the quickstart GPT on 2 CPU ranks.

Writes to $OUT (default `demo_out/`): the executed notebook `autotune.ipynb` (its widget state saved: open it in
JupyterLab to see the table and plots), the widget's plots `autotune.png`, the trials `trials.csv`, the best
configuration `ds_config_optimal.json`, and the search's own folder `autotuning_results/`.
"""
import os, sys, time
from pathlib import Path
import nbformat
from nbclient import NotebookClient

EXAMPLES = Path(__file__).resolve().parent

def run(out: Path, timeout: int = 600) -> nbformat.NotebookNode:
    "Execute the notebook in a fresh kernel and save the executed copy in `out`"
    out.mkdir(parents=True, exist_ok=True)
    os.environ['FLEXRT_AUTOTUNE_OUT'] = str(out.resolve())
    nb = nbformat.read(EXAMPLES / 'autotune.ipynb', as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name='python3', resources={'metadata': {'path': str(EXAMPLES)}},
                            store_widget_state=True)
    try: client.execute()
    finally: nbformat.write(nb, out / 'autotune.ipynb')
    return nb

if __name__ == '__main__':
    out = Path(os.environ.get('OUT', 'demo_out'))
    start = time.time()
    run(out)
    print(f'autotune example executed in {time.time() - start:.0f} s; wrote to {out}/: autotune.ipynb, autotune.png, '
          'trials.csv, ds_config_optimal.json, autotuning_results/')
