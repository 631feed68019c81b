"""Bad configs generated from the schema itself: every field of every block x a value of each wrong JSON type, each
bound crossed, each required key left out, each key given twice in a JSON file. A field added to any block is covered
by these tests without editing them. Every error must be a TypeError/ValueError naming the key path and the value."""
import dataclasses, json, re, typing, warnings
import pytest
from flexrt.config import FlexConfig, BatchConfig, load_config
from flexrt.config.schema import Block, _optional

def schema_fields(cls=FlexConfig, path=()):
    "(JSON key path, annotation, bounds metadata, has a default) for every field, nested blocks included"
    for f in dataclasses.fields(cls):
        if f.name not in cls.json_keys() and f.name != 'batch': continue   # not a JSON key (FlexConfig.not_applied)
        if cls is FlexConfig and f.name == 'batch':   # the batch keys sit at the top level of the JSON
            yield from schema_fields(BatchConfig, path)
            continue
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        yield path + (f.name,), f.type, dict(f.metadata), required
        inner, _ = _optional(f.type)
        if isinstance(inner, type) and issubclass(inner, Block): yield from schema_fields(inner, path + (f.name,))

FIELDS = list(schema_fields())
NEEDS = {'optimizer': {'type': 'Adam'}, 'scheduler': {'type': 'WarmupLR'}}   # what a block needs to exist at all

def config_with(path, value):
    "A minimal valid config with `value` at `path`"
    cfg = {'train_batch_size': 8}
    node = cfg
    for key in path[:-1]:
        node = node.setdefault(key, dict(NEEDS.get(key, {})) if node is cfg else {})
    node[path[-1]] = value
    return cfg

def wrong_values(tp)->list:
    "JSON values of every kind `tp` does not take (independent of the code under test)"
    inner, nullable = _optional(tp)
    origin = typing.get_origin(inner)
    candidates = {'string': 'x', 'int': 7, 'fraction': 2.5, 'bool': True, 'list': [1], 'dict': {'a': 1}, 'null': None, 'two': 2}
    if inner is bool: ok = {'bool', 'null'} if nullable else {'bool'}   # 1 and 0 are fine (DeepSpeed); 2 is not
    elif inner is int: ok = {'int', 'two'}
    elif inner is float: ok = {'int', 'fraction', 'two'}
    elif inner is str: ok = {'string'}
    elif origin is typing.Literal: ok = set()   # 'x' is not a choice either
    elif inner is list or origin is list: ok = {'list'} if (typing.get_args(inner) or [int])[0] in (int, float) else set()
    elif inner is dict or origin is dict: ok = {'dict'} if not typing.get_args(inner) else set()
    elif isinstance(inner, type) and issubclass(inner, Block): ok = {'dict'}   # a dict with unknown keys: tested elsewhere
    else: raise AssertionError(f"the fuzz test does not know the annotation {tp}: teach wrong_values about it")
    if nullable: ok |= {'null'}
    return [(k, v) for k, v in candidates.items() if k not in ok]

def crossed_bounds(tp, meta)->list:
    inner, _ = _optional(tp)
    step = 1 if inner is int else 0.5
    out = []
    if 'ge' in meta: out.append(meta['ge'] - step)
    if 'gt' in meta: out.append(meta['gt'])
    if 'le' in meta: out.append(meta['le'] + step)
    return out

def dotted(path): return '.'.join(path)

WRONG = [(p, k, v) for p, tp, _, _ in FIELDS for k, v in wrong_values(tp)]
BOUNDS = [(p, v) for p, tp, meta, _ in FIELDS for v in crossed_bounds(tp, meta)]
CLAMPED = [(p, meta['clamp']) for p, _, meta, _ in FIELDS if 'clamp' in meta]
REQUIRED = [p for p, _, _, required in FIELDS if required]

