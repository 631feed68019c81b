"""A real browser: Voila, and JupyterLab, serve a live-dashboard notebook; Debian's Chromium (driven by Playwright,
no browser download) loads it (in JupyterLab: runs all its cells), watches the dashboard's step counter rise while
two ranks train in the background, clicks Stop, sees the button end as "Stopped", checks that the ranks stopped
early, and saves a screenshot (to $FLEXRT_ARTIFACTS, else the test's temp folder; `make screenshots` writes them to
docs/images/, where the README shows them).

The first minute is checked as a user sees it: once the first step record is on the page the gradient-norm plot comes
(how soon is measured by bench/dashboard_overhead.py, not timed here), no plot of nothing and no empty section is
shown, and the launching cell says what it started and prints no warning. While the ranks train, the run-health panels
show in the page: the Ranks panel names a rank (the straggler line) with one table row per rank, the layer-norm heatmap
is an image that decoded to a nonzero size, and the ranks' `[flexrt] step=` lines reach the dashboard's Log area; in
JupyterLab, where a line a rank prints lands in the launching cell, no cell's own output gets one (checked again once
the ranks stopped, when every line was written; Voila shows a cell's outputs only while it runs, so there it cannot).

Chromium comes from `apt-get install chromium` on first use; the test skips (with the reason) only where that cannot
be done."""
import fcntl, json, os, shutil, signal, socket, subprocess, sys, tempfile, threading
from pathlib import Path
import nbformat, pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = '/usr/bin/chromium'

def _install_chromium():
    "Debian's Chromium via apt (root only); returns why it is unavailable, or None"
    if os.path.exists(CHROMIUM): return None
    if shutil.which('apt-get') is None or os.geteuid() != 0: return 'no chromium, and apt-get is not usable here (needs root)'
    # `make test`'s two workers may both need it at once: one installs, the other waits and finds it (apt's own lock
    # would fail the second)
    with open(Path(tempfile.gettempdir()) / 'flexrt-chromium-install.lock', 'w') as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(CHROMIUM): return None
        for cmd in (['apt-get', 'update', '-q'], ['apt-get', 'install', '-y', '-q', 'chromium']):
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if r.returncode: return f'{" ".join(cmd)} failed: {r.stderr[-500:]}'
    return None

@pytest.fixture(scope='module')
def chromium():
    why = _install_chromium()
    if why: pytest.skip(f'browser tier skipped: {why}')
    pytest.importorskip('playwright.sync_api', reason='playwright is a dev requirement: pip install -e ".[dev]"')
    return CHROMIUM

def _server(name):
    "The venv's `name` executable (voila, jupyter-lab), or skip saying how to install it"
    path = shutil.which(name, path=str(Path(sys.executable).parent))
    if path is None: pytest.skip(f'{name} missing: pip install -e ".[dev]"')
    return path

def _free_port():
    from helpers import free_port   # this xdist worker's share of the ports
    return free_port()

