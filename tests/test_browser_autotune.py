"""The autotune widget in a real browser: Voila, and JupyterLab, serve a notebook that builds an `AutotuneWidget` for
the quickstart's GPT model; Debian's Chromium (driven by Playwright, no browser download) clicks Run, sees trial rows
appear in the table while two ranks search in the background, clicks Stop, sees the button end as "Stopped" and the
rows stop growing, and saves a screenshot: Voila's is `docs/images/autotune_widget.png` (the README's picture),
both go to $FLEXRT_ARTIFACTS (else the test's temp folder).

Chromium and the servers come as in tests/test_browser.py (it skips, with the reason, where they cannot)."""
import os, shutil, time
from pathlib import Path
import nbformat, pytest
from test_browser import chromium, _server, _free_port, _wait_listening, _start, _run_all_cells, ROOT

SCREENSHOT = ROOT / 'docs' / 'images' / 'autotune_widget.png'
ROWS = 'tr.flexrt-trial'

def _autotune_notebook(path: Path):
    cells = [f"import sys; sys.path.insert(0, {str(ROOT / 'examples')!r})\n"
             "from flexrt.widgets import AutotuneWidget\nfrom autotune_widget_train import model_fn, train_step, CONFIG",
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
    page.wait_for_selector('button.widget-button:has-text("Stopping")', timeout=30_000)
    page.wait_for_selector('button.widget-button:has-text("Stopped")', timeout=180_000)   # the ranks ended
    last, since = _count(page), time.time()
    while time.time() - since < 2:                                      # stopped: no more rows
        time.sleep(0.5); now = _count(page)
        if now != last: last, since = now, time.time()
    status = page.locator('b:text-is("stopped")').count()           # the status line's state
    page.screenshot(path=str(shots / f'{name}_autotune.png'), full_page=True)
    return first, rising, last, status

def _browse(chromium, url: str, open_page, name: str, server, port: int, tmp_path: Path):
    import signal
    from playwright.sync_api import sync_playwright
    shots = Path(os.environ.get('FLEXRT_ARTIFACTS', tmp_path)); shots.mkdir(parents=True, exist_ok=True)
    try:
        _wait_listening(port)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=['--headless', '--no-sandbox', '--disable-gpu',
                '--no-first-run', '--disable-background-networking', '--disable-component-update', '--disable-sync'])
            page = browser.new_page(viewport={'width': 1200, 'height': 1500})
            page.goto(url, timeout=120_000)
            open_page(page)
            first, rising, last, status = _run_watch_and_stop(page, shots, name, tmp_path / 'server.log')
            browser.close()
        assert 0 < first < rising <= last and status >= 1
        assert (shots / f'{name}_autotune.png').stat().st_size > 20_000
        return shots / f'{name}_autotune.png'
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try: server.wait(20)
        except Exception: os.killpg(server.pid, signal.SIGKILL)

def test_voila_autotune_widget_runs_shows_rows_live_and_stops(chromium, tmp_path):
    voila = _server('voila')
    _autotune_notebook(tmp_path / 'autotune.ipynb')
    port = _free_port()
    server = _start([voila, str(tmp_path / 'autotune.ipynb'), '--no-browser', f'--port={port}', '--Voila.ip=127.0.0.1'], tmp_path)
    shot = _browse(chromium, f'http://127.0.0.1:{port}/', lambda page: None, 'voila', server, port, tmp_path)
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True); shutil.copy(shot, SCREENSHOT)

def test_jupyterlab_autotune_widget_runs_shows_rows_live_and_stops(chromium, tmp_path):
    lab = _server('jupyter-lab')
    _autotune_notebook(tmp_path / 'autotune.ipynb')
    port = _free_port()
    env = os.environ | {'JUPYTER_RUNTIME_DIR': str(tmp_path / 'runtime'), 'JUPYTER_CONFIG_DIR': str(tmp_path / 'config')}
    server = _start([lab, '--no-browser', f'--port={port}', '--ServerApp.ip=127.0.0.1', f'--ServerApp.root_dir={tmp_path}',
                     "--IdentityProvider.token=", '--ServerApp.password=', '--ServerApp.disable_check_xsrf=True', '--ServerApp.allow_root=True',
                     f'--LabApp.workspaces_dir={tmp_path / "workspaces"}', '--LabApp.news_url=', '--ServerApp.open_browser=False'],
                    tmp_path, env)
    _browse(chromium, f'http://127.0.0.1:{port}/lab/tree/autotune.ipynb', _run_all_cells, 'jupyterlab', server, port, tmp_path)
