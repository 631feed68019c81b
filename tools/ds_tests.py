"""Run DeepSpeed's own unit tests with flexrt in DeepSpeed's place (`use_as_deepspeed()`), printing pass/fail/skip per file.

    python tools/ds_tests.py /path/to/DeepSpeed [tests/unit/x.py ...]            # flexrt as deepspeed
    python tools/ds_tests.py /path/to/DeepSpeed --real                           # the installed DeepSpeed itself
    python tools/ds_tests.py /path/to/DeepSpeed --compare [--markdown]           # both, file by file, on this machine
    python tools/ds_tests.py /path/to/DeepSpeed --real --json ds.json            # DeepSpeed once, kept ...
    python tools/ds_tests.py /path/to/DeepSpeed --compare --against ds.json      # ... and flexrt compared with it

Nothing is fetched: the DeepSpeed checkout is read where it is, and its code is never imported under flexrt (the
`deepspeed` in `sys.modules` is flexrt's module tree, registered by the `ds_plugin` pytest plugin before collection,
and in every rank the harness starts by `tools/ds_shim/deepspeed`, first on PYTHONPATH). With `--real` the same
files run against the DeepSpeed installed in this Python (no plugin, no shim). `--compare` runs each file both
ways and lists every test DeepSpeed passes and flexrt does not: each is a bug or a gap the README names."""
import argparse, json, os, subprocess, sys, tempfile, time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILES = tuple(f'tests/unit/{f}' for f in (   # the 17 files flexrt is measured on (issue #25)
    'runtime/test_runtime_utils.py', 'runtime/utils/test_partition.py', 'utils/test_partition_balanced.py',
    'comm/test_comms_logger.py', 'comm/test_dist.py', 'runtime/test_ds_config_dict.py', 'runtime/zero/test_zero_config.py',
    'runtime/half_precision/test_dynamic_loss_scale.py', 'v1/half_precision/test_gradient_clipping_default.py',
    'checkpoint/test_latest_checkpoint.py', 'checkpoint/test_tag_validation.py', 'runtime/test_ds_initialize.py',
    'runtime/test_lr_schedulers.py', 'checkpoint/test_zero_optimizer.py', 'checkpoint/test_other_optimizer.py',
    'checkpoint/test_lr_scheduler.py', 'v1/zero/test_zero.py'))
KINDS = ('passed', 'failed', 'skipped')

def outcomes(junit:Path)->dict:
    "{test id: 'passed' | 'failed' | 'skipped'} from a junit XML report (errors count as failed)"
    out = {}
    for case in ET.parse(junit).getroot().iter('testcase'):
        tags = {c.tag for c in case}
        kind = 'failed' if tags & {'failure', 'error'} else 'skipped' if 'skipped' in tags else 'passed'
        name = f"{case.get('classname', '').rpartition('.')[2]}::{case.get('name')}".lstrip(':')
        out[name] = 'failed' if out.get(name) == 'failed' else kind   # a test failing at setup and at teardown is one failure
    return out

def counts(results:dict)->dict:
    "passed/failed/skipped counts of a {test: outcome} dict"
    return {k: sum(v == k for v in results.values()) for k in KINDS}

