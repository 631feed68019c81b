"""Loaded at interpreter start in every process tools/ds_tests.py starts (real DeepSpeed and flexrt alike).

DeepSpeed's unit-test harness runs a test's ranks as `multiprocessing.Pool` tasks. A rank that fails through pytest
(`pytest.fail`, or `pytest.raises` whose error did not come) raises pytest's `Failed`, a `BaseException`, which the
pool's worker does not catch: the worker dies, its result never arrives, and the harness waits out its timeout,
stops the whole file (`pytest.exit("Test hanged")`) and then hangs closing the pool. Here such an outcome is returned
as an `AssertionError` with the same message, so the test is reported failed and the file goes on. Passing and
skipped tests are unchanged (a skip is caught by the harness itself)."""
import multiprocessing.pool as _pool, sys

_starmapstar = _pool.starmapstar

def starmapstar(args):
    try: return _starmapstar(args)
    except Exception: raise
    except BaseException as e:
        outcomes = sys.modules.get('_pytest.outcomes')
        if outcomes and isinstance(e, outcomes.Failed): raise AssertionError(f'pytest.fail in a rank: {e}') from None
        raise

_pool.starmapstar = starmapstar
