"""Build the documentation site (`make docs`) into _docs/: nbdev's notebook processors, then nbconvert; no Quarto.

Every notebook in nbs/ becomes one page named as nbdev names it (`50_zero_base.ipynb` -> `zero_base.html`), titled by
its `# Title` cell: the prose, an API entry for every public name (signature and docstring from `show_doc`; a public
constant gets its value and comment), demo cells with the outputs saved in the notebook (`make outputs`,
tools/outputs.py), and tests (cells that assert and show nothing) folded.
`index.html` lists the pages by wing, `overview.html` is nbs/index.ipynb (the README's source), `getting_started.html`
and `architecture.html` are docs/getting_started.md and docs/architecture.md. Every page has the same header and
sidebar. Nothing is fetched when a page opens: one stylesheet, no script, no web font.

Notebooks are not run: their demos' outputs are saved in them. As nbdev's docs processor does, the exported cells run
(that is importing the module) and so do the `show_doc` cells, which render the entries; unlike it, of any other cell
only its import statements run (nbdev runs such a cell whole: its tests, ranks it launches, names a skipped cell
defined). A cell that fails, a public name
without an entry and a relative link that leads nowhere are reported by notebook and cell, and the build exits 1.
README.md is never written (tools/readme.py writes it).

    python tools/docs.py [--out DIR]
"""
import argparse, ast, atexit, configparser, html, importlib, importlib.util, inspect, io, os, re, reprlib, shutil, sys
import time, tokenize, warnings
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
import nbformat
from execnb.nbio import mk_cell, read_nb
from execnb.shell import CaptureShell
from fastcore.basics import AttrDict
from jinja2 import pass_context
from nbconvert import HTMLExporter, TemplateExporter
from nbconvert.filters.highlight import Highlight2HTML
from nbconvert.filters.widgetsdatatypefilter import WidgetsDataTypeFilter
from nbconvert.filters.markdown_mistune import markdown2html_mistune
from nbdev import processors as nbp
from nbdev.process import NBProcessor, Processor
from pygments.formatters import HtmlFormatter

ROOT = Path(__file__).resolve().parent.parent
NBS, DOCS = ROOT / 'nbs', ROOT / 'docs'
TEMPLATES = DOCS / 'templates'  # the nbconvert template (flexrt/) and the stylesheet


@dataclass
class Page:
    "One page of the site: where it comes from, what it is called, and what went wrong building it"

    name: str  # file name in the site, e.g. `zero_base.html`
    title: str
    label: str = ''  # its name in the header, for the site's own pages
    description: str = ''
    source: Path | None = None  # the notebook or markdown file, if any
    wing: str = ''  # the wing's key (`zero`), '' for the site's own pages
    face: bool = False  # the wing's face (`nbs/NN_wing.ipynb`)
    nb: object = None  # the processed notebook, ready for nbconvert
    anchors: set = field(default_factory=set)  # ids of its API entries
    entries: set = field(default_factory=set)  # the names its API entries document
    module: object = None  # the module the notebook exports
    failures: list = field(default_factory=list)


def page_name(nb_path: Path) -> str:
    "nbdev's page name for a notebook (its doc links point there): the number prefix dropped, lower case"
    return re.sub(r'^\d+[a-zA-Z0-9]*_', '', nb_path.name.lower()).replace('.ipynb', '.html')


def wing_of(nb_path: Path) -> tuple:
    "(wing key, is the wing's face) from `NN_wing[_module].ipynb`"
    _, wing, *rest = nb_path.stem.split('_')
    return wing, not rest


def wing_label(wing: str) -> str:
    return 'flexrt (top level)' if wing == 'flexrt' else f'flexrt.{wing}'


def failure(page: Page, cell, what: str):
    "Record what went wrong at `cell` (numbered as in the notebook; a cell the build added names the one it follows)"
    where = str(page.source.relative_to(ROOT)) if page.source else page.name
    if cell is not None and where.endswith('.ipynb'):
        meta = cell.metadata
        where += f", cell {meta['docs_cell']}" if 'docs_cell' in meta else \
            f", the API entry added after cell {meta.get('docs_after', '?')}"
    page.failures.append(f'{where}: {what}')


# Processing: nbdev's processors in nbdev's order, with four of ours ---------------------------------------------------

