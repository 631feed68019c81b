"""`allowed_globals` (and so `load_deepspeed_file`) on every torch flexrt supports (setup.py: torch>=2.4).

torch 2.4 has only `add_safe_globals`/`get_safe_globals`/`clear_safe_globals` (one process-wide list), 2.5 adds the
`safe_globals` context manager, 2.6 the `(object, 'module.Name')` pairs. The older APIs are emulated on this torch by
hiding what they lack: `safe_globals` removed (monkeypatch.delattr), and pairs declared not understood (then each
pair is passed as an object carrying the name, which is all torch 2.4 and 2.5 read). The files are real DeepSpeed
objects pickled by `torch.save` (a loss scaler rebuilt by NEWOBJ/BUILD, the ZeRO stage enum by REDUCE), and one that
calls `os.system`."""
import os, pickle, subprocess, sys
import importlib.util
import pytest, torch
from flexrt.checkpoint import safe_globals as sg
from flexrt.checkpoint.deepspeed_format import load_deepspeed_file, DeepSpeedData, ZeroStage
from flexrt.checkpoint.storage import CheckpointError

APIS = ['current', 'no_named_pairs', 'no_context_manager', 'torch_2_4']

@pytest.fixture(params=APIS)
def torch_api(request, monkeypatch):
    "This torch, or it with the parts an older torch lacks hidden"
    if request.param in ('no_context_manager', 'torch_2_4'): monkeypatch.delattr(torch.serialization, 'safe_globals')
    if request.param in ('no_named_pairs', 'torch_2_4'): monkeypatch.setattr(sg, 'takes_named_pairs', lambda: False)
    return request.param

@pytest.fixture(autouse=True)
def user_allow_list():
    "A global the user allowed before; the process-wide list is put back after each test whatever happens"
    before = torch.serialization.get_safe_globals()
    torch.serialization.add_safe_globals([UserThing])
    yield
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(before)

class UserThing:
    "A class the user allowed for their own loads"

def _allowed()->set: return set(torch.serialization.get_safe_globals())

_WRITE = """import sys, torch
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address
torch.save({'loss_scaler': DynamicLossScaler(8., 1000, 1., 2, False), 'zero_stage': ZeroStageEnum(2),
            'mapping': {'w': fragment_address(numel=6, start=2)}, 'w': torch.arange(4.)}, sys.argv[1])
"""

def _deepspeed_file(path):
    "A file holding DeepSpeed's own objects, as its optimizer-state files do; written by DeepSpeed in a child process, so this one never imports it (the drop-in tests need `deepspeed` unimported)"
    if importlib.util.find_spec('deepspeed') is None: pytest.skip('DeepSpeed is not installed')
    out = subprocess.run([sys.executable, '-c', _WRITE, str(path)], env={**os.environ, 'DS_ACCELERATOR': 'cpu'},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]

def test_deepspeed_objects_load_on_every_api(torch_api, tmp_path):
    _deepspeed_file(tmp_path / 'optim_states.pt')
    before = _allowed()
    out = load_deepspeed_file(tmp_path / 'optim_states.pt')
    scaler, fragment = out['loss_scaler'], out['mapping']['w']
    assert isinstance(scaler, DeepSpeedData) and scaler.cur_scale == 8. and scaler.scale_window == 1000
    assert isinstance(fragment, DeepSpeedData) and (fragment.numel, fragment.start) == (6, 2)
    assert repr(fragment) == 'deepspeed.utils.tensor_fragment.fragment_address(numel=6, start=2)'
    assert out['zero_stage'] is ZeroStage.gradients and torch.equal(out['w'], torch.arange(4.))
    assert _allowed() == before and UserThing in before   # DeepSpeed's names allowed only while reading; the user's kept

def test_deepspeed_objects_refused_outside_the_block(tmp_path):
    _deepspeed_file(tmp_path / 'optim_states.pt')
    load_deepspeed_file(tmp_path / 'optim_states.pt')
    with pytest.raises(pickle.UnpicklingError, match='deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler'):
        torch.load(tmp_path / 'optim_states.pt', weights_only=True)

class Evil:
    def __reduce__(self): return (os.system, ('echo unsafe > evil_ran.txt',))

def test_other_globals_refused_on_every_api(torch_api, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.save({'x': Evil()}, tmp_path / 'bad.pt')
    before = _allowed()
    with pytest.raises(CheckpointError, match='holds the global (posix|nt|os).system'):
        load_deepspeed_file(tmp_path / 'bad.pt')
    assert not (tmp_path / 'evil_ran.txt').exists()
    assert _allowed() == before   # put back after a refused load too

def test_list_put_back_when_the_block_raises(monkeypatch):
    monkeypatch.delattr(torch.serialization, 'safe_globals')
    before = _allowed()
    with pytest.raises(RuntimeError, match='inside'):
        with sg.allowed_globals([(DeepSpeedData, 'somewhere.Data')]):
            assert len(_allowed()) == len(before) + 1
            raise RuntimeError('inside the block')
    assert _allowed() == before

def test_pairs_become_named_objects_for_an_older_torch(monkeypatch):
    "What torch 2.4/2.5 receive: objects whose own `__module__`.`__name__` is the name in the file"
    monkeypatch.delattr(torch.serialization, 'safe_globals')
    monkeypatch.setattr(sg, 'takes_named_pairs', lambda: False)
    with sg.allowed_globals([(DeepSpeedData, 'somewhere.Data'), (ZeroStage, 'elsewhere.Stage'), UserThing]):
        named = {f'{g.__module__}.{g.__name__}': g for g in torch.serialization.get_safe_globals()}
    assert issubclass(named['somewhere.Data'], DeepSpeedData)   # a class: rebuilt by NEWOBJ/BUILD
    assert named['elsewhere.Stage'](3) is ZeroStage.weights      # an enum: rebuilt by calling it (REDUCE)
    assert named[f'{UserThing.__module__}.UserThing'] is UserThing   # objects already so named are passed as they are
