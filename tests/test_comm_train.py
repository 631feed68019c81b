"""A real torch.distributed training script (examples/plain_ddp_train.py) runs unchanged with the one-line import swap
`from flexrt import comm as dist`, trains to the identical result, and every collective it calls is logged."""
import os, re, runpy, subprocess, sys
from pathlib import Path
import pytest
from helpers import run_distributed, free_port
from helpers import run_torchrun

SCRIPT = Path(__file__).resolve().parent.parent / 'examples' / 'plain_ddp_train.py'
ORIGINAL, SWAPPED = 'import torch.distributed as dist\n', 'from flexrt import comm as dist\n'

@pytest.fixture(scope='module')
def swapped(tmp_path_factory):
    text = SCRIPT.read_text()
    assert text.count(ORIGINAL) == 1
    path = tmp_path_factory.mktemp('swap') / 'plain_ddp_train_flexrt.py'
    path.write_text(text.replace(ORIGINAL, SWAPPED))  # the only change
    return path

def _torchrun(script):
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', '2', '--master_port', str(free_port()), str(script)]
    out = run_torchrun(cmd, capture_output=True, text=True, timeout=120, cwd=SCRIPT.parent.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [l for l in out.stdout.splitlines() if l.startswith('world ')]
    assert len(lines) == 1, out.stdout
    return lines[0]

def test_same_result_under_torchrun(swapped):
    theirs, ours = _torchrun(SCRIPT), _torchrun(swapped)
    assert re.match(r'world 2 loss \d+\.\d+ checksum -?\d+\.\d+ report', theirs)
    assert ours == theirs

def _run_logged(rank, ws, path):
    "Run the swapped script as __main__ on this rank with the comms logger on; return what it logged"
    import contextlib, io
    from flexrt import comm
    comm.configure(enabled=True)
    with contextlib.redirect_stdout(io.StringIO()): runpy.run_path(str(path), run_name='__main__')
    return {op: sum(s['count'] for s in sizes.values()) for op, sizes in comm.get_comm_stats().items()}

def test_every_collective_is_logged(swapped):
    for logged in run_distributed(_run_logged, 2, args=(swapped,), init=False):
        params, steps = 4, 20
        assert logged == {'broadcast': params, 'all_reduce': steps * params + steps, 'all_gather': 1,
                          'all_gather_object': 1, 'barrier': 1}