def show_doc_calls(source: str) -> list:
    "The `show_doc(...)` calls of a cell made only of them, as source strings; [] for any other cell"
    try: body = ast.parse(source).body
    except SyntaxError: return []
    calls = [ast.get_source_segment(source, s) for s in body if isinstance(s, ast.Expr) and _is_show_doc(s.value)]
    return calls if body and len(calls) == len(body) else []


def _is_show_doc(node) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == 'show_doc'


def _new_cell(source: str, after, cell_type='code'):
    "A cell the build adds after the cell `after` (None: at the end), remembering which notebook cell that is"
    origin = after.metadata.get('docs_cell', '?') if after is not None else 'the last'
    cell = mk_cell(source, cell_type, metadata=AttrDict(docs_after=origin))
    cell.directives_ = {}
    return cell


def _part_of(cell, source: str):
    "A cell holding part of `cell`'s code, numbered as `cell` is"
    part = mk_cell(source, 'code', metadata=AttrDict(docs_cell=cell.metadata.get('docs_cell', '?')))
    part.directives_ = {}
    return part


class split_show_docs(Processor):
    "One cell per `show_doc` call: a shell displays only a cell's last value"

    def begin(self):
        cells = []
        for cell in self.nb.cells:
            calls = show_doc_calls(cell.source) if cell.cell_type == 'code' and not cell.directives_ else []
            cells += [_part_of(cell, call) for call in calls] if len(calls) > 1 else [cell]
        self.nb.cells = cells


class order_show_docs(Processor):
    "nbdev adds the entries of a cell's definitions last first: put them back in the order they are defined"

    def begin(self):
        cells, start, source = self.nb.cells, None, '?'
        for i, cell in enumerate(cells + [None]):
            added = cell is not None and cell.get('has_sd')
            if added: cell.metadata.setdefault('docs_after', source)  # the export cell it documents
            elif cell is not None: source = cell.metadata.get('docs_cell', source)
            if added and start is None: start = i
            if not added and start is not None:
                cells[start:i] = cells[start:i][::-1]
                start = None


def _bindings(cells) -> dict:
    "name -> (export cell, statement) for every name an exported cell binds at its top level"
    found = {}
    for cell in cells:
        if cell.cell_type != 'code' or not {'export', 'exports'} & set(cell.directives_): continue
        for stmt in cell.parsed_() or []:
            for name in _bound_names(stmt): found[name] = (cell, stmt)
    return found


def _bound_names(stmt) -> list:
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)): return [stmt.name]
    if isinstance(stmt, (ast.Import, ast.ImportFrom)): return [(a.asname or a.name).split('.')[0] for a in stmt.names]
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
    return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]


def _shown(cells) -> set:
    "The names the notebook's `show_doc` calls document (their `name=` where given)"
    names = set()
    for cell in cells:
        for node in ast.walk(ast.Module(cell.parsed_() or [], [])) if cell.cell_type == 'code' else []:
            if not _is_show_doc(node) or not node.args: continue
            given = [k.value.value for k in node.keywords if k.arg == 'name' and isinstance(k.value, ast.Constant)]
            names.add(given[0] if given else ast.unparse(node.args[0]))
    return names


def documented_elsewhere(module, name: str, stmt) -> bool:
    """Whether another flexrt module documents `name`: the one this module imports it from, when that one's `__all__`
    has it; for a name this module hands on without binding it (a face that loads on first use), the submodule whose
    `__all__` holds the same object. A name bound here by assignment, `def` or `class` is documented here."""
    if isinstance(stmt, ast.ImportFrom):
        source = importlib.util.resolve_name('.' * stmt.level + (stmt.module or ''), module.__package__ or '')
        original = next(a.name for a in stmt.names if (a.asname or a.name) == name)
        return source.startswith('flexrt') and original in getattr(importlib.import_module(source), '__all__', ())
    if stmt is not None: return False
    obj, inner = getattr(module, name, None), module.__name__ + '.'
    homes = [m for key, m in list(sys.modules.items()) if key.startswith(inner) and name in getattr(m, '__all__', ())]
    return any(getattr(m, name, None) is obj for m in homes)


