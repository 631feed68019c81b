"""Execute one of the example notebooks headless (nbclient) and keep the executed copy: what `make demo` and the tests use."""
import os
from pathlib import Path
import nbformat
from nbclient import NotebookClient

EXAMPLES = Path(__file__).resolve().parent

def execute(name: str, out: Path, env: dict, timeout: int = 600) -> nbformat.NotebookNode:
    "Run `examples/<name>` in a fresh kernel with `env` set (the notebook reads its output folder from it); save it in `out`"
    out.mkdir(parents=True, exist_ok=True)
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)   # the kernel inherits it; put back afterwards
    nb = nbformat.read(EXAMPLES / name, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name='python3', resources={'metadata': {'path': str(EXAMPLES)}},
                            store_widget_state=True)
    try: client.execute()
    finally:
        nbformat.write(nb, out / name)   # also when a cell failed: the executed copy shows where
        for k, v in before.items():
            if v is None: os.environ.pop(k, None)
            else: os.environ[k] = v
    return nb
