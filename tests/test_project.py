"The set-up contract's guards: notebooks and package must agree, and README.md must be generated from index.ipynb."
import json, shutil, subprocess, sys
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parent.parent

@pytest.fixture
def tree(tmp_path):
    "A throw-away copy of what the sync check reads, so the test can break it."
    for name in ('nbs', 'flexrt', 'tools'): shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns('__pycache__'))
    for name in ('settings.ini', 'README.md', 'setup.py'): shutil.copy(ROOT / name, tmp_path / name)
    return tmp_path

def check(tree):
    return subprocess.run([sys.executable, str(tree / 'tools' / 'check_sync.py')], cwd=tree, capture_output=True, text=True)

def first_export_cell(nb):
    return next(c for c in nb['cells'] if c['cell_type'] == 'code' and ''.join(c['source']).startswith('#| export'))

def test_sync_check_passes_on_the_repo(tree):
    r = check(tree)
    assert r.returncode == 0, r.stdout + r.stderr

def test_sync_check_catches_an_unexported_edit(tree):
    path = next(p for p in sorted((tree / 'nbs').glob('[0-9]*.ipynb')))
    nb = json.loads(path.read_text())
    cell = first_export_cell(nb)
    cell['source'] = ''.join(cell['source']) + '\n_sync_probe = 1'
    path.write_text(json.dumps(nb, indent=1))
    r = check(tree)
    assert r.returncode == 1 and 'changed: flexrt/' in r.stdout, r.stdout

def test_sync_check_catches_a_new_module(tree):
    nb = json.loads(next((tree / 'nbs').glob('[0-9]*.ipynb')).read_text())
    nb['cells'] = [{'cell_type': 'code', 'execution_count': None, 'id': 'a0', 'metadata': {}, 'outputs': [],
                    'source': '#| default_exp sync_probe'},
                   {'cell_type': 'code', 'execution_count': None, 'id': 'a1', 'metadata': {}, 'outputs': [],
                    'source': '#| export\ndef probe(): return 1'}]
    (tree / 'nbs' / '99_sync_probe.ipynb').write_text(json.dumps(nb, indent=1))
    r = check(tree)
    assert r.returncode == 1 and 'created: flexrt/sync_probe.py' in r.stdout, r.stdout

def test_readme_is_generated_from_index(tree):
    (tree / 'README.md').write_text('hand-edited\n')
    r = check(tree)
    assert r.returncode == 1 and 'changed: README.md' in r.stdout, r.stdout