class add_public_names(Processor):
    """An entry for every name of the module's `__all__` that no `show_doc` documents and no other module owns: a
    `show_doc` cell for a function or class bound by assignment or import, a value entry for a constant"""

    def begin(self):
        module = self.nb.docs_module
        if module is None: return
        shown, bound = _shown(self.nb.cells), _bindings(self.nb.cells)
        for name in getattr(module, '__all__', ()):
            cell, stmt = bound.get(name, (None, None))
            if name in shown or documented_elsewhere(module, name, stmt): continue
            self.insert(cell, _entry_cell(module, name, cell, stmt))

    def insert(self, after, new):
        "Put `new` after `after` and the entries that follow it (at the end when `after` is None)"
        cells = self.nb.cells
        i = next(i for i, c in enumerate(cells) if c is after) + 1 if after is not None else len(cells)
        while i < len(cells) and (cells[i].get('has_sd') or cells[i].metadata.get('docs_api')): i += 1
        cells.insert(i, new)


def _entry_cell(module, name: str, cell, stmt):
    "A `show_doc` cell for a function or class, else a markdown cell holding a value entry"
    obj = getattr(module, name)
    if inspect.isclass(obj) or inspect.isroutine(obj) or isinstance(obj, partial):
        named = '' if getattr(obj, '__name__', None) == name else f', name={name!r}'
        new = _new_cell(f'show_doc({name}{named})', cell)
        new.has_sd = True
        return new
    new = _new_cell(value_entry(name, obj, cell, stmt), cell, 'markdown')
    new.metadata['docs_api'] = {'name': name, 'source': f'{module.__name__.replace(".", "/")}.py'}
    return new


_short = reprlib.Repr()  # a value entry shows a short repr: 6 items of a container, 100 characters of a string
_short.maxlevel, _short.maxdict, _short.maxlist, _short.maxtuple, _short.maxset = 2, 6, 6, 6, 6
_short.maxstring = _short.maxother = 100


def value_entry(name: str, obj, cell, stmt) -> str:
    "Markdown for a public constant: `name: type = value` and the comment written at its assignment"
    text = f'```python\n{name}: {type(obj).__name__} = {_short.repr(obj)}\n```\n'
    note = _comment_at(cell.source, stmt) if stmt is not None else ''
    return text + (f'\n*{note}*\n' if note else '')


def _comment_at(source: str, stmt) -> str:
    "The comment at the end of a statement's first line, else the whole-line comments right above it"
    lines, comments = source.splitlines(), {}
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT: comments[tok.start[0]] = tok.string.lstrip('#').strip()
    except (tokenize.TokenError, IndentationError): pass
    whole = lambda n: n in comments and lines[n - 1].lstrip().startswith('#')
    if stmt.lineno in comments and not whole(stmt.lineno): return comments[stmt.lineno]
    above = stmt.lineno - 1
    while whole(above): above -= 1
    return ' '.join(comments[n] for n in range(above + 1, stmt.lineno))


class run_for_docs(Processor):
    """Run what the entries need in one shell per notebook: exported and `show_doc` cells whole, the import statements
    of any other cell (a failing one there is ignored: a `show_doc` needing it fails and says so)"""

    def begin(self):
        self.shell = CaptureShell()
        self.shell.run('from nbdev.showdoc import show_doc')

    def cell(self, cell):
        kind, source = _runnable(cell)
        if kind is None: return
        outputs = self.shell.run(source)
        if self.shell.exc is None:
            if kind == 'show_doc': cell.outputs = outputs
        elif kind == 'imports': self._imports_one_by_one(cell)
        else:
            cell.outputs = [o for o in outputs if o.get('output_type') == 'error']
            code = _options(cell.source)[1]
            failure(self.nb.docs_page, cell, f'{type(self.shell.exc).__name__}: {self.shell.exc}\n    {code}')

    def end(self):
        """Let the shell go: IPython's exit hook for it would reset its namespace and collect garbage (a third of a
        second each, at exit); its history thread stops now. The namespace stays: a module's exit hooks may use it"""
        atexit.unregister(self.shell.atexit_operations)
        thread = getattr(self.shell.history_manager, 'save_thread', None)
        if thread is not None: thread.stop()

    def _imports_one_by_one(self, cell):
        for stmt in cell.parsed_() or []:
            if isinstance(stmt, (ast.Import, ast.ImportFrom)): self.shell.run(ast.unparse(stmt))


def _runnable(cell) -> tuple:
    "('module' | 'show_doc' | 'imports', code to run) for a cell the entries need, else (None, None)"
    if cell.cell_type != 'code' or nbp.cell_lang(cell) != 'python' or not cell.source: return None, None
    if 'nbdev_export' in cell.source or cell.directives_.get('eval:', [''])[0].lower() == 'false': return None, None
    if {'export', 'exports', 'exporti', 'exec_doc'} & set(cell.directives_): return 'module', cell.source
    body = cell.parsed_() or []
    if body and all(isinstance(s, ast.Expr) and _is_show_doc(s.value) for s in body): return 'show_doc', cell.source
    imports = [ast.unparse(s) for s in body if isinstance(s, (ast.Import, ast.ImportFrom))]
    return ('imports', '\n'.join(imports)) if imports else (None, None)


