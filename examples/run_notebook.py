"""Execute one of the example notebooks headless (nbclient) and keep the executed copy: what `make demo` and the tests use."""
import os
from pathlib import Path
import nbformat
from nbclient import NotebookClient

EXAMPLES = Path(__file__).resolve().parent

def execute(name: str, out: Path, env: dict, timeout: int = 600, edits: dict | None = None) -> nbformat.NotebookNode:
    """Run `examples/<name>` in a fresh kernel with `env` set (the notebook reads its output folder from it); save it in
    `out`. `edits` ({old: new}) changes the code cells first: each `old` must occur exactly once (a test's smaller
    run)"""
    out.mkdir(parents=True, exist_ok=True)
    nb = nbformat.read(EXAMPLES / name, as_version=4)
    for old, new in (edits or {}).items():
        hits = [c for c in nb.cells if c.cell_type == 'code' and old in c.source]
        if len(hits) != 1 or hits[0].source.count(old) != 1:
            raise ValueError(f"{name}: {old!r} must occur once in its code cells, found {len(hits)} cell(s) with it")
        hits[0].source = hits[0].source.replace(old, new)
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)   # the kernel inherits it; put back afterwards
    client = NotebookClient(nb, timeout=timeout, kernel_name='python3', resources={'metadata': {'path': str(EXAMPLES)}},
                            store_widget_state=True)
    try: client.execute()
    finally:
        nbformat.write(nb, out / name)   # also when a cell failed: the executed copy shows where
        for k, v in before.items():
            if v is None: os.environ.pop(k, None)
            else: os.environ[k] = v
    return nb
