"""The documentation site: tools/docs.py (`make docs`) builds it into a temporary folder, and every page holds up.

No page shows a failed cell or a traceback; hidden cells stay hidden and the cells that assert are folded; every demo
shows the outputs saved in its notebook (tools/outputs.py, `make outputs`), and the saved outputs keep its rules; every
name of every flexrt module's `__all__` has an API entry somewhere on the site; every relative link leads to a file of
the site, and its `#anchor` to an id on that page; nothing is fetched from elsewhere (no stylesheet, script, image or
font off the site); and every page opens in Chromium (one browser, one tab, file:// URLs) without a console error or a
failed request. Chromium comes as tests/test_browser.py gets it (Debian's, installed with apt-get on first use), or the
browser check skips saying why."""
import configparser, json, subprocess, sys, time
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit
import pytest
from test_browser import chromium  # noqa: F401  (the fixture: Debian's Chromium, or a skip with the reason)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / 'tools'))
from docs import as_strings, page_name  # noqa: E402
from outputs import is_demo, kept  # noqa: E402  (the rules `make outputs` saves by)
VOID_TAGS = {'area', 'base', 'br', 'col', 'embed', 'hr', 'img', 'input', 'link', 'meta', 'source', 'track', 'wbr'}
EXTRA_PAGES = ('index.html', 'getting_started.html', 'architecture.html', 'overview.html')
# every module of the package and its `__all__`, read in a process of its own (importing them all has side effects)
PUBLIC_NAMES = """
import importlib, json, pkgutil, flexrt
found = pkgutil.walk_packages(flexrt.__path__, 'flexrt.')
modules = ['flexrt'] + [m.name for m in found if not m.name.endswith('__main__')]
print(json.dumps({m: list(getattr(importlib.import_module(m), '__all__', ())) for m in modules}))
"""


class Page(HTMLParser):
    "What the checks read from one page: ids, links, API entries, failed cells, tracebacks"

    def __init__(self, path: Path):
        super().__init__()
        self.path, self.ids, self.links, self.entries, self.errors, self.tests = path, set(), [], set(), [], 0
        self.demos, self.shown, self._open = 0, [], []  # demo cells; the text of outputs; open tags: in an output?
        self.bare_images = []  # the src of each <img> without an alt text
        self.text = path.read_text()
        self.feed(self.text)
        if 'Traceback (most recent call last)' in self.text: self.errors.append('a traceback')

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if 'id' in attrs: self.ids.add(attrs['id'])
        for key in ('href', 'src'):
            if attrs.get(key): self.links.append((tag, attrs[key]))
        classes = (attrs.get('class') or '').split()
        if 'api-entry' in classes: self.entries.add(attrs.get('data-name'))
        self.tests += tag == 'details' and 'test-cell' in classes
        self.demos += tag == 'div' and 'demo-cell' in classes
        if {'output_error', 'docs-error'} & set(classes): self.errors.append(f'<{tag} class="{attrs["class"]}">')
        if tag == 'img' and not attrs.get('alt'): self.bare_images.append(attrs.get('src', '(no src)')[:80])
        inside = 'output_wrapper' in classes or bool(self._open and self._open[-1][1])
        if tag not in VOID_TAGS: self._open.append((tag, inside))

    def handle_endtag(self, tag):
        while self._open and self._open.pop()[0] != tag: pass

    def handle_data(self, data):
        if self._open and self._open[-1][1]: self.shown.append(data)