def processors() -> list:
    "nbdev's docs processors (FilterDefaults), ours put in: nothing quarto-only, no autogenerated-file warning"
    procs = []
    for proc in nbp.FilterDefaults().base_procs():
        if proc is nbp.insert_warning: continue
        if proc is nbp.exec_show_docs: proc = run_for_docs
        procs.append(proc)
        if proc is nbp.add_show_docs: procs += [order_show_docs, add_public_names]
    return [split_show_docs] + procs


def process(nb_path: Path) -> Page:
    "Read and process one notebook: its page, with the processed notebook and any failures"
    wing, face = wing_of(nb_path) if nb_path.name != 'index.ipynb' else ('', False)
    page = Page(page_name(nb_path) if wing else 'overview.html', nb_path.stem, source=nb_path, wing=wing, face=face)
    nb = read_nb(nb_path)
    for cell in nb.cells: cell.metadata['docs_cell'] = cell.idx_
    nb.docs_page, nb.docs_module = page, _module_of(nb, page)
    page.module = nb.docs_module
    try: NBProcessor(nb=nb, procs=processors()).process()
    except Exception as e: failure(page, None, f'processing stopped: {type(e).__name__}: {e}')
    page.title = nb.get('frontmatter_', {}).get('title', page.title) if wing else 'Overview (the README)'
    page.description = nb.get('frontmatter_', {}).get('description', '')
    page.nb = nb
    return page


def _module_of(nb, page: Page):
    "The module the notebook exports (`#| default_exp`), imported; None for a notebook exporting none"
    code = '\n'.join(c.source for c in nb.cells if c.cell_type == 'code')
    found = re.search(r'^#\|\s*default_exp\s+(\S+)', code, re.M)
    if not found: return None
    name = 'flexrt' + ('' if found.group(1) == '__init__' else '.' + found.group(1).removesuffix('.__init__'))
    try: return importlib.import_module(name)
    except Exception as e:
        failure(page, None, f'cannot import {name}: {type(e).__name__}: {e}')
        return None


# From processed notebooks to the pages nbconvert renders ----------------------------------------------------------

def _settings() -> configparser.SectionProxy:
    config = configparser.ConfigParser()
    config.read(ROOT / 'settings.ini')
    return config['DEFAULT']


DOC_URL = '{doc_host}{doc_baseurl}/'.format(**_settings())  # where nbdev's links point: the pages of this site
SITE_FILES = {'docs/architecture.md': 'architecture.html', 'docs/getting_started.md': 'getting_started.html'}
_FENCE = re.compile(r'(^\s*```.*?^\s*```[^\n]*$)', re.M | re.S)
_MD_LINK = re.compile(r'(\]\(\s*)([^)\s]+)')
_HTML_LINK = re.compile(r'(\b(?:href|src)=")([^"]+)')


class Site:
    "The pages and what a link may point to: page names, API anchors per page, files copied into the site"

    def __init__(self, pages: list, assets: set):
        self.pages, self.assets = pages, assets
        self.anchors = {p.name: p.anchors for p in pages}

    def resolve(self, url: str, page: Page, cell) -> str | None:
        "A relative link into the site for `url`, `url` itself if it leaves the site, None if it leads nowhere"
        generated = url.startswith(DOC_URL)
        if generated: url = url[len(DOC_URL) :]
        if re.match(r'^[a-z]+:', url) or url.startswith('#'): return url
        path, _, anchor = url.partition('#')
        path = re.sub(r'^(\./|\.\./)+', '', path)
        path = SITE_FILES.get(path, SITE_FILES.get(f'docs/{path}', path))
        if path.endswith('.ipynb'): path = 'overview.html' if path.endswith('index.ipynb') else page_name(Path(path))
        if path.startswith('docs/images/'): path = path.removeprefix('docs/')
        if path not in self.anchors and path not in self.assets:
            if not generated: failure(page, cell, f'the link to {url} leads to no page of the site')
            return None
        return path + self._anchor(path, anchor, generated)

    def _anchor(self, path: str, anchor: str, generated: bool) -> str:
        "nbdev links a method it has no entry for (no `show_doc`): point at its class's entry, else at the page"
        if not anchor or not generated or anchor in self.anchors.get(path, ()): return f'#{anchor}' if anchor else ''
        owner = anchor.rsplit('.', 1)[0]
        return f'#{owner}' if owner in self.anchors.get(path, ()) else ''

    def fix_links(self, markdown: str, page: Page, cell) -> str:
        "Every link of `markdown` (outside code blocks) made relative to the site; a dead one becomes its text"
        parts = _FENCE.split(markdown)
        for i in range(0, len(parts), 2):
            parts[i] = _MD_LINK.sub(lambda m: self._swap(m, page, cell), parts[i])
            parts[i] = re.sub(r'\[([^\]]*)\]\(\0\)', r'\1', parts[i])  # a dead link: its text
            parts[i] = _HTML_LINK.sub(lambda m: self._swap(m, page, cell, m.group(2)), parts[i])
        return ''.join(parts)

    def _swap(self, match, page: Page, cell, dead='\0') -> str:
        url = self.resolve(match.group(2), page, cell)
        return match.group(1) + (url if url is not None else dead)


