"""`flexrt.launch` hands back what the ranks return (`Run.results`): every rank's value or rank 0's only, tensors and
state dicts whole, nothing pickled; a value that cannot be sent fails that rank by name; no result file is left."""
import os, sys
from pathlib import Path
import pytest, torch
from flexrt.launch import launch, RankError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch_results_train import expected_value, return_value, return_unsendable_on, return_on_cuda, tiny_model

def _same(got, want):
    "Equal values of equal types, tensors compared by dtype, shape and value"
    assert type(got) is type(want) or (isinstance(want, dict) and type(got) is dict), (type(got), type(want))
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.device.type == 'cpu' and torch.equal(got, want), (got, want)
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for k in want: _same(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want): _same(g, w)
    else: assert got == want

def test_every_ranks_return_value_comes_back_whole():
    run = launch(return_value, num_processes=2)
    assert len(run.results) == 2
    for rank in (0, 1): _same(run.results[rank], expected_value(rank))
    tiny_model().load_state_dict(run.results[1]['model'])          # a state dict comes back loadable
    assert run.results_dir and not os.path.exists(run.results_dir)  # no result file left behind

def test_rank0_only_sends_rank0s_value_and_no_other():
    run = launch(return_unsendable_on, (1,), num_processes=2, results='rank0')   # rank 1's value is never looked at
    assert len(run.results) == 1
    _same(run.results[0], expected_value(0))
    assert not os.path.exists(run.results_dir)

def test_an_unsendable_value_fails_its_rank_by_name_and_place():
    run = launch(return_unsendable_on, (1,), num_processes=2, background=True)
    with pytest.raises(RankError) as info: run.wait(90)
    error = info.value
    assert error.rank == 1
    assert str(error).startswith("rank 1 failed with TypeError: results[1]['optim'][3] is a set, which cannot be sent "
                                 "to the kernel: return a list instead")
    assert 'write_result' in error.traceback                        # raised on the rank, as it handed the value back
    assert run.results is None and not os.path.exists(run.results_dir)   # rank 0's value is not kept either

def test_nothing_is_pickled_from_a_rank_when_results_are_not_wanted():
    run = launch(return_unsendable_on, (0,), num_processes=2, results=None)   # a Tripwire fails if anyone pickles it
    assert run.results is None and run.results_dir is None

def test_a_background_runs_results_are_there_after_wait():
    run = launch(return_value, (1.0,), num_processes=2, background=True)
    assert run.results is None                                       # still running
    assert run.wait(90)
    assert [r['rank'] for r in run.results] == [0, 1]
    _same(run.results[0], expected_value(0))
    assert not os.path.exists(run.results_dir)

@pytest.mark.skipif(not torch.cuda.is_available(), reason='no CUDA device on this machine: a GPU tensor comes back on the CPU')
def test_gpu_tensors_come_back_on_the_cpu():
    run = launch(return_on_cuda, num_processes=2)
    assert [(r['w'].device.type, r['w'].tolist()) for r in run.results] == [('cpu', [0., 1., 2.]), ('cpu', [1., 2., 3.])]
