"""Fail when `nbdev_clean` + `nbdev_export` would change `nbs/` or `flexrt/`: the notebooks are the source.

README.md is generated from nbs/index.ipynb (tools/readme.py) and checked the same way.
Compares the tree before and after running both, so it works on a clean clone (CI) and in a working copy alike.
New files (a module a notebook exports that was never committed) and deleted files count as changes too.
"""
import hashlib, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WATCHED = ('nbs', 'flexrt', 'README.md')

def snapshot():
    files = {}
    for top in WATCHED:
        paths = [ROOT / top] if (ROOT / top).is_file() else sorted((ROOT / top).rglob('*'))
        for p in paths:
            if p.is_file() and '__pycache__' not in p.parts and '.ipynb_checkpoints' not in p.parts:
                files[str(p.relative_to(ROOT))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return files

def main():
    before = snapshot()
    bindir = Path(sys.executable).parent
    for cmd in ('nbdev_clean', 'nbdev_export'):
        subprocess.run([str(bindir / cmd)], cwd=ROOT, check=True)
    subprocess.run([sys.executable, str(ROOT / 'tools' / 'readme.py')], cwd=ROOT, check=True)
    after = snapshot()
    changed = sorted(k for k in before.keys() & after.keys() if before[k] != after[k])
    added, removed = sorted(after.keys() - before.keys()), sorted(before.keys() - after.keys())
    if changed or added or removed:
        for label, names in (('changed', changed), ('created', added), ('removed', removed)):
            for n in names: print(f'  {label}: {n}')
        print('Notebooks and package disagree: nbdev_clean + nbdev_export changed the files above. '
              'They are now regenerated; review and commit nbs/, flexrt/ and README.md together.')
        return 1
    print(f'nbs/ and flexrt/ agree ({len(after)} files).')
    return 0

if __name__ == '__main__':
    sys.exit(main())