_SOURCE_LINK = re.compile(r'^\[source\]\((\S+?)\)(\{[^}]*\})?\s*$', re.M)
_HEADING = re.compile(r'^(#{1,6})\s+(.+?)\s*$', re.M)
_LINKED_CODE = re.compile(r'\[(`[^`\n]*`)\]\([^)\s]*\)')


def api_entry(markdown: str) -> tuple:
    "(name, heading level, where its source is, body) of `show_doc`'s markdown"
    heading = _HEADING.search(markdown)
    source = _SOURCE_LINK.search(markdown)
    where = re.search(r'/blob/[^/]+/(.+?)(?:#L(\d+))?$', source.group(1)) if source else None
    where = f'{where.group(1)}, line {where.group(2)}' if where and where.group(2) else where and where.group(1)
    body = markdown[heading.end() :] if heading else markdown
    # nbdev links names inside the signature's code block too, where a link shows as markdown: keep the name only
    body = _FENCE.sub(lambda m: _LINKED_CODE.sub(r'\1', m.group(0)), body)
    return (heading.group(2) if heading else '?'), (len(heading.group(1)) if heading else 3), where or '', body


def _options(source: str) -> tuple:
    "The Quarto options (`#| key: value`) nbdev leaves at the top of a code cell, and the code after them"
    lines, options = source.splitlines(), {}
    while lines and re.match(r'\s*#\|\s*[\w-]+\s*:', lines[0]):
        key, _, value = lines.pop(0).split('|', 1)[1].partition(':')
        options[key.strip()] = value.strip().strip('"')
    return options, '\n'.join(lines)


