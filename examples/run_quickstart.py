"""`make demo`: execute examples/quickstart.ipynb headless (2 CPU ranks, the engine, the dashboard) with nbclient.

Writes to $OUT (default `demo_out/`): the executed notebook `quickstart.ipynb` (open it in JupyterLab to see the
dashboard's final state), the dashboard's plots `grad_norm.png` and `memory.png`, and its history `history.csv`.
STEPS sets the number of optimizer steps (default 30).
"""
import os, sys, time
from pathlib import Path
import nbformat
from nbclient import NotebookClient

EXAMPLES = Path(__file__).resolve().parent

def run(out: Path, steps: int, timeout: int = 600) -> nbformat.NotebookNode:
    "Execute the quickstart in a fresh kernel and save the executed copy in `out`"
    out.mkdir(parents=True, exist_ok=True)
    os.environ.update(FLEXRT_QUICKSTART_OUT=str(out.resolve()), STEPS=str(steps))
    nb = nbformat.read(EXAMPLES / 'quickstart.ipynb', as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name='python3', resources={'metadata': {'path': str(EXAMPLES)}},
                            store_widget_state=True)
    try: client.execute()
    finally: nbformat.write(nb, out / 'quickstart.ipynb')
    return nb

if __name__ == '__main__':
    out, steps = Path(os.environ.get('OUT', 'demo_out')), int(os.environ.get('STEPS', 30))
    start = time.time()
    run(out, steps)
    print(f'quickstart executed in {time.time() - start:.0f} s ({steps} steps on 2 ranks); wrote to {out}/:')
    for f in sorted(out.iterdir()): print(f'  {f.name:20s} {f.stat().st_size:>9,d} bytes')
    print('open it live: .venv/bin/jupyter lab examples/quickstart.ipynb')
