"""Write README.md from nbs/index.ipynb (nbdev's readme step without quarto).

Markdown cells are copied as they are; code cells become ```python blocks (their text outputs, if saved, follow as
plain blocks); cells starting with `#| hide` are left out. `python tools/readme.py` writes; `--check` only reports.
"""
import sys
from pathlib import Path
import nbformat

ROOT = Path(__file__).resolve().parent.parent

def render(nb) -> str:
    parts = []
    for cell in nb.cells:
        src = cell.source.strip()
        if not src or src.startswith('#| hide'): continue
        if cell.cell_type == 'markdown': parts.append(src)
        elif cell.cell_type == 'code':
            code = '\n'.join(l for l in src.splitlines() if not l.startswith('#|'))
            parts.append(f'```python\n{code}\n```')
            text = ''.join(o.get('text', '') for o in cell.get('outputs', []) if o.get('output_type') == 'stream')
            if text.strip(): parts.append(f'```\n{text.rstrip()}\n```')
    return '<!-- generated from nbs/index.ipynb by tools/readme.py: edit the notebook, not this file -->\n\n' + \
           '\n\n'.join(parts) + '\n'

def main(check=False) -> int:
    "Write README.md (or with `check`, return 1 when it is out of date)"
    text = render(nbformat.read(ROOT / 'nbs' / 'index.ipynb', as_version=4))
    readme = ROOT / 'README.md'
    stale = not readme.exists() or readme.read_text() != text
    if stale and not check: readme.write_text(text)
    return int(stale and check)

if __name__ == '__main__':
    sys.exit(main(check='--check' in sys.argv))
