"""The autotune widget in a real browser: Voila, and JupyterLab, serve a notebook that builds an `AutotuneWidget` for
the quickstart's GPT model; Debian's Chromium (driven by Playwright, no browser download) clicks Run, sees trial rows
appear in the table while two ranks search in the background, clicks Stop, sees the button end as "Stopped" and the
rows stop growing, and saves a screenshot to $FLEXRT_ARTIFACTS (else the test's temp folder; `make screenshots` writes
them to docs/images/, where Voila's is the README's picture).

Chromium and the servers come as in tests/test_browser.py (it skips, with the reason, where they cannot)."""
from pathlib import Path
import nbformat
from test_browser import chromium, _server, _free_port, _start, _run_all_cells, _browse, _lab_server, _settled, ROOT   # chromium: the fixture

ROWS = 'tr.flexrt-trial'

SLOW_STEP = """import time
from autotune_widget_train import model_fn, train_step as quick_step, CONFIG
CONFIG = {**CONFIG, 'autotuning': {**CONFIG['autotuning'], 'fast': False}}

def train_step(engine):
    "The example's step, slowed down: the search must still run when the test clicks Stop (the example's own takes 6 s)"
    time.sleep(0.6); quick_step(engine)
"""

def _autotune_notebook(path: Path):
    (path.parent / 'slow_autotune_step.py').write_text(SLOW_STEP)
    cells = [f"import sys; sys.path[:0] = [{str(ROOT / 'examples')!r}, {str(path.parent)!r}]\n"
             "from flexrt.widgets import AutotuneWidget\nfrom slow_autotune_step import model_fn, train_step, CONFIG",
             f"w = AutotuneWidget(model_fn, train_step, CONFIG, num_processes=2, memory_budget='512MiB', interval=0.3,\n"
             f"                   results_dir={str(path.parent / 'autotuning_results')!r})\n"
             "w.controls['stages'].value, w.controls['micro_batch_range'].value = (0, 1, 2, 3), (1, 64)\n"
             "w.widget"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata['kernelspec'] = {'name': 'python3', 'display_name': 'python3', 'language': 'python'}
    nbformat.write(nb, path)

def _count(page) -> int: return page.locator(ROWS).count()

def _run_watch_and_stop(page, shots: Path, name: str, log: Path):
    "Run; rows appear while the ranks search; Stop; the button ends as Stopped and the rows stay; returns the counts"
    try: run = page.wait_for_selector('button.widget-button:has-text("Run")', timeout=120_000)
    except Exception:
        page.screenshot(path=str(shots / f'{name}_failed.png'), full_page=True)
        raise AssertionError('no autotune widget on the page; server log:\n' + log.read_text()[-3000:])
    page.wait_for_function('el => !el.disabled', arg=run, timeout=60_000)
    run.click()
    page.wait_for_selector('button.widget-button:has-text("Stop"):not([disabled])', timeout=60_000)
    page.wait_for_selector(ROWS, timeout=180_000)                       # a first trial, on screen while searching
    first = _count(page)
    page.wait_for_function(f"document.querySelectorAll({ROWS!r}).length > {first}", timeout=180_000)
    rising = _count(page)
    page.click('button.widget-button:has-text("Stop")')
    # "Stopping" lasts until the current trial ends; it can come and go between two polls, so either label will do here
    page.wait_for_selector('button.widget-button:text-matches("Stopp(ing|ed)")', timeout=30_000)
    page.wait_for_selector('button.widget-button:has-text("Stopped")', timeout=180_000)   # the ranks ended
    last = _settled(page, f"document.querySelectorAll({ROWS!r}).length")   # stopped: no more rows
    status = page.locator('b:text-is("stopped")').count()           # the status line's state
    page.screenshot(path=str(shots / f'{name}_autotune.png'), full_page=True)
    return first, rising, last, status

def _check_search_run(seen, shots: Path, name: str):
    first, rising, last, status = seen
    assert 0 < first < rising <= last and status >= 1
    assert (shots / f'{name}_autotune.png').stat().st_size > 20_000

def test_voila_autotune_widget_runs_shows_rows_live_and_stops(chromium, tmp_path):
    voila = _server('voila')
    _autotune_notebook(tmp_path / 'autotune.ipynb')
    port = _free_port()
    server = _start([voila, str(tmp_path / 'autotune.ipynb'), '--no-browser', f'--port={port}', '--Voila.ip=127.0.0.1'], tmp_path)
    seen = _browse(chromium, f'http://127.0.0.1:{port}/', lambda page: None, 'voila', server, port, tmp_path,
                   watch=_run_watch_and_stop, viewport=(1200, 1500))
    _check_search_run(*seen, 'voila')

def test_jupyterlab_autotune_widget_runs_shows_rows_live_and_stops(chromium, tmp_path):
    _autotune_notebook(tmp_path / 'autotune.ipynb')
    server, port = _lab_server(tmp_path)
    seen = _browse(chromium, f'http://127.0.0.1:{port}/lab/tree/autotune.ipynb', _run_all_cells, 'jupyterlab', server, port,
                   tmp_path, watch=_run_watch_and_stop, viewport=(1200, 1500))
    _check_search_run(*seen, 'jupyterlab')