def _live_notebook(path: Path):
    cells = [f"import sys; sys.path.insert(0, {str(ROOT / 'examples')!r})\n"
             "from flexrt.widgets import TrainingDashboard\nfrom flexrt.launch import launch\nfrom quickstart_train import train",
             "dash = TrainingDashboard(total_steps=300, clip=1.0, interval=0.3)\ndash",
             "config = {'steps_per_print': 5, 'diagnostics': {'layer_norms_every': 5}}\n"
             "run = launch(train, (300, 0.05, False, config), num_processes=2, background=True)"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata['kernelspec'] = {'name': 'python3', 'display_name': 'python3', 'language': 'python'}
    nbformat.write(nb, path)

def _wait_listening(server: subprocess.Popen, port, timeout=60):
    "Wait until the server says it runs at its URL: it listens from then on (a GET of the page would already start a kernel and run the notebook)"
    with server.said:
        said = server.said.wait_for(lambda: server.output_ended or any(f':{port}/' in line for line in server.lines), timeout)
        if said and not server.output_ended: return
    raise TimeoutError(f'the server did not say it listens on port {port} (within {timeout} s, or before it ended):\n'
                       + ''.join(server.lines[-30:]))

COUNTER = '.jp-OutputArea input[type=number], .widget-inline-hbox input[type=number]'
# a function of a section's bold title: its widget box, or null
SECTION = """(title) => { const b = [...document.querySelectorAll('b')].find(e => e.textContent === title);
    return b ? b.closest('.widget-vbox') : null; }"""
# a function of a section's bold title: whether the section shows a PNG plot that decoded to a nonzero size
SECTION_IMAGE = f"""(title) => {{ const box = ({SECTION})(title);
    return !!box && [...box.querySelectorAll('img[src^="data:image/png"]')].some(i => i.complete && i.naturalWidth > 0 && i.naturalHeight > 0); }}"""
NOISE = ('Warning', 'warning', 'Failed to register', 'orphaned', 'CUDAs', 'Traceback')

def _check_first_look(page):
    "No empty section, no plot of nothing, and a launching cell that says what it started, without warnings"
    sections = page.evaluate("""() => [...document.querySelectorAll('b')].map(b => { const box = b.closest('.widget-vbox');
        return {title: b.textContent, shown: !!(box && box.offsetParent), text: box ? box.innerText : '',
                image: !!(box && box.querySelector('img[src^="data:image/png"]')), table: !!(box && box.querySelector('table'))}; })""")
    by_title = {s['title']: s for s in sections}
    assert by_title['Memory']['image'] and 'untracked' not in by_title['Memory']['text'], by_title['Memory']
    comm = by_title['Communication']
    assert not comm['shown'] or comm['table'], f'an empty Communication section is shown: {comm}'
    outputs = page.evaluate("() => [...document.querySelectorAll('.jp-OutputArea-output')].map(e => e.innerText).join('\\n')")
    assert 'flexrt: launching 2 CPU processes (gloo): 2 ranks × ' in outputs, outputs
    assert not [w for w in NOISE if w in outputs], f'the launching cell printed noise: {outputs!r}'
    assert not page.query_selector('[data-mime-type="application/vnd.jupyter.stderr"]'), 'something was written to stderr'

STEP_LINE = '[flexrt] step='
LOG_TEXT = "(document.querySelector('pre.flexrt-log') || {}).textContent || ''"
# what the notebook's cells printed themselves: their text outputs (widgets, the dashboard's Log area among them, are not)
CELLS_PRINTED = """() => [...document.querySelectorAll('.jp-OutputArea-output.jp-RenderedText')].map(e => e.innerText).join('\\n')"""

def _wait_for(page, condition: str, what: str, shots: Path, name: str, timeout=60_000):
    "Wait until the JavaScript `condition` holds; else save a screenshot and fail saying `what` did not show"
    try: page.wait_for_function(condition, timeout=timeout)
    except Exception:
        page.screenshot(path=str(shots / f'{name}_failed.png'), full_page=True)
        raise AssertionError(f'{what} did not show (screenshot: {name}_failed.png)')

LATE_OUTPUT_SHOWN = {'jupyterlab'}   # the UIs that show what a background rank prints after its cell ended (not Voila)

def _check_health_panels(page, shots: Path, name: str):
    "The Ranks panel names a rank and has a row per rank; the layer-norm heatmap is a decoded image; step lines reach the Log"
    ranks = f"(({SECTION})('Ranks') || {{}})"
    _wait_for(page, f"/\\brank \\d+: /.test({ranks}.innerText || '') && {ranks}.querySelectorAll('tr.flexrt-rank').length === 2",
              'the Ranks panel naming a rank, with one row per rank', shots, name)
    _wait_for(page, f"({SECTION_IMAGE})('Gradient norm by layer') && /step \\d+: largest /.test((({SECTION})('Gradient norm by layer') || {{}}).innerText)",
              'the layer-norm heatmap with its text', shots, name)
    _wait_for(page, f"({LOG_TEXT}).includes({json.dumps(STEP_LINE + '5 ')})", "the ranks' step lines in the dashboard's Log area", shots, name)
    _check_quiet_cells(page, name)

def _check_quiet_cells(page, name: str):
    "The step lines are in the dashboard's Log area; where the UI would show them in a cell, none is in a cell's own output"
    assert STEP_LINE in page.evaluate(LOG_TEXT)
    if name not in LATE_OUTPUT_SHOWN: return
    printed = page.evaluate(CELLS_PRINTED)
    assert 'flexrt: launching 2 CPU processes (gloo): 2 ranks × ' in printed, f'the launching cell\'s output is not where it is looked for: {printed!r}'
    assert STEP_LINE not in printed, f'step lines went to a cell instead of the dashboard: {printed!r}'

def _fit(page):
    "Resize the viewport so the notebook shows whole in a screenshot: JupyterLab and Voila scroll it inside an element, not the page"
    extra = page.evaluate("""() => { const cells = document.querySelectorAll('.jp-Cell'), last = cells[cells.length - 1];
        if (!last) return 0;
        let box = last.parentElement;
        while (box && box !== document.body && !/(auto|scroll)/.test(getComputedStyle(box).overflowY)) box = box.parentElement;
        if (!box || box === document.body) return 0;       // the page itself scrolls: a full-page screenshot has it all
        box.scrollTop = 0;
        return Math.ceil(last.getBoundingClientRect().bottom - box.getBoundingClientRect().bottom + 16); }""")
    size = page.viewport_size
    if extra: page.set_viewport_size({'width': size['width'], 'height': max(size['height'] + extra, 800)})

def _watch_and_stop(page, shots: Path, name: str, log: Path):
    "The counter rises while the ranks train; Stop stops them, the button ends as Stopped; returns the counter values"
    try: counter = page.wait_for_selector(COUNTER, timeout=120_000)
    except Exception:
        page.screenshot(path=str(shots / f'{name}_failed.png'), full_page=True)
        raise AssertionError(f'no dashboard on the page; server log:\n' + log.read_text()[-3000:])
    read = lambda: int(counter.input_value() or 0)
    value = f"document.querySelector({COUNTER!r}).value"
    page.wait_for_function(f"{value} > 0", timeout=120_000)
    first = read()
    try: page.wait_for_function(f"({SECTION_IMAGE})('Gradient norm')", timeout=60_000)   # the first look: a plot comes
    except Exception:
        page.screenshot(path=str(shots / f'{name}_first_look.png'), full_page=True)
        raise AssertionError('no gradient-norm plot after the first step record')
    _check_first_look(page)
    page.wait_for_function(f"{value} > {first}", timeout=60_000)
    rising = read()
    page.wait_for_function(f"{value} >= 40", timeout=120_000)                  # a picture of a run under way
    _check_health_panels(page, shots, name)
    _fit(page); page.screenshot(path=str(shots / f'{name}_live.png'), full_page=True)
    page.click('button:has-text("Stop")')
    page.wait_for_selector('button:text-matches("Stopp(ing|ed)")', timeout=30_000)   # "Stopping" can pass between two polls
    stable = read()
    page.wait_for_selector('button:has-text("Stopped")', timeout=60_000)  # the ranks ended: the final state shows
    last = _settled(page, f"Number({value} || 0)")                    # stopped: the counter stays
    _check_quiet_cells(page, name)                                    # every line is written now
    _fit(page); page.screenshot(path=str(shots / f'{name}_dashboard.png'), full_page=True)
    return first, rising, stable, last

def _settled(page, expression: str, quiet_ms: int = 2_000, most: int = 30):
    "The value of the JavaScript `expression` once it stayed the same for `quiet_ms` (the browser watches it change)"
    from playwright.sync_api import TimeoutError as NoChange
    last = page.evaluate(expression)
    for _ in range(most):
        try: page.wait_for_function(f"({expression}) !== {json.dumps(last)}", timeout=quiet_ms)
        except NoChange: return last
        last = page.evaluate(expression)
    raise AssertionError(f'{expression} kept changing: {last}')

def _browse(chromium, url: str, open_page, name: str, server: subprocess.Popen, port: int, tmp_path: Path, watch=None,
            viewport=(1100, 1400)):
    "Load `url` in Chromium, prepare it with `open_page(page)`, then `watch(page, shots, name, log)` (default: the dashboard's watch and stop) and return what it returns; always end the server"
    from playwright.sync_api import sync_playwright
    shots = Path(os.environ.get('FLEXRT_ARTIFACTS', tmp_path)); shots.mkdir(parents=True, exist_ok=True)
    try:
        _wait_listening(server, port)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=['--headless', '--no-sandbox', '--disable-gpu',
                '--no-first-run', '--disable-background-networking', '--disable-component-update', '--disable-sync'])
            page = browser.new_page(viewport={'width': viewport[0], 'height': viewport[1]})
            page.goto(url, timeout=120_000)
            open_page(page)
            seen = (watch or _watch_and_stop)(page, shots, name, tmp_path / 'server.log')
            browser.close()
        return seen, shots
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try: server.wait(20)
        except subprocess.TimeoutExpired: os.killpg(server.pid, signal.SIGKILL)

