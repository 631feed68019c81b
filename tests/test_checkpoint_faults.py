"""Hand-made checkpoint faults, generated: every manifest field x wrong type / out of range / missing / duplicated,
every path trick (`..`, absolute, symlinks out), unlisted files, a hostile `latest`. Each load must fail with a
`CheckpointError` naming the entry, without opening anything outside the checkpoint. And a save onto a full file
system (a real tmpfs of a few MB, two real ranks) says so, leaves nothing behind and the next save works."""
import json, os, shutil, subprocess, sys, tempfile
from pathlib import Path
import pytest, torch
import torch.nn as nn
from helpers import run_distributed

# ---------------------------------------------------------------------------------------------------------------
# what a load opens: an audit hook (the `open` event covers builtins.open, io.open and os.open)

OPENED = []
def _audit(event, args):
    if event == 'open' and OPENED and isinstance(args[0], (str, bytes, os.PathLike)): OPENED.append(os.fsdecode(args[0]))
sys.addaudithook(_audit)

def load_recording(engine, d, **kw):
    "engine.load_checkpoint(d) with every opened path recorded; (result or exception, opened paths)"
    OPENED[:] = ['<start>']
    try: result = engine.load_checkpoint(d, **kw)
    except Exception as e: result = e
    opened = OPENED[1:]
    OPENED.clear()
    return result, opened

def model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))

def cfg(stage=0):
    return {'train_batch_size': 4, 'steps_per_print': 1000, 'optimizer': {'type': 'Adam', 'params': {'lr': 0.01}},
            'zero_optimization': {'stage': stage}}

def train_step(engine):
    x = torch.randn(engine.train_micro_batch_size_per_gpu(), 6)
    engine.backward(engine(x).pow(2).mean()); engine.step()

@pytest.fixture(scope='module')
def pristine(tmp_path_factory):
    "One small checkpoint saved once, and the engine that loads every faulty copy of it"
    import flexrt
    d = tmp_path_factory.mktemp('pristine')
    e = flexrt.initialize(model=model(), config=cfg())[0]
    train_step(e)
    e.save_checkpoint(d / 'save', tag='t1')
    yield e, d / 'save'
    e.close()

@pytest.fixture
def ckpt(pristine, tmp_path):
    "A fresh copy of the checkpoint: (engine, save dir, tag dir, outside dir)"
    e, src = pristine
    shutil.copytree(src, tmp_path / 'save', symlinks=True)
    (tmp_path / 'outside').mkdir()
    return e, tmp_path / 'save', tmp_path / 'save' / 't1', tmp_path / 'outside'

def rewrite(tag_dir, edit):
    m = json.loads((tag_dir / 'manifest.json').read_text())
    edit(m)
    (tag_dir / 'manifest.json').write_text(json.dumps(m))

def assert_refused(engine, save_dir, outside, *fragments, **kw):
    from flexrt.checkpoint import CheckpointError
    result, opened = load_recording(engine, save_dir, **kw)
    assert isinstance(result, CheckpointError), f"loaded, or the wrong error: {result!r}"
    for f in fragments: assert f in str(result), f"{f!r} not in {result}"
    root = Path(save_dir).resolve()
    forbidden = [p for p in opened if Path(p).resolve().is_relative_to(Path(outside).resolve()) or p.startswith('/etc/')
                 or (Path(p).is_absolute() and Path(p).resolve().is_relative_to(root.parent) and not Path(p).resolve().is_relative_to(root))]
    assert not forbidden, f"opened outside the checkpoint: {forbidden}"
    return str(result)

def test_the_pristine_copy_loads(ckpt):
    e, d, _, _ = ckpt
    result, opened = load_recording(e, d)
    assert result[0] == str(d / 't1')
    assert {Path(p).name for p in opened} >= {'manifest.json', 'rank_00000.pt', 'model_states.pt', 'latest'}

# ---------------------------------------------------------------------------------------------------------------
# every manifest field x wrong type, out of range, missing, duplicated

WRONG_TYPES = ['2', 1.5, True, None, [], {}]
RANGES = {'format_version': [0, -1, 99], 'world_size': [0, -1, 1000000, 2], 'stage': [-1, 4, 1000], 'global_steps': [-1]}
REQUIRED = ['format', 'format_version', 'files', 'world_size']

def manifest_fields():
    with tempfile.TemporaryDirectory() as d:   # the fields a real save writes (read once, at collection)
        import flexrt
        e = flexrt.initialize(model=model(), config=cfg())[0]
        e.save_checkpoint(d, tag='t1'); e.close()
        return json.loads(Path(d, 't1', 'manifest.json').read_text())

FIELDS = manifest_fields()
CASES = ([(k, v) for k in FIELDS for v in WRONG_TYPES if not (k in ('tag', 'precision', 'stage') and isinstance(v, str))] +   # stage: a ZeRO stage, or a custom slot's name
         [(k, v) for k, vs in RANGES.items() for v in vs] + [('format', 'other-format'), ('tag', 'x' * 300), ('tag', 'a\x00b'), ('stage', 'x' * 300), ('stage', 'a\x00b')])

