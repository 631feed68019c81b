#!/usr/bin/env python
"""Every config key the installed DeepSpeed reads, with DeepSpeed's default: printed as JSON {"a.b": default}.

Run with the real deepspeed importable (DS_ACCELERATOR=cpu). Keys come from two places, both generated: the keys
`DeepSpeedConfig._initialize_params` asks of the config dict (each statement run on a dict that records what it is
asked, once empty and once per block with a probe), and the fields of the pydantic models those blocks are built into."""
import ast, enum, inspect, json, os, sys, textwrap, warnings
os.environ.setdefault('DS_ACCELERATOR', 'cpu')
warnings.simplefilter('ignore')
import logging; logging.disable(logging.CRITICAL)
import deepspeed.runtime.config as C
from deepspeed.runtime.config_utils import DeepSpeedConfigModel
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

PROBE = '__flexrt_probe__'
class Rec(dict):
    "A dict that records each key asked of it (with the default offered)"
    def __init__(self, path, log, probe=False):
        super().__init__(); self.path, self.log = path, log
        dict.__setitem__(self, PROBE, path if probe else '')   # never empty: DeepSpeed skips an empty dict
    def _note(self, k, default=None):
        if isinstance(k, str) and k != PROBE: self.log.setdefault(self.path + k, default)
    def get(self, k, default=None): self._note(k, default); return dict.get(self, k, default)
    def __contains__(self, k): self._note(k); return dict.__contains__(self, k)
    def __getitem__(self, k): self._note(k); return dict.__getitem__(self, k)
    def keys(self): return self

MODELS = {}   # block path -> pydantic model class built from it
_init = DeepSpeedConfigModel.__init__
def _spy(self, strict=False, **data):
    if PROBE in data and (path := data.pop(PROBE)): MODELS[path.rstrip('.')] = type(self)
    return _init(self, strict=strict, **data)
DeepSpeedConfigModel.__init__ = _spy

_src = textwrap.dedent(inspect.getsource(C.DeepSpeedConfig._initialize_params))
STATEMENTS = [compile(ast.Module([s], []), '<ds-config>', 'exec') for s in ast.parse(_src).body[0].body]

def asked(param_dict)->None:
    "Run each statement of DeepSpeedConfig._initialize_params on `param_dict`, going on past the ones that fail"
    scope = {'self': object.__new__(C.DeepSpeedConfig), 'param_dict': param_dict}
    for code in STATEMENTS:
        try: exec(code, vars(C), scope)
        except Exception: pass

def plain(v):
    if isinstance(v, enum.Enum): return plain(v.value)
    if isinstance(v, BaseModel): return {k: plain(x) for k, x in v.model_dump(by_alias=True).items()}
    if isinstance(v, (list, tuple, set)): return [plain(x) for x in v]
    if isinstance(v, dict): return {str(k): plain(x) for k, x in v.items()}
    return v if v is None or isinstance(v, (bool, int, float, str)) else repr(v)

def submodel(annotation):
    for a in [annotation, *getattr(annotation, '__args__', ())]:
        if isinstance(a, type) and issubclass(a, BaseModel): return a

def model_keys(model, path, out):
    for name, f in model.model_fields.items():
        key = f"{path}.{f.alias or name}"
        sub = submodel(f.annotation)
        if sub is not None: model_keys(sub, key, out); continue
        default = f.default if f.default is not PydanticUndefined else (f.default_factory() if f.default_factory else None)
        out[key] = plain(default)

def probed(path:str, log:dict)->dict:
    "A recording config with a recording block at `path` (a.b.c), whose keys go to `log`"
    root = node = Rec('', {})
    parts = path.split('.')
    for i, part in enumerate(parts):
        child = Rec('.'.join(parts[:i + 1]) + '.', log if i == len(parts) - 1 else {}, probe=i == len(parts) - 1)
        dict.__setitem__(node, part, child); node = child
    return root

def deepspeed_keys()->dict:
    "{key path: DeepSpeed's default} for every key the installed DeepSpeed reads"
    top = {}
    asked(Rec('', top))
    keys, todo = {k: plain(v) for k, v in top.items()}, [k for k in top]
    while todo:
        path = todo.pop()
        if path.count('.') > 3 or not (keys.get(path) is None or isinstance(keys.get(path), dict)): continue
        nested = {}
        asked(probed(path, nested))
        new = {k: plain(v) for k, v in nested.items() if k not in keys}
        keys.update(new); todo.extend(new)
        if nested or path in MODELS: keys.pop(path, None)
    for block, model in MODELS.items():
        keys.pop(block, None)
        model_keys(model, block, keys)
    return keys

def main(): json.dump(deepspeed_keys(), sys.stdout, indent=0, sort_keys=True)

if __name__ == '__main__': main()