def _check_dashboard_run(seen, shots: Path, name: str):
    first, rising, stable, last = seen
    assert 0 < first < rising <= stable <= last < 600            # rose live, then stopped well before 300 steps x 2
    assert (shots / f'{name}_dashboard.png').stat().st_size > 10_000

def _lab_server(tmp_path: Path):
    "A JupyterLab server over `tmp_path` on a free port, with its own runtime, config and workspace folders: (server, port)"
    lab, port = _server('jupyter-lab'), _free_port()
    env = os.environ | {'JUPYTER_RUNTIME_DIR': str(tmp_path / 'runtime'), 'JUPYTER_CONFIG_DIR': str(tmp_path / 'config')}
    labconfig = tmp_path / 'config' / 'labconfig'; labconfig.mkdir(parents=True, exist_ok=True)   # no "Jupyter news?" toast on the screenshots
    (labconfig / 'page_config.json').write_text(json.dumps({'disabledExtensions': {'@jupyterlab/apputils-extension:announcements': True}}))
    server = _start([lab, '--no-browser', f'--port={port}', '--ServerApp.ip=127.0.0.1', f'--ServerApp.root_dir={tmp_path}',
                     "--IdentityProvider.token=", '--ServerApp.password=', '--ServerApp.disable_check_xsrf=True', '--ServerApp.allow_root=True',
                     f'--LabApp.workspaces_dir={tmp_path / "workspaces"}', '--LabApp.news_url=', '--ServerApp.open_browser=False'],
                    tmp_path, env)
    return server, port

