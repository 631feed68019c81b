"""Save what the notebooks' demo cells show (`make outputs`): the docs site renders it, and so does any notebook viewer.

Each notebook runs as `make nbtest` runs it (execnb's shell in nbs/, IN_TEST set, cells flagged `slow` skipped,
`multiproc` ones run), in a fresh process, two notebooks at a time. A notebook that fails is reported and left as it
was.

A code cell keeps its outputs when it is a demo (`is_demo`): not exported, not hidden, not a test (it asserts and prints
nothing: tools/docs.py folds those), not an API entry (`show_doc`), not `#| output: false`. Of what it showed, kept are
stdout, and results and displays as PNG, markdown, HTML without a script, or text; dropped are stderr (warnings and
launch logs), widgets (their state lives in a kernel, not in the file), and nothing else is kept of a failed cell. A
stream keeps its first `MAX_LINES` lines, ANSI colours removed. Every other cell's outputs are cleared, so a notebook's
saved outputs are exactly its demos' latest run. The notebook is then written as nbdev_clean writes it.

    python tools/outputs.py [NOTEBOOK ...] [--jobs N]      # no notebook: every one in nbs/
"""

import argparse, ast, json, os, re, subprocess, sys, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NBS = ROOT / 'nbs'
sys.path.insert(0, str(ROOT / 'tools'))
from docs import is_test, show_doc_calls  # noqa: E402  (the docs site's own rules: a folded test, an API entry)
from execnb.nbio import mk_cell  # noqa: E402
from nbdev.process import extract_directives  # noqa: E402

MAX_LINES = 40  # a longer stream is cut, saying how many lines it had
MAX_CHARS = 60_000  # a bigger HTML, markdown or PNG (base64) output is left out, saying so
RUN_FLAGS = ('multiproc',)  # the flags `make nbtest` passes; `slow` cells stay skipped
_ANSI = re.compile(r'\x1b\[[0-9;]*[A-Za-z]')
_KEPT_MIMES = ('image/png', 'text/markdown', 'text/html', 'text/plain')  # first found wins


def is_demo(cell: dict) -> bool:
    "Whether a code cell's outputs teach (see the module's docstring)"
    if cell.get('cell_type') != 'code':
        return False
    source = ''.join(cell.get('source', ''))
    marks = extract_directives(mk_cell(source), remove=False)  # nbdev's reading of the `#| ...` lines
    if {'export', 'exports', 'exporti', 'hide'} & set(marks) or 'nbdev_export' in source:
        return False
    if any([v.lower() for v in marks.get(key, [])] == ['false'] for key in ('output:', 'eval:')):
        return False
    code = '\n'.join(line for line in source.splitlines() if not line.lstrip().startswith('#|'))
    try:
        body = ast.parse(code).body
    except SyntaxError:
        return False
    return bool(body) and not show_doc_calls(code) and not is_test(code)


def kept(outputs: list) -> list:
    "The outputs worth saving, trimmed (see the module's docstring)"
    saved = []
    for out in outputs:
        kind = out.get('output_type')
        if kind == 'stream' and out.get('name') == 'stdout':
            text = _ANSI.sub('', ''.join(out.get('text', '')))
            if saved and saved[-1]['output_type'] == 'stream':
                saved[-1]['text'] += text
            else:
                saved.append({'name': 'stdout', 'output_type': 'stream', 'text': text})
        elif kind in ('execute_result', 'display_data'):
            data = out.get('data', {})
            if any('widget' in mime for mime in data):
                continue
            mime = next((m for m in _KEPT_MIMES if m in data), None)
            if mime is None:
                continue
            value = data[mime] if isinstance(data[mime], str) else ''.join(data[mime])
            if mime == 'text/html' and '<script' in value.lower():
                mime, value = 'text/plain', _text(data)
            if len(value) > MAX_CHARS:
                mime, value = 'text/plain', f'({mime}, {len(value):,} characters: left out)'
            entry = {'data': {mime: value}, 'metadata': {}, 'output_type': kind}
            if kind == 'execute_result':
                entry['execution_count'] = None
            saved.append(entry)
    for out in saved:
        if out['output_type'] == 'stream':
            out['text'] = _cut(out['text'])
    return [o for o in saved if o['output_type'] != 'stream' or o['text'].strip()]