def test_the_generator_sees_the_whole_schema():
    paths = {dotted(p) for p, *_ in FIELDS}
    assert {'train_batch_size', 'fp16.loss_scale', 'zero_optimization.reduce_bucket_size', 'optimizer.type',
            'zero_optimization.offload_param.buffer_size', 'autotuning.model_info.num_layers'} <= paths
    assert len(FIELDS) > 100 and len(WRONG) > 4 * len(FIELDS) and len(BOUNDS) > 40 and REQUIRED

def _message_names(error, path, value):
    text = str(error)
    assert dotted(path) in text, f"{text!r} does not name {dotted(path)}"
    shown = {repr(value)[:20], f"{value:g}" if isinstance(value, float) else repr(value)}
    if isinstance(value, (list, dict)) and value:   # a container of the wrong items names the first bad item
        shown.add(repr(value[0] if isinstance(value, list) else next(iter(value.values()))))
    assert any(s in text for s in shown), f"{text!r} does not show the value {value!r}"

@pytest.mark.parametrize('path,kind,value', WRONG, ids=[f'{dotted(p)}={k}' for p, k, _ in WRONG])
def test_a_value_of_the_wrong_type_is_refused_naming_key_and_value(path, kind, value):
    with pytest.raises((TypeError, ValueError)) as e: load_config(config_with(path, value))
    _message_names(e.value, path, value)

@pytest.mark.parametrize('path,value', BOUNDS, ids=[f'{dotted(p)}={v}' for p, v in BOUNDS])
def test_a_value_out_of_range_is_refused_naming_key_value_and_range(path, value):
    with pytest.raises(ValueError) as e: load_config(config_with(path, value))
    _message_names(e.value, path, value)
    assert re.search(r'must be .*(from|positive|non-negative|>=|>|above|at most)', str(e.value)), str(e.value)

@pytest.mark.parametrize('path,clamp', CLAMPED, ids=[dotted(p) for p, _ in CLAMPED])
def test_a_size_past_its_clamp_is_lowered_with_a_warning(path, clamp):
    with pytest.warns(UserWarning, match=re.escape(f"{dotted(path)}=") + r'.*more than any device holds'):
        c = load_config(config_with(path, clamp * 1000))
    node = c
    for key in path: node = getattr(node, key)
    assert node == clamp

@pytest.mark.parametrize('path', REQUIRED, ids=[dotted(p) for p in REQUIRED])
def test_a_missing_required_key_is_named(path):
    cfg = config_with(path, 'placeholder')
    node = cfg
    for key in path[:-1]: node = node[key]
    del node[path[-1]]
    with pytest.raises(ValueError, match=re.escape(f"{dotted(path)} is required")): load_config(cfg)

DUPLICATES = [p for p, *_ in FIELDS]

@pytest.mark.parametrize('path', DUPLICATES, ids=[dotted(p) for p in DUPLICATES])
def test_a_key_given_twice_in_a_json_file_is_refused_naming_both_values(path, tmp_path):
    text = json.dumps(config_with(path, '@@'))
    leaf = json.dumps(path[-1])
    assert text.count(f'{leaf}: "@@"') == 1
    file = tmp_path / 'ds.json'
    file.write_text(text.replace(f'{leaf}: "@@"', f'{leaf}: 1, {leaf}: 2'))
    with pytest.raises(ValueError, match=re.escape(f"the key {dotted(path)} is given twice (1 and 2)")): load_config(file)

BOOLS = [p for p, tp, _, _ in FIELDS if _optional(tp)[0] is bool]

@pytest.mark.parametrize('path', BOOLS, ids=[dotted(p) for p in BOOLS])
def test_every_flag_takes_one_and_zero_as_deepspeed_does(path):
    for given, stored in ((1, True), (0, False)):
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            try: c = load_config(config_with(path, given))
            except ValueError as e:   # a rule across keys (e.g. an offload flag needing a stage): not the flag's type
                assert 'must be true or false' not in str(e); continue
        node = c
        for key in path: node = getattr(node, key)
        assert node is stored
