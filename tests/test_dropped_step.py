"""The 16-bit checks can see a lost optimizer step. For every ZeRO stage and 16-bit precision, the engine trains on 2
ranks (gas 2, clipping, a schedule; fp16 with a dynamic scale) once as it is and once with its last optimizer step
dropped (`test_engine.DropOneStep` in the engine's optimizer slot). The comparison every 16-bit test uses
(`test_engine.check_low`, against tests/reference.py) must accept the first and reject the second."""
import pytest
from helpers import run_distributed
from test_engine import STEPS, low_rank, references, check_low

CASES = [(stage, prec) for prec in ('bf16', 'fp16') for stage in (0, 1, 2, 3)]

def both_runs(rank, world):
    "Each case as it is, then each case with its last step dropped"
    kept = low_rank(rank, world, CASES)
    dropped = {c: low_rank(rank, world, [c], drop=(*c, STEPS - 1))[c] for c in CASES}
    return kept, dropped

@pytest.fixture(scope='module')
def runs(): return run_distributed(both_runs, 2, timeout=300), references(CASES)

@pytest.mark.parametrize('stage,prec', CASES)
def test_check_accepts_the_run_and_rejects_a_dropped_step(runs, stage, prec):
    per_rank, ref = runs
    check_low([r[0][stage, prec] for r in per_rank], ref[stage, prec], prec)
    with pytest.raises(AssertionError, match='weights'):
        check_low([r[1][stage, prec] for r in per_rank], ref[stage, prec], prec)
