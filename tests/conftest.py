"""Session set-up shared by every test file.

DeepSpeed (run next to flexrt in the parity tests) JIT-compiles its CPU shared-memory op into torch's extension
cache on first use and guards the build with a `lock` file; a run killed while compiling leaves the lock behind and
every later DeepSpeed start waits on it forever. No build can be in progress when a test session starts, so a lock
found then is stale: remove it."""
import os
from pathlib import Path

def _torch_extensions_dir() -> Path:
    return Path(os.environ.get('TORCH_EXTENSIONS_DIR') or Path.home() / '.cache' / 'torch_extensions')

def _worker(config) -> bool:
    "True in a pytest-xdist worker (`make test` runs two); False in the controller and in a run without xdist"
    return hasattr(config, 'workerinput')

def pytest_configure(config):
    """Every xdist worker collects the tests itself and xdist refuses a run whose workers collected different ones, so
    they must draw the same generated config sample: the run's seed goes into the environment the workers inherit"""
    import fuzz_sample
    os.environ['FLEXRT_FUZZ_SEED'] = str(fuzz_sample.SEED)

def pytest_sessionstart(session):
    if _worker(session.config):
        # flexrt.launch's rendezvous ports too from this worker's share (tests/helpers.py's free_port)
        import functools, helpers
        from flexrt.launch import launcher
        launcher.free_port = functools.partial(launcher.free_port, share=helpers.worker_share())
        return  # the controller cleared the locks before the workers started; a worker may compile
    for lock in _torch_extensions_dir().glob('*/*/lock'): lock.unlink(missing_ok=True)

# Seconds each of the slowest files took in a whole run (three workers on a quiet 2-core machine, fresh clone, at
# 43db27d). The workers take files longest first, so no long file starts last and runs alone while the others idle;
# the rest keep their order. A stale figure costs only balance, never a result.
SLOW_FILES = {
    'test_autotune_widget.py': 187, 'test_autotuner_runner.py': 144, 'test_checkpoint_async.py': 124,
    'test_hf_clients.py': 112, 'test_checkpoint.py': 112, 'test_elastic.py': 108, 'test_autotuner_memory.py': 101,
    'test_browser_autotune.py': 88, 'test_docs.py': 78, 'test_deepspeed_parity.py': 76, 'test_anatomy.py': 57,
    'test_browser.py': 56, 'test_comm_dtype.py': 52, 'test_zero12.py': 46, 'test_checkpoint_concurrent.py': 45,
    'test_threads_launch.py': 43, 'test_zero12_engine.py': 39, 'test_zeropp.py': 38, 'test_exit_teardown.py': 38,
    'test_zero3.py': 37, 'test_comm_faults.py': 37, 'test_engine_init.py': 34, 'test_grads.py': 34,
    'test_project.py': 34, 'test_deepspeed_script.py': 30, 'test_launch.py': 27, 'test_autotuner_cli.py': 27,
    'test_checkpoint_deepspeed.py': 25, 'test_comm_train.py': 25, 'test_run_health.py': 22, 'test_ds_monitors.py': 22,
    'test_checkpoint_ds_surface.py': 18, 'test_checkpoint_safe_globals.py': 15, 'test_reducer.py': 13,
    'test_notebooks.py': 13, 'test_activation_checkpointing.py': 12, 'test_monitor.py': 12, 'test_engine.py': 11,
    'test_utils_partition.py': 11, 'test_zero3_overlap.py': 11, 'test_three_ranks.py': 11, 'test_widgets.py': 11,
    'test_p2p_thread.py': 11, 'test_launch_results.py': 10, 'test_zero3_moe.py': 10,
}

def pytest_collection_modifyitems(session, config, items):
    "Files in order of SLOW_FILES' seconds, longest first; a file's own tests keep their order"
    order = {path: i for i, path in enumerate(dict.fromkeys(item.path.name for item in items))}
    items.sort(key=lambda item: (-SLOW_FILES.get(item.path.name, 0), order[item.path.name]))

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

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With FLEXRT_TEST_CPU=FILE, append a line per test to FILE: its CPU seconds (this worker's, and its waited-for
    children's: forked ranks, torchrun and its ranks, kernels; not those of a process group it killed), its wall
    seconds (setup and teardown included), the worker, the time it ended and its id: where the suite's two cores go,
    which --durations' wall times do not say, and which worker ran last"""
    path = os.environ.get('FLEXRT_TEST_CPU')
    if not path:
        yield
        return
    import time
    def cpu(): t = os.times(); return t.user + t.system + t.children_user + t.children_system
    before, start = cpu(), time.perf_counter()
    yield
    worker = os.environ.get('PYTEST_XDIST_WORKER', '-')
    with open(path, 'a') as f:
        f.write(f'{cpu() - before:.2f} {time.perf_counter() - start:.2f} {worker} {time.time():.0f} {item.nodeid}\n')

def pytest_report_header(config):
    "The seed of the generated config sets' sample (tests/fuzz_sample.py), so a failure can be run again"
    import fuzz_sample
    return fuzz_sample.describe()

def pytest_sessionfinish(session):
    "A worker hands the controller how many generated cases it ran (the controller collects none itself)"
    if _worker(session.config):
        import fuzz_sample
        session.config.workeroutput['fuzz_run'] = {name: list(counts) for name, counts in fuzz_sample.RUN.items()}

@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: absent in a run without it
def pytest_testnodedown(node, error):
    import fuzz_sample
    fuzz_sample.RUN.update({name: tuple(counts) for name, counts in node.workeroutput.get('fuzz_run', {}).items()})

def pytest_terminal_summary(terminalreporter):
    "The seed again at the end (`-q` hides the header), with how many generated cases ran"
    import fuzz_sample
    if not fuzz_sample.RUN: return
    counts = ', '.join(f'{name} {run} of {made}' for name, (run, made) in fuzz_sample.RUN.items())
    terminalreporter.write_line(f'{fuzz_sample.describe()}; ran {counts}')