def run_file(ds:Path, test:str, timeout:int, ranks:int=4, real:bool=False, test_timeout:int=300)->dict:
    "Run one DeepSpeed test file under pytest, with flexrt as deepspeed (or the installed DeepSpeed if `real`): {'tests': {id: outcome}, 'log', 'error'}"
    shim = [] if real else [str(ROOT / 'tools' / 'ds_shim'), str(ROOT), str(ROOT / 'tools')]
    harness = [str(ROOT / 'tools' / 'ds_harness')]   # a rank failing through pytest is reported, not a hung pool (both ways)
    env = {**os.environ, 'DS_ACCELERATOR': 'cpu', 'PYTHONPATH': os.pathsep.join(harness + shim + [os.environ.get('PYTHONPATH', '')]),
           'DS_UNITTEST_TIMEOUT': str(test_timeout), 'CUDA_VISIBLE_DEVICES': '',   # a distributed test whose ranks die or hang fails after this
           'LOCAL_SIZE': str(ranks)}   # DeepSpeed's CPU accelerator counts LOCAL_SIZE devices: tests for up to `ranks` ranks run
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / 'junit.xml'
        cmd = [sys.executable, '-m', 'pytest', *([] if real else ['-p', 'ds_plugin']), '-p', 'no:cacheprovider', '-q', '-rfE',
               '--tb=short', f'--junitxml={junit}', '--rootdir', str(ds / 'tests'), test]
        try: proc = subprocess.run(cmd, cwd=ds / 'tests', env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired: return {'tests': {}, 'log': '', 'error': f'timed out after {timeout}s'}
        log = proc.stdout + proc.stderr
        if not junit.exists(): return {'tests': {}, 'log': log, 'error': 'pytest wrote no report'}
        tests = outcomes(junit)
        return {'tests': tests, 'log': log, 'error': None if tests or proc.returncode in (0, 5) else f'pytest exited {proc.returncode}, no test ran'}

def row(name:str, c:dict)->str: return f"{name:55s} pass {c['passed']:4d}  fail {c['failed']:4d}  skip {c['skipped']:4d}"

def _dump(path:Path|None, ways:dict):
    "Write every test's outcome so far (per way, per file) to `path`"
    if path: path.write_text(json.dumps({w: {f: {k: r[k] for k in ('tests', 'error', 'seconds')} for f, r in res.items()} for w, res in ways.items()}, indent=1))

def run_all(ds:Path, files, a, real:bool, ways:dict)->dict:
    "Run `files` one way, printing a line per file (and keeping `--json` up to date); {file: result}"
    out = ways.setdefault('deepspeed' if real else 'flexrt', {})
    for f in files:
        start = time.time()
        r = run_file(ds, str(ds / f), a.timeout, a.ranks, real, a.test_timeout)
        r['seconds'] = round(time.time() - start, 1)
        out[f] = r
        if a.verbose: print(r['log'])
        _dump(a.json, ways)
        print(row(f, counts(r['tests'])) + f"  ({r['seconds']:.0f} s)", flush=True)
        if r['error']: print(f"    error: {r['error']}")
        if not a.compare:
            for name, kind in r['tests'].items():
                if kind == 'failed': print(f"    failing: {name}")
    return out

def markdown(files, real:dict, flex:dict, ranks:int)->str:
    "The README's table: real DeepSpeed and flexrt, per file, and the tests DeepSpeed passes that flexrt does not"
    lines = [f'| file (tests/unit/) | DeepSpeed pass / fail / skip | flexrt pass / fail / skip | DeepSpeed passes, flexrt does not |', '|---|---|---|---|']
    tot = {w: dict.fromkeys(KINDS, 0) for w in ('ds', 'fx')}
    missed = 0
    for f in files:
        d, x = counts(real[f]['tests']), counts(flex[f]['tests'])
        gap = sum(1 for t, k in real[f]['tests'].items() if k == 'passed' and flex[f]['tests'].get(t) != 'passed')
        missed += gap
        for k in KINDS: tot['ds'][k] += d[k]; tot['fx'][k] += x[k]
        fmt = lambda c: f"{c['passed']} / {c['failed']} / {c['skipped']}"
        lines.append(f"| `{f.removeprefix('tests/unit/')}` | {fmt(d)} | {fmt(x)} | {gap} |")
    fmt = lambda c: f"**{c['passed']} / {c['failed']} / {c['skipped']}**"
    lines.append(f"| **all {len(files)} files, {ranks} ranks** | {fmt(tot['ds'])} | {fmt(tot['fx'])} | **{missed}** |")
    return '\n'.join(lines)

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('deepspeed', type=Path, help='a DeepSpeed checkout (its tests/ folder is used)')
    p.add_argument('files', nargs='*', default=FILES, help='test files, relative to the checkout')
    p.add_argument('--timeout', type=int, default=3600, help='seconds per file')
    p.add_argument('--test-timeout', type=int, default=300, help="seconds one distributed test may take (DeepSpeed's DS_UNITTEST_TIMEOUT)")
    p.add_argument('--ranks', type=int, default=4, help='most ranks a test may use (CPU devices DeepSpeed sees)')
    p.add_argument('--real', action='store_true', help='run the files against the installed DeepSpeed, not flexrt')
    p.add_argument('--compare', action='store_true', help='run each file under the installed DeepSpeed and under flexrt')
    p.add_argument('--against', type=Path, help="with --compare: DeepSpeed's outcomes from an earlier `--real --json FILE` run on this machine, instead of running it again")
    p.add_argument('--markdown', action='store_true', help='with --compare: print the per-file table as markdown')
    p.add_argument('--json', type=Path, help="write every test's outcome (per way, per file) to this file")
    p.add_argument('-v', '--verbose', action='store_true', help="print each file's pytest output")
    a = p.parse_intermixed_args(argv)
    ds = a.deepspeed.resolve()
    if not (ds / 'tests' / 'unit' / 'common.py').is_file(): p.error(f'{ds} is not a DeepSpeed checkout (no tests/unit/common.py)')
    if a.real or a.compare:
        try: import importlib.metadata as md; print(f"real DeepSpeed: {md.version('deepspeed')}")
        except Exception: p.error('--real/--compare need DeepSpeed installed in this Python (pip install deepspeed)')
    ways = {}
    if a.against:
        saved = json.loads(a.against.read_text())['deepspeed']
        missing = [f for f in a.files if f not in saved]
        if missing: p.error(f'{a.against} has no DeepSpeed results for {missing}')
        ways['deepspeed'] = {f: {**saved[f], 'log': ''} for f in a.files}
        print(f'== the installed DeepSpeed: from {a.against} ==')
        for f in a.files: print(row(f, counts(saved[f]['tests'])) + f"  ({saved[f]['seconds']:.0f} s)")
    elif a.real or a.compare: print('== the installed DeepSpeed =='); run_all(ds, a.files, a, True, ways)
    if not a.real: print('== flexrt as deepspeed =='); run_all(ds, a.files, a, False, ways)
    for way, res in ways.items():
        total = counts({f'{f}::{t}': k for f, r in res.items() for t, k in r['tests'].items()})
        print(row(f'total ({way})', total))
    if not a.compare: return 1 if any(r['error'] or 'failed' in r['tests'].values() for r in next(iter(ways.values())).values()) else 0
    real, flex = ways['deepspeed'], ways['flexrt']
    missed = [(f, t, flex[f]['tests'].get(t, 'not run')) for f in a.files for t, k in real[f]['tests'].items()
              if k == 'passed' and flex[f]['tests'].get(t) != 'passed']
    print(f'\n{len(missed)} tests pass on DeepSpeed and not on flexrt:')
    for f, t, k in missed: print(f'    {k:8s} {f.removeprefix("tests/unit/")}::{t}')
    if a.markdown: print('\n' + markdown(a.files, real, flex, a.ranks))
    return 1 if missed else 0

if __name__ == '__main__': sys.exit(main())