@pytest.mark.parametrize('field,value', CASES, ids=[f'{k}={v!r}'[:40] for k, v in CASES])
def test_a_bad_manifest_field_is_named(ckpt, field, value):
    e, d, t, out = ckpt
    rewrite(t, lambda m: m.__setitem__(field, value))
    assert_refused(e, d, out, f"'{field}'")

def test_every_saved_field_is_covered():
    "A field a save writes that the generated set does not know would go unchecked: fail here, naming it"
    known = set(RANGES) | set(REQUIRED) | {'tag', 'precision', 'files'}
    assert set(FIELDS) <= known, f"add {sorted(set(FIELDS) - known)} to the generated faults"

@pytest.mark.parametrize('field', REQUIRED)
def test_a_missing_required_field_is_named(ckpt, field):
    e, d, t, out = ckpt
    rewrite(t, lambda m: m.pop(field))
    assert_refused(e, d, out, f"'{field}'" if field != 'format' else "'format'")

@pytest.mark.parametrize('field', sorted(FIELDS))
def test_a_duplicated_field_is_named(ckpt, field):
    e, d, t, out = ckpt
    text = (t / 'manifest.json').read_text().rstrip()
    assert text.endswith('}')
    (t / 'manifest.json').write_text(text[:-1] + f', "{field}": {json.dumps(FIELDS[field])}}}')
    assert_refused(e, d, out, f"the key '{field}' appears twice")

ENTRY_FAULTS = ([('size', v) for v in ['12', 1.5, True, None, -1, 2**60]] +
                [('xxh3_128', v) for v in [123, None, 'zz', '', 'A' * 32, '0' * 31]])

@pytest.mark.parametrize('name', ['rank_00000.pt', 'model_states.pt'])
@pytest.mark.parametrize('key,value', ENTRY_FAULTS, ids=[f'{k}={v!r}'[:30] for k, v in ENTRY_FAULTS])
def test_a_bad_file_entry_is_named(ckpt, name, key, value):
    e, d, t, out = ckpt
    rewrite(t, lambda m: m['files'][name].__setitem__(key, value))
    assert_refused(e, d, out, f"files['{name}']", f"'{key}'")

@pytest.mark.parametrize('name', ['rank_00000.pt', 'model_states.pt'])
def test_a_file_entry_that_is_not_a_dict_is_named(ckpt, name):
    e, d, t, out = ckpt
    rewrite(t, lambda m: m['files'].__setitem__(name, 'abc'))
    assert_refused(e, d, out, f"files['{name}']")

@pytest.mark.parametrize('text', ['', '[1, 2]', '{"format": "flexrt-checkpoint"', 'x' * 100])
def test_a_manifest_that_is_not_a_json_object_is_refused(ckpt, text):
    e, d, t, out = ckpt
    (t / 'manifest.json').write_text(text)
    assert_refused(e, d, out, 'manifest.json')

# ---------------------------------------------------------------------------------------------------------------
# paths: every name must resolve inside the tag directory; nothing outside is opened, even listed with its true hash

def true_entry(path):
    from flexrt.checkpoint.storage import checksum_file
    return {'size': path.stat().st_size, 'xxh3_128': checksum_file(path)}

PATHS = ['../outside/copy.pt', '../../outside/copy.pt', 'sub/../../outside/copy.pt', './rank_00000.pt', 'a//b', 'a\\b',
         '../../../../etc/shadow', '/etc/shadow', 'OUTSIDE_ABSOLUTE', 'C:/x']

@pytest.mark.parametrize('name', PATHS)
def test_a_path_out_of_the_checkpoint_is_refused_with_its_true_hash(ckpt, name):
    e, d, t, out = ckpt
    shutil.copy(t / 'rank_00000.pt', out / 'copy.pt')
    if name == 'OUTSIDE_ABSOLUTE': name = str(out / 'copy.pt')
    entry = true_entry(out / 'copy.pt')
    rewrite(t, lambda m: m['files'].__setitem__(name, entry))
    message = assert_refused(e, d, out, 'manifest entry')
    assert repr(name)[:40] in message or name[:40] in message

@pytest.mark.parametrize('target', ['outside', '/etc/hostname'])
def test_a_rank_file_symlinked_out_is_refused(ckpt, target):
    e, d, t, out = ckpt
    real = out / 'rank_00000.pt'
    shutil.move(t / 'rank_00000.pt', real)   # the genuine file, its hash still in the manifest
    (t / 'rank_00000.pt').symlink_to(real if target == 'outside' else target)
    assert_refused(e, d, out, "files['rank_00000.pt']", 'symlink')

def test_a_manifest_symlinked_out_is_refused(ckpt):
    e, d, t, out = ckpt
    shutil.move(t / 'manifest.json', out / 'manifest.json')
    (t / 'manifest.json').symlink_to(out / 'manifest.json')
    assert_refused(e, d, out, 'manifest.json', 'symlink')

