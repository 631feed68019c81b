"""A real browser: Voila serves a live-dashboard notebook, Debian's Chromium (driven by Playwright, no browser
download) loads it, watches the dashboard's step counter rise while two ranks train in the background, clicks Stop,
checks that the ranks stopped early, and saves a screenshot (to $FLEXRT_ARTIFACTS, else the test's temp folder).

Chromium comes from `apt-get install chromium` on first use; the test skips (with the reason) only where that cannot
be done."""
import os, shutil, signal, socket, subprocess, sys, time
from pathlib import Path
import nbformat, pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = '/usr/bin/chromium'

def _install_chromium():
    "Debian's Chromium via apt (root only); returns why it is unavailable, or None"
    if os.path.exists(CHROMIUM): return None
    if shutil.which('apt-get') is None or os.geteuid() != 0: return 'no chromium, and apt-get is not usable here (needs root)'
    for cmd in (['apt-get', 'update', '-q'], ['apt-get', 'install', '-y', '-q', 'chromium']):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if r.returncode: return f'{" ".join(cmd)} failed: {r.stderr[-500:]}'
    return None

@pytest.fixture(scope='module')
def chromium():
    why = _install_chromium()
    if why: pytest.skip(f'browser tier skipped: {why}')
    pytest.importorskip('playwright.sync_api', reason='playwright is a dev requirement: pip install -e ".[dev]"')
    if shutil.which('voila', path=str(Path(sys.executable).parent)) is None: pytest.skip('voila missing: pip install -e ".[dev]"')
    return CHROMIUM

def _free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0)); return s.getsockname()[1]

def _live_notebook(path: Path):
    cells = [f"import sys; sys.path.insert(0, {str(ROOT / 'examples')!r})\n"
             "from flexrt.widgets import TrainingDashboard\nfrom flexrt.launch import launch\nfrom quickstart_train import train",
             "dash = TrainingDashboard(total_steps=300, clip=1.0, interval=0.3)\ndash",
             "run = launch(train, (300, 0.05, False), num_processes=2, background=True)"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata['kernelspec'] = {'name': 'python3', 'display_name': 'python3', 'language': 'python'}
    nbformat.write(nb, path)

def _wait_listening(port, timeout=60):
    "Wait until the server accepts connections (a GET of the page would already start a kernel and run the notebook)"
    deadline = time.time() + timeout
    while time.time() < deadline:
        try: socket.create_connection(('127.0.0.1', port), timeout=1).close(); return
        except OSError: time.sleep(0.3)
    raise TimeoutError(f'voila did not listen on port {port} within {timeout} s')

def test_voila_dashboard_counts_steps_live_and_stops_from_the_button(chromium, tmp_path):
    from playwright.sync_api import sync_playwright
    _live_notebook(tmp_path / 'live.ipynb')
    port = _free_port()
    voila = [str(Path(sys.executable).parent / 'voila'), str(tmp_path / 'live.ipynb'), '--no-browser', f'--port={port}',
             '--Voila.ip=127.0.0.1']
    log = open(tmp_path / 'voila.log', 'w')
    server = subprocess.Popen(voila, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
    shots = Path(os.environ.get('FLEXRT_ARTIFACTS', tmp_path)); shots.mkdir(parents=True, exist_ok=True)
    try:
        _wait_listening(port)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=['--headless', '--no-sandbox', '--disable-gpu',
                '--no-first-run', '--disable-background-networking', '--disable-component-update', '--disable-sync'])
            page = browser.new_page(viewport={'width': 1100, 'height': 1400})
            page.goto(f'http://127.0.0.1:{port}/', timeout=120_000)
            try: counter = page.wait_for_selector('input[type=number]', timeout=90_000)
            except Exception:
                page.screenshot(path=str(shots / 'voila_failed.png'), full_page=True)
                raise AssertionError('no dashboard on the page; voila log:\n' + (tmp_path / 'voila.log').read_text()[-3000:])
            read = lambda: int(counter.input_value() or 0)
            page.wait_for_function("document.querySelector('input[type=number]').value > 0", timeout=120_000)
            first = read()
            page.wait_for_function(f"document.querySelector('input[type=number]').value > {first}", timeout=60_000)
            rising = read()
            page.click('button:has-text("Stop")')
            page.wait_for_selector('button:has-text("Stopping")', timeout=30_000)
            stable, last, since = read(), read(), time.time()
            while time.time() - since < 4:                           # stopped: the counter settles
                time.sleep(0.5); now = read()
                if now != last: last, since = now, time.time()
            page.screenshot(path=str(shots / 'voila_dashboard.png'), full_page=True)
            browser.close()
        assert 0 < first < rising <= stable <= last < 600            # rose live, then stopped well before 300 steps x 2
        assert (shots / 'voila_dashboard.png').stat().st_size > 10_000
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try: server.wait(20)
        except subprocess.TimeoutExpired: os.killpg(server.pid, signal.SIGKILL)