def is_test(code: str) -> bool:
    "A cell that asserts (`assert`, fastcore's `test_*`) and prints or displays nothing: folded on the page"
    try: tree = ast.parse(code)
    except SyntaxError: return False
    calls = [n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    asserts = any(isinstance(n, ast.Assert) for n in ast.walk(tree)) or any(c.startswith('test_') for c in calls)
    return asserts and not {'print', 'display'} & set(calls)


def _entry_anchor(page: Page, name: str) -> str:
    "nbdev's anchor for an entry (its links use it): the name in lower case; made unique on the page"
    page.entries.add(name)
    anchor, n = name.lower(), 1
    while anchor in page.anchors:
        n += 1
        anchor = f'{name.lower()}-{n}'
    page.anchors.add(anchor)
    return anchor


def collect_entries(page: Page):
    "Turn each `show_doc` result (and each value entry) into an API entry cell; the page's anchors fill as they come"
    cells = []
    for cell in page.nb.cells:
        if cell.cell_type == 'raw' and cell.source.startswith('---'): continue
        if cell.cell_type == 'code' and show_doc_calls(_options(cell.source)[1]): cell = _show_doc_entry(page, cell)
        elif cell.metadata.get('docs_api'):
            cell.metadata['docs_api'].update(anchor=_entry_anchor(page, cell.metadata['docs_api']['name']), level=3)
        cells.append(cell)
    page.nb.cells = cells


def check_public_names(pages: list):
    "Every name of every exported module's `__all__` has an entry on some page (a face's may be its module's)"
    documented = set().union(*(p.entries for p in pages))
    for page in pages:
        missing = [n for n in getattr(page.module, '__all__', ()) if n not in documented]
        if missing: failure(page, None, f'public names without an API entry: {", ".join(missing)}')


def _show_doc_entry(page: Page, cell):
    "The entry a `show_doc` cell displayed; the cell itself (showing its error) if it displayed none"
    shown = [o for o in cell.get('outputs', []) if 'text/markdown' in o.get('data', {})]
    if not shown:
        if not any(o.get('output_type') == 'error' for o in cell.get('outputs', [])):
            failure(page, cell, f'{cell.source.strip()} displayed nothing')
        return cell
    markdown = ''.join(shown[-1]['data']['text/markdown'])
    name, level, where, body = api_entry(markdown)
    entry = mk_cell(body, 'markdown', metadata=dict(cell.metadata))
    entry.metadata['docs_api'] = {'name': name, 'anchor': _entry_anchor(page, name), 'level': level, 'source': where}
    return entry


def render_form(page: Page, site: Site, fold: bool = True) -> dict:
    "The page's notebook as nbconvert reads it: links fixed, options applied, tests marked to fold"
    cells = []
    for cell in page.nb.cells:
        if cell.cell_type == 'markdown': cells.append(_markdown(cell, page, site))
        elif cell.cell_type == 'code': cells.append(_code(cell, fold))
    for i, cell in enumerate(cells): cell['id'] = f'cell-{i}'  # nbformat wants one
    meta = {'kernelspec': {'name': 'python3', 'display_name': 'Python 3', 'language': 'python'},
            'language_info': {'name': 'python'}}
    return {'nbformat': 4, 'nbformat_minor': 5, 'metadata': meta, 'cells': cells}


def _markdown(cell, page: Page, site: Site) -> dict:
    meta = {k: v for k, v in cell.metadata.items() if k in ('docs_api', 'docs_cell')}
    return {'cell_type': 'markdown', 'metadata': meta, 'source': site.fix_links(cell.source, page, cell)}


SHOWN_OUTPUTS = ('stream', 'display_data', 'execute_result')  # a demo's saved outputs (tools/outputs.py writes them)


def _code(cell, fold: bool) -> dict:
    """A code cell with its options applied: `echo: false` hides the code, `code-fold` folds it, tests fold. A demo
    shows the outputs saved in the notebook; a cell that failed while the site was built shows only its error"""
    options, code = _options(cell.source)
    errors = [dict(o) for o in cell.get('outputs', []) if o.get('output_type') == 'error']
    meta = {'docs_lines': len(code.splitlines())}
    if options.get('echo') == 'false': meta['transient'] = {'remove_source': True}
    if options.get('code-fold'): meta['docs_role'] = 'exported'
    elif fold and is_test(code): meta['docs_role'] = 'test'
    shown = [] if meta.get('docs_role') else [_joined(o) for o in cell.get('outputs', [])
                                                if o.get('output_type') in SHOWN_OUTPUTS]
    if shown: meta['docs_role'] = 'demo'
    if errors: meta['docs_role'] = 'error'
    last = next((line.strip() for line in reversed(code.splitlines()) if line.strip()), '')
    if last: meta['alt'] = f'what {last[:100]} shows'  # an image output's alt, where the output gives none
    return {'cell_type': 'code', 'metadata': meta, 'source': code, 'outputs': errors or shown, 'execution_count': None}


_STYLE = re.compile(r'<style[^>]*>.*?</style>\s*', re.S | re.I)


def as_strings(output) -> dict:
    "An output with each text as one string: a notebook file may keep a multi-line text as a list of lines"
    join = lambda value: ''.join(value) if isinstance(value, list) else value
    output = {key: join(value) for key, value in output.items()}
    if 'data' in output: output['data'] = {mime: join(value) for mime, value in output['data'].items()}
    return output


def _joined(output) -> dict:
    "`as_strings`, and an HTML output without its own `<style>` (pandas adds one to a table; site.css draws tables)"
    output = as_strings(output)
    if 'text/html' in output.get('data', {}): output['data']['text/html'] = _STYLE.sub('', output['data']['text/html'])
    return output


# The site's own pages, the sidebar, and writing it all ------------------------------------------------------------

def markdown_page(path: Path, name: str) -> Page:
    "A page from a markdown file: its `# Title` line titles it, the rest is one markdown cell"
    text = path.read_text()
    title = re.search(r'^#\s+(.+?)\s*$', text, re.M)
    body = text[title.end() :] if title else text
    page = Page(name, title.group(1) if title else path.stem, source=path)
    page.nb = markdown_nb(body)
    return page


def markdown_nb(markdown: str) -> AttrDict:
    "A processed notebook's stand-in: one markdown cell"
    return AttrDict(cells=[mk_cell(markdown, 'markdown', metadata=AttrDict())])


FACE = " (the wing's face)"


def contents_page(wings: list) -> Page:
    "index.html: what flexrt is, where to start, and every page by wing with its one-line summary"
    start = ('Start with [Getting started](getting_started.html); [Architecture](architecture.html) maps the layers '
             'and contracts; [Overview](overview.html) is the README. Each notebook of `nbs/` is one page below, '
             'grouped by wing (the `NN` of `nbs/NN_wing_module.ipynb` orders the layers, bottom up).')
    lines = [_settings()['description'] + '.', '', start]
    for wing in wings:
        lines += ['', f'## {wing["label"]}', '']
        lines += [f'- [{p.title}]({p.name}){FACE if p.face else ""}: {p.description}' for p in wing['pages']]
    page = Page('index.html', 'flexrt documentation')
    page.nb = markdown_nb('\n'.join(lines))
    return page


def group_wings(pages: list) -> list:
    "The notebook pages by wing, wings in the order of their first notebook, each wing's face first"
    wings = {}
    for page in pages:
        if page.wing: wings.setdefault(page.wing, []).append(page)
    return [{'key': k, 'label': wing_label(k), 'pages': sorted(ps, key=lambda p: not p.face)} 
            for k, ps in wings.items()]


def wing_map_anchors(architecture_html: str) -> dict:
    "wing key -> id of its section on the architecture page (`### `flexrt.zero` (50) ...`)"
    found = {}
    for anchor, text in re.findall(r'<h3 id="([^"]+)">(.*?)</h3>', architecture_html):
        for wing in re.findall(r'<code>flexrt\.(\w+)</code>', text): found.setdefault(wing, anchor)
        if 'top level' in text: found.setdefault('flexrt', anchor)
    return found


def inline_markdown(text: str) -> str:
    "HTML for a line of markdown (a title, a summary) without its paragraph"
    return re.sub(r'^<p>|</p>\s*$', '', markdown2html_mistune(text).strip())


_HEADING_ID = re.compile(r'<h([1-6]) id="[^"]*">(.*?)<a class="anchor-link" href="#[^"]*">', re.S)


def pandoc_id(heading_html: str) -> str:
    "The id Quarto (Pandoc) gives a heading, which a notebook's `[...](#the-contract)` assumes"
    text = html.unescape(re.sub(r'<[^>]+>', '', heading_html)).lower()
    text = re.sub(r'\s+', '-', re.sub(r'[^\w\s.-]', '', text).strip())
    return re.sub(r'^[\W\d_]+', '', text) or 'section'


def _quarto_heading(match) -> str:
    level, text, anchor = match[1], match[2], pandoc_id(match[2])
    return f'<h{level} id="{anchor}">{text}<a class="anchor-link" href="#{anchor}">'


class SiteExporter(HTMLExporter):
    "nbconvert's HTML exporter, its headings' ids as Quarto makes them"

    @pass_context
    def markdown2html(self, context, source):
        return _HEADING_ID.sub(_quarto_heading, super().markdown2html(context, source))

    def from_notebook_node(self, nb, resources=None, **kw):
        """`HTMLExporter.from_notebook_node` without its last pass, a BeautifulSoup parse and rewrite of the whole page
        (two thirds of the build's time: 61 s against 19 s) that gives images without an `alt` a placeholder and
        JupyterLab-template cells a `tabindex`: here every demo cell gives its images an `alt` (`_code`;
        tests/test_docs.py checks every page), and the classic template has no such cells"""
        info = nb.metadata.get('language_info', {})
        lexer = info.get('pygments_lexer', info.get('name', None))
        highlight = self.filters.get('highlight_code', Highlight2HTML(pygments_lexer=lexer, parent=self))
        self.register_filter('highlight_code', highlight)
        resources = self._init_resources(resources)
        self.register_filter('filter_data_type', WidgetsDataTypeFilter(notebook_metadata=self._nb_metadata, parent=self,
                                                                       resources=resources))
        return TemplateExporter.from_notebook_node(self, nb, resources, **kw)


def exporter() -> SiteExporter:
    return SiteExporter(template_name='flexrt', extra_template_basedirs=[str(TEMPLATES)], exclude_input_prompt=True,
                        exclude_output_prompt=True)


def site_resources(wings: list, extras: list) -> dict:
    "What every page shows around its cells: the header's links, the sidebar's wings and pages"
    pages = lambda w: [{'name': p.name, 'title_html': inline_markdown(p.title), 'face': p.face} for p in w['pages']]
    return {'extras': [{'name': p.name, 'label': p.label} for p in extras],
            'wings': [{'key': w['key'], 'label': w['label'], 'pages': pages(w)} for w in wings]}


def page_resources(page: Page, site: dict, wing_map: dict) -> dict:
    "What the template reads besides the cells: the page's title and summary, the site around it, its wing's map"
    info = {'name': page.name, 'title_html': inline_markdown(page.title), 'title_text': page.title.replace('`', ''),
            'description_html': inline_markdown(page.description) if page.description else '', 'wing': page.wing,
            'wing_label': wing_label(page.wing) if page.wing else '', 'map_anchor': wing_map.get(page.wing, '')}
    return {'page': info, 'site': site}


def write_assets(out: Path) -> set:
    "The stylesheet (ours, then Pygments' colours for code) and the README's pictures; returns their site paths"
    css = (TEMPLATES / 'site.css').read_text() + '\n/* code colours: Pygments */\n'
    (out / 'site.css').write_text(css + HtmlFormatter(style='default').get_style_defs('.highlight') + '\n')
    shutil.copytree(DOCS / 'images', out / 'images')
    return {'site.css'} | {f'images/{p.name}' for p in (out / 'images').iterdir()}


def process_notebooks() -> list:
    "Every notebook of nbs/ processed, in nbs/ as nbdev_test runs them, with IN_TEST set as nbdev's docs step sets it"
    here, in_test = os.getcwd(), os.environ.get('IN_TEST')
    os.environ['IN_TEST'] = '1'
    os.chdir(NBS)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            return [process(path) for path in sorted(NBS.glob('*.ipynb'))]
    finally:
        os.chdir(here)
        if in_test is None: del os.environ['IN_TEST']
        else: os.environ['IN_TEST'] = in_test


def prepare_out(out: Path):
    "An empty `out`: one this builder wrote before is replaced, any other non-empty folder is refused"
    if out.exists() and any(out.iterdir()):
        if not (out / '.flexrt-docs').exists(): raise SystemExit(f'{out} is not empty, and not a site this wrote')
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / '.flexrt-docs').write_text('written by tools/docs.py; `make docs` replaces this folder\n')