def _start(command, tmp_path: Path, env=None) -> subprocess.Popen:
    "Start a server; a thread copies its output into server.log and onto `.lines`, notifying `.said` at each line"
    server = subprocess.Popen(command, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    server.lines, server.said, server.output_ended = [], threading.Condition(), False
    def copy():
        with open(tmp_path / 'server.log', 'w') as log:
            for line in server.stdout:
                log.write(line); log.flush()
                with server.said: server.lines.append(line); server.said.notify_all()
        with server.said: server.output_ended = True; server.said.notify_all()
    threading.Thread(target=copy, daemon=True, name='server-output').start()
    return server

def test_voila_dashboard_counts_steps_live_and_stops_from_the_button(chromium, tmp_path):
    voila = _server('voila')
    _live_notebook(tmp_path / 'live.ipynb')
    port = _free_port()
    server = _start([voila, str(tmp_path / 'live.ipynb'), '--no-browser', f'--port={port}', '--Voila.ip=127.0.0.1'], tmp_path)
    _check_dashboard_run(*_browse(chromium, f'http://127.0.0.1:{port}/', lambda page: None, 'voila', server, port, tmp_path), 'voila')

def _run_all_cells(page):
    "In JupyterLab: wait for the notebook and its kernel, then Run > Run All Cells (again if the kernel missed it)"
    page.wait_for_selector('.jp-Notebook .jp-Cell', timeout=120_000)
    page.wait_for_selector('text=Python 3 (ipykernel) | Idle', timeout=120_000)
    for attempt in range(3):
        page.click('.lm-MenuBar-itemLabel:text-is("Run")')
        page.click('.lm-Menu-itemLabel:text-is("Run All Cells")')
        try: page.wait_for_selector('.jp-InputPrompt:has-text("[1]:"), .jp-InputPrompt:has-text("[*]:")', timeout=20_000); return
        except Exception: pass
    raise AssertionError('JupyterLab did not run the cells')

def test_jupyterlab_dashboard_counts_steps_live_and_stops_from_the_button(chromium, tmp_path):
    _live_notebook(tmp_path / 'live.ipynb')
    server, port = _lab_server(tmp_path)
    seen = _browse(chromium, f'http://127.0.0.1:{port}/lab/tree/live.ipynb', _run_all_cells, 'jupyterlab', server, port, tmp_path)
    _check_dashboard_run(*seen, 'jupyterlab')
