"""Does the suite pass on a busy machine? `make test` N times in a row with a one-core load generator running.

    python bench/busy_test.py [--runs 3] [--target test] [--log-dir DIR]      (or: make test-busy)

CI machines are not always idle, and a test that passes only on a quiet machine fails one CI run in N. A busy-loop
process (one core, normal priority) runs for the whole benchmark. Each run's exit code, wall time and pytest summary
line are printed, then one line per run; the whole output of each run is kept in `--log-dir`. Exit code: 0 when every
run passed.
"""
import argparse, re, subprocess, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

def main(a)->int:
    logs = Path(a.log_dir or tempfile.mkdtemp(prefix='busy-test-logs-'))
    logs.mkdir(parents=True, exist_ok=True)
    load = subprocess.Popen([sys.executable, '-c', 'while True: pass'])
    rows = []
    try:
        for i in range(1, a.runs + 1):
            start = time.monotonic()
            r = subprocess.run(['make', a.target], cwd=ROOT, capture_output=True, text=True)
            seconds, out = time.monotonic() - start, r.stdout + r.stderr
            (logs / f'run{i}.txt').write_text(out)
            summaries = re.findall(r'^=*\s*(\d+ (?:passed|failed).*? in [\d.]+s.*?)\s*=*$', out, re.M)
            summary = (summaries or ['no summary'])[-1]
            rows.append((i, r.returncode, seconds, summary))
            print(f'run {i}: exit {r.returncode}, {seconds / 60:.1f} min, pytest: {summary}', flush=True)
    finally:
        load.kill()
        load.wait()
    print(f'\n`make {a.target}` {a.runs} times with one core kept busy ({logs}):\n')
    print('| run | exit | minutes | pytest |\n|---|---|---|---|')
    for i, code, seconds, summary in rows: print(f'| {i} | {code} | {seconds / 60:.1f} | {summary} |')
    return 0 if all(code == 0 for _, code, _, _ in rows) else 1

if __name__ == '__main__':
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--runs', type=int, default=3)
    parser.add_argument('--target', default='test', help='the make target to run')
    parser.add_argument('--log-dir', help='where each run\'s output goes (default: a new temporary folder)')
    sys.exit(main(parser.parse_args()))