def build(out: Path) -> tuple:
    "Write the site into `out`; returns (pages, failures)"
    notebook_pages = process_notebooks()
    wings = group_wings(notebook_pages)
    extras = [contents_page(wings), markdown_page(DOCS / 'getting_started.md', 'getting_started.html'),
              markdown_page(DOCS / 'architecture.md', 'architecture.html')]
    extras += [p for p in notebook_pages if not p.wing]
    for page, label in zip(extras, ('Contents', 'Getting started', 'Architecture', 'Overview')): page.label = label
    pages = extras + [p for p in notebook_pages if p.wing]
    prepare_out(out)
    site = Site(pages, write_assets(out))
    for page in pages: collect_entries(page)
    check_public_names(pages)
    to_html, around, wing_map = exporter(), site_resources(wings, extras), {}
    for page in pages:  # the architecture page comes before the pages that link into it
        nb = nbformat.from_dict(render_form(page, site, fold=bool(page.wing)))
        body, _ = to_html.from_notebook_node(nb, resources=page_resources(page, around, wing_map))
        if page.name == 'architecture.html': wing_map = wing_map_anchors(body)
        (out / page.name).write_text(body)
    return pages, [f for p in pages for f in p.failures]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--out', type=Path, default=ROOT / '_docs', help='where to write the site (default: _docs/)')
    args = parser.parse_args(argv)
    start = time.perf_counter()
    pages, failures = build(args.out.resolve())
    seconds = time.perf_counter() - start
    entries = sum(len(p.anchors) for p in pages)
    print(f'docs: {len(pages)} pages, {entries} API entries, written to {args.out} in {seconds:.0f} s')
    if failures:
        print(f'docs: FAILED, {len(failures)} problem(s):\n' + '\n\n'.join(failures), file=sys.stderr)
        return 1
    print(f'docs: open {args.out / "index.html"}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