def test_a_symlink_inside_the_checkpoint_is_fine(ckpt):
    e, d, t, _ = ckpt
    os.replace(t / 'rank_00000.pt', t / 'real.pt')
    (t / 'rank_00000.pt').symlink_to('real.pt')
    assert e.load_checkpoint(d)[0] == str(t)

# ---------------------------------------------------------------------------------------------------------------
# coverage: every file a load reads is listed (and so verified)

@pytest.mark.parametrize('name', ['rank_00000.pt', 'model_states.pt'])
def test_an_unlisted_file_is_refused(ckpt, name):
    e, d, t, out = ckpt
    rewrite(t, lambda m: m['files'].pop(name))
    assert_refused(e, d, out, name, 'does not list')

def test_a_rank_file_beyond_the_listed_ones_is_refused(ckpt):
    "world_size 2 on a one-rank checkpoint with a tampered rank_00001.pt present but not listed"
    e, d, t, out = ckpt
    shutil.copy(t / 'rank_00000.pt', t / 'rank_00001.pt')
    rewrite(t, lambda m: m['files'].__setitem__('extra.pt', m['files']['rank_00000.pt']) or m.__setitem__('world_size', 2))
    assert_refused(e, d, out, 'rank_00001.pt', 'does not list')

# ---------------------------------------------------------------------------------------------------------------
# latest

LATEST = {'huge': 'x' * 2**20, 'long': 'x' * 300, 'nul': 'a\x00b', 'newline inside': 'a\nb', 'up': '../t1',
          'absolute': '/etc', 'dot': '.t1.partial', 'empty': '', 'backslash': 'a\\b'}

@pytest.mark.parametrize('case', LATEST)
def test_a_bad_latest_is_named(ckpt, case):
    e, d, t, out = ckpt
    (d / 'latest').write_text(LATEST[case])
    message = assert_refused(e, d, out, 'latest')
    assert len(message) < 600

def test_a_latest_that_is_not_text_or_links_out_is_refused(ckpt):
    e, d, t, out = ckpt
    (d / 'latest').write_bytes(b'\xff\xfe t1')
    assert_refused(e, d, out, 'latest', 'UTF-8')
    (d / 'latest').unlink()
    (out / 'latest').write_text('t1')
    (d / 'latest').symlink_to(out / 'latest')
    assert_refused(e, d, out, 'latest', 'symlink')

# ---------------------------------------------------------------------------------------------------------------
# a save onto a full file system: a real tmpfs of a few MB, two real ranks

def _mount_tmpfs(path, size):
    if os.geteuid() != 0 or shutil.which('mount') is None: return False
    return subprocess.run(['mount', '-t', 'tmpfs', '-o', f'size={size}', 'tmpfs', str(path)], capture_output=True).returncode == 0

def _listing(d): return sorted(str(p.relative_to(d)) for p in Path(d).rglob('*'))

def full_disk_rank(rank, world, mnt):
    import flexrt
    from flexrt import comm
    from flexrt.checkpoint import CheckpointError
    e = flexrt.initialize(model=model(), config=cfg(stage=1))[0]
    train_step(e)
    e.save_checkpoint(mnt, tag='a')
    before = _listing(mnt)
    comm.barrier()   # every rank has listed before rank 0 fills the disk
    if rank == 0:   # fill the disk, leaving less than one rank file
        free = shutil.disk_usage(mnt).free
        with open(Path(mnt, 'filler'), 'wb') as f: f.write(b'\0' * (free - 4096))
    comm.barrier()
    train_step(e)
    try: e.save_checkpoint(mnt, tag='b'); error = None
    except CheckpointError as err: error = str(err)
    comm.barrier()
    after = _listing(mnt)
    latest = Path(mnt, 'latest').read_text()
    loaded = e.load_checkpoint(mnt)[0]   # `latest` and checkpoint 'a' are intact
    comm.barrier()
    if rank == 0: Path(mnt, 'filler').unlink()
    comm.barrier()
    train_step(e)
    e.save_checkpoint(mnt, tag='c')
    again = e.load_checkpoint(mnt)[0]
    e.close()
    return error, before, after, latest, loaded, again

def test_a_full_disk_save_says_so_cleans_up_and_the_next_save_works(tmp_path):
    mnt = tmp_path / 'small'
    mnt.mkdir()
    if not _mount_tmpfs(mnt, '1m'): pytest.skip('needs root to mount a tmpfs of 1 MB (the full-disk test uses a real small file system)')
    try: results = run_distributed(full_disk_rank, 2, args=(str(mnt),), timeout=120)
    finally: subprocess.run(['umount', '-l', str(mnt)], check=False)
    for rank, (error, before, after, latest, loaded, again) in enumerate(results):
        assert error is not None and 'no space left on device writing' in error and 'bytes needed' in error, (rank, error)
        assert after == sorted(before + ["filler"]), (rank, before, after)
        assert latest == 'a' and loaded.endswith('/a')
        assert again.endswith('/c')