@pytest.fixture(scope='module')
def site(tmp_path_factory):
    "The site built into a temporary folder (as `make docs` builds _docs/), its pages read, the build's result kept"
    out = tmp_path_factory.mktemp('docs') / '_docs'
    names = subprocess.Popen([sys.executable, '-c', PUBLIC_NAMES], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    start = time.perf_counter()
    build = subprocess.run([sys.executable, str(ROOT / 'tools' / 'docs.py'), '--out', str(out)], cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - start
    public = json.loads(names.communicate(timeout=300)[0])
    pages = {p.name: Page(p) for p in sorted(out.glob('*.html'))}
    print(f'tools/docs.py: {len(pages)} pages in {seconds:.0f} s')
    return {'out': out, 'build': build, 'pages': pages, 'public': public}


def test_the_build_succeeds_and_reports_nothing(site):
    build = site['build']
    assert build.returncode == 0, f'tools/docs.py failed:\n{build.stdout[-2000:]}\n{build.stderr[-8000:]}'
    assert build.stderr.strip() == '', build.stderr[-4000:]


def test_a_page_per_notebook_and_the_site_pages(site):
    notebooks = [p for p in (ROOT / 'nbs').glob('*.ipynb') if p.name != 'index.ipynb']
    assert set(EXTRA_PAGES) <= set(site['pages'])
    assert len(site['pages']) == len(notebooks) + len(EXTRA_PAGES), sorted(site['pages'])
    assert (site['out'] / 'site.css').stat().st_size > 1000


def test_no_page_shows_a_failed_cell(site):
    failed = {name: page.errors for name, page in site['pages'].items() if page.errors}
    assert not failed, failed


def test_hidden_cells_stay_hidden_and_tests_are_folded(site):
    pages = site['pages'].values()
    shown = [p.path.name for p in pages if 'from nbdev.showdoc import' in p.text]  # every notebook hides this import
    assert not shown, shown
    assert sum(p.tests for p in pages) > 500, 'the cells that assert are not folded'


def test_every_public_name_has_an_api_entry(site):
    entries = set().union(*(page.entries for page in site['pages'].values()))
    missing = [f'{module}.{name}' for module, names in site['public'].items() for name in names if name not in entries]
    assert sum(map(len, site['public'].values())) > 500 and len(entries) > 500
    assert not missing, f'{len(missing)} public names have no API entry: {missing}'


def _target(page: Page, url: str) -> tuple:
    "(file, anchor) a relative link of `page` leads to"
    parts = urlsplit(url)
    path = (page.path.parent / unquote(parts.path)).resolve() if parts.path else page.path
    return path, unquote(parts.fragment)


def _doc_host() -> str:
    "Where nbdev's links would point (settings.ini): the site's own pages, which must be linked relatively"
    config = configparser.ConfigParser()
    config.read(ROOT / 'settings.ini')
    return config['DEFAULT']['doc_host'] + config['DEFAULT']['doc_baseurl']


def test_every_image_says_what_it_shows(site):
    "Every <img> has an alt text (the build writes the page as the template made it: nothing adds a placeholder)"
    bare = {name: page.bare_images for name, page in site['pages'].items() if page.bare_images}
    assert not bare, f'images without an alt text: {bare}'

def test_every_relative_link_resolves_and_nothing_is_fetched_from_elsewhere(site):
    out, pages, dead, fetched, host = site['out'].resolve(), site['pages'], [], [], _doc_host()
    for name, page in pages.items():
        for tag, url in page.links:
            if url.startswith(host): dead.append(f'{name}: {url} (a page of this site, linked where it is not)')
            scheme = urlsplit(url).scheme
            if scheme in ('http', 'https', 'file') or url.startswith('//'):
                if tag != 'a': fetched.append(f'{name}: <{tag}> {url}')
                continue
            if scheme: continue  # mailto:, data: (an inline picture)
            path, anchor = _target(page, url)
            inside = path.is_relative_to(out) and path.is_file()
            if not inside or (anchor and path.suffix == '.html' and anchor not in pages[path.name].ids):
                dead.append(f'{name}: {url}')
    assert not fetched, fetched
    assert not dead, f'{len(dead)} links lead nowhere: {dead[:40]}'


def test_every_page_opens_in_chromium_without_errors(site, chromium):  # noqa: F811
    from playwright.sync_api import sync_playwright
    problems, start = [], time.perf_counter()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=['--headless', '--no-sandbox', '--disable-gpu',
                                    '--no-first-run', '--disable-background-networking', '--disable-component-update'])
        tab = browser.new_page()
        tab.on('console', lambda m: m.type == 'error' and problems.append(f'{tab.url}: console: {m.text}'))
        tab.on('pageerror', lambda e: problems.append(f'{tab.url}: {e}'))
        tab.on('requestfailed', lambda r: problems.append(f'{tab.url}: failed to load {r.url}'))
        for name in site['pages']:
            tab.goto((site['out'] / name).as_uri(), wait_until='load')
            shown = tab.evaluate("() => [!!document.querySelector('main h1.page-title'), document.styleSheets.length,"
                                 " getComputedStyle(document.querySelector('.sidebar')).position]")
            if shown != [True, 1, 'sticky']: problems.append(f'{name}: title, stylesheet, sidebar: {shown}')
        browser.close()
    print(f'Chromium opened {len(site["pages"])} pages in {time.perf_counter() - start:.1f} s')
    assert not problems, problems[:20]


def _saved_demos() -> dict:
    "notebook path -> its code cells that carry saved outputs"
    found = {}
    for path in sorted((ROOT / 'nbs').glob('*.ipynb')):
        cells = [c for c in json.loads(path.read_text())['cells'] if c['cell_type'] == 'code' and c['outputs']]
        if cells: found[path] = cells
    return found


def test_saved_outputs_are_demos_kept_as_make_outputs_keeps_them():
    "Only a demo carries outputs, and only what tools/outputs.py keeps: no stderr, error, widget or overlong stream"
    saved, wrong = _saved_demos(), []
    for path, cells in saved.items():
        for cell in cells:
            where = f'{path.name}, cell {cell.get("id")}'
            if not is_demo(cell): wrong.append(f'{where}: not a demo (a test, an export, hidden), yet it has outputs')
            elif kept(cell['outputs']) != [as_strings(o) for o in cell['outputs']]:
                wrong.append(f'{where}: outputs `make outputs` would not keep')
    assert not wrong, wrong
    faces = [p for p in (ROOT / 'nbs').glob('*.ipynb') if p.stem.count('_') == 1 and p.name != 'index.ipynb']
    assert len(faces) >= 16 and not [p.name for p in faces if p not in saved], 'a wing face without a demo to show'


def test_every_demo_shows_its_saved_outputs(site):
    "Each notebook's demos appear on its page as demos, each with the first line of what it printed or showed"
    pages, missing = site['pages'], []
    for path, cells in _saved_demos().items():
        page = pages['overview.html' if path.name == 'index.ipynb' else page_name(path)]
        if page.demos < len(cells): missing.append(f'{page.path.name}: {page.demos} demos shown of {len(cells)}')
        shown = ''.join(page.shown)
        for cell in cells:
            first = _first_line(cell['outputs'][0])
            if first and first not in shown: missing.append(f'{page.path.name}: {first!r} is not among its outputs')
    assert not missing, missing
    assert sum(p.demos for p in pages.values()) >= 30


def _first_line(output: dict) -> str:
    "The first line of a stream's or text result's text ('' for a picture, HTML or markdown: rendered, not as text)"
    text = output.get('text') or output.get('data', {}).get('text/plain') or output.get('data', {}).get('text/markdown')
    text = ''.join(text) if isinstance(text, list) else text or ''
    if not text.strip() or 'text/markdown' in output.get('data', {}): return ''
    return text.strip().splitlines()[0].strip()
