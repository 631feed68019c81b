"""Session set-up shared by every test file.

DeepSpeed (run next to flexrt in the parity tests) JIT-compiles its CPU shared-memory op into torch's extension
cache on first use and guards the build with a `lock` file; a run killed while compiling leaves the lock behind and
every later DeepSpeed start waits on it forever. No build can be in progress when a test session starts, so a lock
found then is stale: remove it."""
import os
from pathlib import Path

def _torch_extensions_dir() -> Path:
    return Path(os.environ.get('TORCH_EXTENSIONS_DIR') or Path.home() / '.cache' / 'torch_extensions')

def pytest_sessionstart(session):
    for lock in _torch_extensions_dir().glob('*/*/lock'): lock.unlink(missing_ok=True)

import pytest

@pytest.fixture(autouse=True)
def _no_live_views_left():
    """After each test: close the live views it left open and stop the kernel's record hub, so no redraw or hub thread
    of one test runs on while a later test forks its ranks (a fork copies locks such threads may hold)"""
    yield
    import sys
    live, monitor = sys.modules.get('flexrt.widgets.live'), sys.modules.get('flexrt.monitor')
    if live is not None:
        for view in list(live._views): view.close()
    if monitor is not None: monitor.stop_serving()

def pytest_report_header(config):
    "The seed of the generated config sets' sample (tests/fuzz_sample.py), so a failure can be run again"
    import fuzz_sample
    return fuzz_sample.describe()

def pytest_terminal_summary(terminalreporter):
    "The seed again at the end (`-q` hides the header), with how many generated cases ran"
    import fuzz_sample
    if not fuzz_sample.RUN: return
    counts = ', '.join(f'{name} {run} of {made}' for name, (run, made) in fuzz_sample.RUN.items())
    terminalreporter.write_line(f'{fuzz_sample.describe()}; ran {counts}')
