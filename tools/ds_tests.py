"""Run DeepSpeed's own unit tests with flexrt in DeepSpeed's place (`use_as_deepspeed()`), printing pass/fail/skip per file.

    python tools/ds_tests.py /path/to/DeepSpeed [tests/unit/x.py ...]

Nothing is fetched: the DeepSpeed checkout is read where it is, and its code is never imported (the `deepspeed` in
`sys.modules` is flexrt's module tree, registered by the `ds_plugin` pytest plugin before collection, and in every
rank the harness starts by `tools/ds_shim/deepspeed`, first on PYTHONPATH)."""
import argparse, os, subprocess, sys, tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILES = ('tests/unit/runtime/test_lr_schedulers.py', 'tests/unit/runtime/test_runtime_utils.py', 'tests/unit/comm/test_dist.py',
         'tests/unit/checkpoint/test_latest_checkpoint.py', 'tests/unit/runtime/zero/test_zero_config.py')

def counts(junit:Path)->dict:
    "passed/failed/skipped (errors count as failed) from a junit XML report, and the names of the failing tests"
    out, failing = {'passed': 0, 'failed': 0, 'skipped': 0}, []
    for case in ET.parse(junit).getroot().iter('testcase'):
        tags = {c.tag for c in case}
        kind = 'failed' if tags & {'failure', 'error'} else 'skipped' if 'skipped' in tags else 'passed'
        out[kind] += 1
        if kind == 'failed': failing.append(case.get('name'))
    return {**out, 'failing': failing}

def run_file(ds:Path, test:str, timeout:int, ranks:int=4)->dict:
    "Run one DeepSpeed test file under pytest with flexrt as deepspeed; its counts"
    env = {**os.environ, 'DS_ACCELERATOR': 'cpu', 'PYTHONPATH': os.pathsep.join([str(ROOT / 'tools' / 'ds_shim'), str(ROOT), str(ROOT / 'tools'), os.environ.get('PYTHONPATH', '')]),
           'DS_UNITTEST_TIMEOUT': str(timeout), 'CUDA_VISIBLE_DEVICES': '',
           'LOCAL_SIZE': str(ranks)}   # DeepSpeed's CPU accelerator counts LOCAL_SIZE devices: tests for up to `ranks` ranks run
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / 'junit.xml'
        cmd = [sys.executable, '-m', 'pytest', '-p', 'ds_plugin', '-p', 'no:cacheprovider', '-q', '-rfE', '--tb=line',
               f'--junitxml={junit}', '--rootdir', str(ds / 'tests'), test]
        try: proc = subprocess.run(cmd, cwd=ds / 'tests', env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired: return {'passed': 0, 'failed': 0, 'skipped': 0, 'failing': [f'timed out after {timeout}s'], 'log': ''}
        log = proc.stdout + proc.stderr
        if not junit.exists(): return {'passed': 0, 'failed': 0, 'skipped': 0, 'failing': ['pytest wrote no report'], 'log': log}
        return {**counts(junit), 'log': log}

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('deepspeed', type=Path, help='a DeepSpeed checkout (its tests/ folder is used)')
    p.add_argument('files', nargs='*', default=FILES, help='test files, relative to the checkout')
    p.add_argument('--timeout', type=int, default=900, help='seconds per file')
    p.add_argument('--ranks', type=int, default=4, help='most ranks a test may use (CPU devices DeepSpeed sees)')
    p.add_argument('-v', '--verbose', action='store_true', help="print each file's pytest output")
    a = p.parse_args(argv)
    ds = a.deepspeed.resolve()
    if not (ds / 'tests' / 'unit' / 'common.py').is_file(): p.error(f'{ds} is not a DeepSpeed checkout (no tests/unit/common.py)')
    rows = []
    for f in a.files:
        r = run_file(ds, str(ds / f), a.timeout, a.ranks)
        rows.append((f, r))
        if a.verbose: print(r['log'])
        print(f"{f:55s} pass {r['passed']:4d}  fail {r['failed']:4d}  skip {r['skipped']:4d}", flush=True)
        for name in r['failing']: print(f"    failing: {name}")
    total = {k: sum(r[k] for _, r in rows) for k in ('passed', 'failed', 'skipped')}
    print(f"{'total':55s} pass {total['passed']:4d}  fail {total['failed']:4d}  skip {total['skipped']:4d}")
    return 1 if total['failed'] else 0

if __name__ == '__main__': sys.exit(main())
