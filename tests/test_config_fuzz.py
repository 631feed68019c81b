"""Bad configs generated from the schema itself: every field of every block x a value of each wrong JSON type, each
bound crossed, each required key left out, each key given twice in a JSON file. A field added to any block is covered
by these tests without editing them. Every error must be a TypeError/ValueError naming the key path and the value.

`make test` runs a sample of each set (tests/fuzz_sample.py): every field with a wrong-type case (and a bound case if
it has bounds), every block and every wrong-type kind, the rest drawn with a seed that changes every run and is printed
in pytest's summary (FLEXRT_FUZZ_SEED=<it> runs the same sample again); `make test-all` (FLEXRT_FUZZ_ALL=1) runs every
case."""
import dataclasses, json, re, typing, warnings
import pytest
from fuzz_sample import FRACTION, sample
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
    "(which bound, a value past it) for each bound in `meta`"
    inner, _ = _optional(tp)
    step = 1 if inner is int else 0.5
    out = []
    if 'ge' in meta: out.append(('ge', meta['ge'] - step))
    if 'gt' in meta: out.append(('gt', meta['gt']))
    if 'le' in meta: out.append(('le', meta['le'] + step))
    return out

def dotted(path): return '.'.join(path)

def type_class(tp)->str:
    "The annotation's kind, as `wrong_values` tells them apart: 'bool', 'int|None', 'Literal', 'list[int]', 'Block', ..."
    inner, nullable = _optional(tp)
    if typing.get_origin(inner) is typing.Literal: name = 'Literal'
    elif isinstance(inner, type) and issubclass(inner, Block): name = 'Block'
    else: name = inner.__name__ if isinstance(inner, type) else str(inner)
    return name + ('|None' if nullable else '')

TYPES = {p: type_class(tp) for p, tp, _, _ in FIELDS}
def block(path)->str: return dotted(path[:-1]) or '(top level)'   # the block a key belongs to

ALL_WRONG = [(p, k, v) for p, tp, _, _ in FIELDS for k, v in wrong_values(tp)]
ALL_BOUNDS = [(p, which, v) for p, tp, meta, _ in FIELDS for which, v in crossed_bounds(tp, meta)]
ALL_DUPLICATES = [p for p, *_ in FIELDS]
ALL_BOOLS = [p for p, tp, _, _ in FIELDS if _optional(tp)[0] is bool]
# the sets run: every block, every wrong-type kind per block and per annotation kind, every bound kind (fuzz_sample)
# every field has a wrong-type case and, if bounded, a bound case in every run; the rest rotates with the seed
field = lambda c: c[0]
WRONG = sample('wrong types', ALL_WRONG, [field, lambda c: (block(c[0]), c[1]), lambda c: (TYPES[c[0]], c[1])])
BOUNDS = [(p, v) for p, _, v in sample('bounds', ALL_BOUNDS, [field, lambda c: (TYPES[c[0]], c[1])])]
CLAMPED = [(p, meta['clamp']) for p, _, meta, _ in FIELDS if 'clamp' in meta]
REQUIRED = [p for p, _, _, required in FIELDS if required]
DUPLICATES = ALL_DUPLICATES   # one case per field: all of them, every run (each takes about a millisecond)
BOOLS = ALL_BOOLS

def test_the_generator_sees_the_whole_schema():
    paths = {dotted(p) for p, *_ in FIELDS}
    assert {'train_batch_size', 'fp16.loss_scale', 'zero_optimization.reduce_bucket_size', 'optimizer.type',
            'zero_optimization.offload_param.buffer_size', 'autotuning.model_info.num_layers'} <= paths
    assert len(FIELDS) > 100 and len(ALL_WRONG) > 4 * len(FIELDS) and len(ALL_BOUNDS) > 40 and REQUIRED

def test_the_sample_covers_every_field_block_and_wrong_kind():
    """Every field gets a wrong-type case and a key-twice case in every run, every bounded field a bound case, every
    flag a 1/0 case; what a run leaves out is a random part of each field's other cases, never a field, block or kind"""
    fields, bounded = {p for p, *_ in FIELDS}, {p for p, tp, meta, _ in FIELDS if crossed_bounds(tp, meta)}
    assert {p for p, _, _ in WRONG} == fields, sorted(map(dotted, fields - {p for p, _, _ in WRONG}))
    assert {p for p, _ in BOUNDS} == bounded, sorted(map(dotted, bounded - {p for p, _ in BOUNDS}))
    assert set(DUPLICATES) == fields and set(BOOLS) == {p for p, tp, _, _ in FIELDS if _optional(tp)[0] is bool}
    assert {('autotuning', k) for k in ('playoff_size', 'tolerance', 'max_profile_steps')} <= bounded
    blocks = {block(p) for p, *_ in FIELDS}
    assert {block(p) for p, _, _ in WRONG} == blocks and {block(p) for p in DUPLICATES} == blocks
    assert {(block(p), k) for p, k, _ in WRONG} == {(block(p), k) for p, k, _ in ALL_WRONG}
    assert {(TYPES[p], k) for p, k, _ in WRONG} == {(TYPES[p], k) for p, k, _ in ALL_WRONG}
    assert {block(p) for p, _ in BOUNDS} == {block(p) for p, _, _ in ALL_BOUNDS}
    bound = {(p, v): which for p, which, v in ALL_BOUNDS}
    assert {(TYPES[p], bound[p, v]) for p, v in BOUNDS} == {(TYPES[p], which) for p, which, _ in ALL_BOUNDS}
    assert {block(p) for p in BOOLS} == {block(p) for p in ALL_BOOLS}
    for run, whole in ((WRONG, ALL_WRONG), (DUPLICATES, ALL_DUPLICATES), (BOOLS, ALL_BOOLS)):
        assert all(case in whole for case in run) and len(run) >= FRACTION * len(whole)

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

@pytest.mark.parametrize('path', DUPLICATES, ids=[dotted(p) for p in DUPLICATES])
def test_a_key_given_twice_in_a_json_file_is_refused_naming_both_values(path, tmp_path):
    text = json.dumps(config_with(path, '@@'))
    leaf = json.dumps(path[-1])
    assert text.count(f'{leaf}: "@@"') == 1
    file = tmp_path / 'ds.json'
    file.write_text(text.replace(f'{leaf}: "@@"', f'{leaf}: 1, {leaf}: 2'))
    with pytest.raises(ValueError, match=re.escape(f"the key {dotted(path)} is given twice (1 and 2)")): load_config(file)

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
