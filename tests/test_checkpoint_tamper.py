"""Loading checks every rank file's records against the manifest before anything is changed: a generated set of
tampered checkpoints (every kind of saved tensor x shape, dtype, element count and element range), each re-checksummed
so that only the load plan can catch it, gives a CheckpointError naming the file and the key, and leaves every
parameter, buffer, optimizer state and counter of the engine bit-identical."""
import json, shutil
import pytest, torch
import torch.nn.functional as F
from test_checkpoint import engine_for, VOCAB

def train(e, steps=2):
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (e.train_micro_batch_size_per_gpu(), 4))
        e.backward(F.cross_entropy(e(ids), ids[:, 0])); e.step()

def state_of(e):
    "Every tensor the engine would change on a load, cloned, with the counters and the lr"
    out = {f'module.{k}': v.detach().clone() for k, v in e.module.state_dict().items()}
    for i, f in enumerate(e.optimizer.fragments()):
        out[f'master{i}'] = f.master.detach().clone()
        for k, v in e.optimizer.master_state(f.master).items():
            if torch.is_tensor(v): out[f'master{i}.{k}'] = v.clone()
    return out, (e.global_steps, e.global_samples, e.micro_steps), e.get_lr()

def same(a, b):
    (ta, ca, la), (tb, cb, lb) = a, b
    return ca == cb and la == lb and ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) and ta[k].dtype == tb[k].dtype for k in ta)

# where a tensor of each kind lies in a loaded rank file
def master(p): return p['masters'][0], 'master'
def state(p): return p['masters'][0]['state'], 'exp_avg'
def scalar(p): return p['masters'][0]['scalars'], 'step'
def buffer(p): return next(r for r in p['values'] if not r['value'].is_floating_point()), 'value'   # the int64 buffer
def frozen(p): return next(r for r in p['values'] if r['value'].is_floating_point()), 'value'       # a frozen parameter

CORRUPT = {
    'numel': lambda t: t.reshape(-1)[:-1].clone(),                         # one element short
    'one': lambda t: t.reshape(-1)[:1].clone(),                            # cut to one element
    'shape': lambda t: t.reshape(1, -1).clone() if t.dim() != 2 else t.reshape(-1).clone(),   # same elements, another shape
    'dtype': lambda t: t.to(torch.int64) if t.is_floating_point() else t.to(torch.float32),
}
CASES = [(k, c) for k in (master, state, scalar, buffer, frozen) for c in CORRUPT
         if not (k is scalar and c in ('numel', 'one', 'dtype')) and not (k is buffer and c == 'one')]   # (already 1 element) + [(master, 'range'), (frozen, 'range')]

def tamper(ckpt, kind, corruption):
    "Corrupt one tensor (or one piece's element range) of rank 0's file, then rewrite its size and checksum in the manifest"
    from flexrt.checkpoint.storage import checksum_file
    path = ckpt / 'rank_00000.pt'
    payload = torch.load(path, weights_only=True)
    holder, field = kind(payload)
    if corruption == 'range': holder['pieces'][0][2] += 1          # one element past the tensor, or past the record
    else: holder[field] = CORRUPT[corruption](holder[field])
    torch.save(payload, path)
    manifest = json.loads((ckpt / 'manifest.json').read_text())
    manifest['files']['rank_00000.pt'] = {'size': path.stat().st_size, 'xxh3_128': checksum_file(path)}
    (ckpt / 'manifest.json').write_text(json.dumps(manifest))
    return [pc[0] for pc in (holder if 'pieces' in holder else payload['masters'][0])['pieces']]   # the record's keys

def _has(kind, payload):
    try: kind(payload); return True
    except (StopIteration, IndexError, KeyError): return False

@pytest.mark.parametrize('stage', [0, 2, 3])
def test_tampered_records_are_refused_before_anything_changes(tmp_path, stage):
    from flexrt.checkpoint import CheckpointError
    e = engine_for(stage, gas=1, dropout=0.)
    train(e)
    e.save_checkpoint(tmp_path / 'good', tag='t')
    train(e)                                          # the engine now differs from the checkpoint
    before = state_of(e)
    good = torch.load(tmp_path / 'good' / 't' / 'rank_00000.pt', weights_only=True)
    kinds = {k for k in (master, state, scalar, buffer, frozen) if _has(k, good)}
    assert len(kinds) >= 4                            # stage 0 steps its frozen parameters too: no frozen value
    for kind, corruption in [(k, c) for k, c in CASES if k in kinds]:
        ckpt = tmp_path / f'{kind.__name__}-{corruption}'
        shutil.copytree(tmp_path / 'good', ckpt)
        keys = tamper(ckpt / 't', kind, corruption)
        with pytest.raises(CheckpointError) as err: e.load_checkpoint(ckpt, tag='t')
        msg = str(err.value)
        assert 'rank_00000.pt' in msg and any(repr(k) in msg for k in keys), (kind.__name__, corruption, msg)
        assert same(state_of(e), before), (kind.__name__, corruption)
    e.load_checkpoint(tmp_path / 'good', tag='t')     # the untouched checkpoint still loads
    assert not same(state_of(e), before)
    e.close()