def _text(data: dict) -> str:
    value = data.get('text/plain', '')
    return value if isinstance(value, str) else ''.join(value)


def _cut(text: str) -> str:
    lines = text.splitlines(keepends=True)
    if len(lines) <= MAX_LINES:
        return text
    return ''.join(lines[:MAX_LINES]) + f'... ({len(lines) - MAX_LINES} more lines)\n'


def run_one(path: Path) -> int:
    "Run one notebook as nbdev_test does and save its demos' outputs; in the process `main` starts for it"
    from execnb.shell import CaptureShell
    from nbdev.process import NBProcessor
    from nbdev.processors import FrontmatterProc

    os.environ['IN_TEST'] = '1'
    nb = NBProcessor(path, procs=FrontmatterProc, process=True).nb
    if str(nb.get('frontmatter_', {}).get('skip_exec', '')).lower() == 'true':
        return 0

    def skip(cell):
        if cell.cell_type != 'code' or 'nbdev_export' + '(' in cell.source:
            return True
        marks = getattr(cell, 'directives_', {}) or {}
        if marks.get('eval:', [''])[0].lower() == 'false':
            return True
        return bool({'slow'} & set(marks) - set(RUN_FLAGS))

    shell = CaptureShell(path)
    here = os.getcwd()
    os.chdir(path.parent)
    try:
        shell.run_all(nb, exc_stop=True, preproc=skip)
    except BaseException:
        sys.stderr.write(shell.prettytb(fname=path) + '\n')
        return 1
    finally:
        os.chdir(here)
    ran = {cell.idx_: cell.get('outputs', []) for cell in nb.cells if cell.cell_type == 'code'}
    saved = json.loads(path.read_text())  # the file as it is: only outputs change (nbdev_clean's JSON layout)
    for i, cell in enumerate(saved['cells']):
        if cell['cell_type'] == 'code':
            cell['outputs'] = kept(ran.get(i, [])) if is_demo(cell) else []
    path.write_text(json.dumps(saved, sort_keys=True, indent=1, ensure_ascii=False) + '\n')
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('notebooks', nargs='*', type=Path, help='default: every notebook of nbs/ but index.ipynb')
    parser.add_argument('--jobs', type=int, default=2, help='notebooks run at once (default 2)')
    parser.add_argument('--one', type=Path, help=argparse.SUPPRESS)  # the process that runs one notebook
    args = parser.parse_args(argv)
    if args.one:
        return run_one(args.one.resolve())
    paths = [p.resolve() for p in args.notebooks] or sorted(p for p in NBS.glob('*.ipynb') if p.name != 'index.ipynb')
    missing = [str(p) for p in paths if not p.is_file() or p.suffix != '.ipynb']
    if missing:
        parser.error(f'not a notebook: {", ".join(missing)} (give paths like nbs/20_utils_core.ipynb)')
    start, failed = time.perf_counter(), []

    def one(path):
        began = time.perf_counter()
        done = subprocess.run([sys.executable, __file__, '--one', str(path)], capture_output=True, text=True)
        print(
            f'{path.name}: {"ok" if done.returncode == 0 else "FAILED"} ({time.perf_counter() - began:.0f} s)',
            flush=True,
        )
        if done.returncode:
            failed.append((path.name, done.stderr[-3000:]))

    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(one, paths))
    for path in paths:
        subprocess.run([str(Path(sys.executable).parent / 'nbdev_clean'), '--fname', str(path)], check=True)
    print(f'outputs: {len(paths) - len(failed)} of {len(paths)} notebooks saved in {time.perf_counter() - start:.0f} s')
    for name, err in failed:
        print(f'\n{name} failed, left as it was:\n{err}', file=sys.stderr)
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
