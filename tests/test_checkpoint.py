"""Checkpoints on real gloo ranks: exact (bitwise) resume at every ZeRO stage and precision, loading at another world
size and stage (losses and gradient norms as one process), crash safety under SIGKILL and inside a tag's re-save,
corruption and malicious-pickle detection, clear errors that change nothing, raised on every rank together."""
import hashlib, json, os, shutil, signal, subprocess, sys, time, warnings
from unittest import mock
from pathlib import Path
import pytest, torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import run_distributed

VOCAB, DIM, BATCH, N = 11, 8, 8, 3   # N steps before the save, N after

class Net(nn.Module):
    "Tied embedding/head, a frozen layer, a buffer that counts forwards, dropout; sizes not divisible by 2 or 4"
    def __init__(self, dropout=0.1):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.body = nn.Sequential(nn.Linear(DIM, 13), nn.Dropout(dropout), nn.Tanh(), nn.Linear(13, DIM))
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer('forwards', torch.zeros((), dtype=torch.int64))
    def forward(self, ids):
        self.forwards += 1
        return self.head(self.frozen(self.body(self.emb(ids).mean(1))))

def make_model(seed=0, dropout=0.1):
    torch.manual_seed(seed)
    return Net(dropout)

def config(stage, precision='fp32', gas=2):
    cfg = {'train_batch_size': BATCH, 'gradient_accumulation_steps': gas, 'gradient_clipping': 0.5, 'steps_per_print': 1000,
           'optimizer': {'type': 'AdamW', 'params': {'lr': 0.02, 'weight_decay': 0.01}},
           'scheduler': {'type': 'WarmupDecayLR', 'params': {'warmup_num_steps': 2, 'total_num_steps': 10}},
           'zero_optimization': {'stage': stage, 'reduce_bucket_size': 50, 'stage3_param_persistence_threshold': 9}}
    if precision == 'fp16': cfg['fp16'] = {'enabled': True, 'initial_scale_power': 12, 'loss_scale_window': 2}
    if precision == 'bf16': cfg['bf16'] = {'enabled': True}
    return cfg

def engine_for(stage, precision='fp32', seed=0, gas=2, dropout=0.1):
    import flexrt
    return flexrt.initialize(model=make_model(seed, dropout), config=config(stage, precision, gas))[0]

def random_steps(engine, steps):
    "Steps on data drawn from this rank's torch generator (so resuming must restore it); per step, the mean loss and the gradient norm"
    out, gas = [], engine.gradient_accumulation_steps()
    for _ in range(steps):
        total = 0.
        for _ in range(gas):
            ids = torch.randint(0, VOCAB, (engine.train_micro_batch_size_per_gpu(), 4))
            loss = F.cross_entropy(engine(ids).float(), ids[:, 0])
            engine.backward(loss); engine.step(); total += loss.item()
        out.append((total / gas, engine.get_global_grad_norm()))
    return out

def snapshot(engine):
    "Whole fp32 parameters and buffers (ZeRO-3 parameters gathered), the counters, the lr and the loss scale"
    from flexrt.zero.stage3.gathered import GatheredParameters
    with GatheredParameters(engine.module.parameters(), enabled=engine.optimizer.stage == 3):
        tensors = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return tensors, (engine.global_steps, engine.global_samples, engine.skipped_steps, engine.micro_steps), engine.get_lr(), engine.precision.loss_scale

# ---------------------------------------------------------------------------------------------------------------
# exact resume: 2N steps straight == N steps, save, new process group, load, N steps (bitwise on CPU)

def straight_and_save(rank, world, stage, precision, d):
    torch.manual_seed(1000 + rank)
    e = engine_for(stage, precision)
    torch.manual_seed(1000 + rank)
    straight = random_steps(e, 2 * N); after = snapshot(e); e.close()
    e = engine_for(stage, precision)
    torch.manual_seed(1000 + rank)
    first = random_steps(e, N)
    e.save_checkpoint(d, client_state={'epoch': 7, 'position': torch.tensor([rank, N])})
    e.close()
    return straight, first, after

def resume(rank, world, stage, precision, d):
    e = engine_for(stage, precision, seed=99)   # other initial weights: everything must come from the checkpoint
    torch.manual_seed(5)                         # and another random state
    path, client = e.load_checkpoint(d)
    rest = random_steps(e, N)
    out = rest, snapshot(e), client, Path(path).name
    e.close()
    return out

@pytest.mark.parametrize('precision', ['fp32', 'fp16'])
@pytest.mark.parametrize('stage', [0, 1, 2, 3])
def test_exact_resume_is_bitwise(tmp_path, stage, precision):
    saved = run_distributed(straight_and_save, 2, args=(stage, precision, str(tmp_path)))
    resumed = run_distributed(resume, 2, args=(stage, precision, str(tmp_path)))
    for (straight, first, after), (rest, snap, client, tag) in zip(saved, resumed):
        assert first + rest == straight                  # identical losses and gradient norms, bit for bit
        tensors, counters, lr, scale = after
        assert snap[1:] == (counters, lr, scale)
        assert tensors.keys() == snap[0].keys()
        for k in tensors: assert torch.equal(tensors[k], snap[0][k]), k
        assert tag == f'global_step{N}' and client['epoch'] == 7 and torch.equal(client['position'], torch.tensor([0, N]))
    if precision == 'fp16': assert saved[0][2][3] != 2.0 ** 12   # the scaler moved, so restoring its state mattered

# ---------------------------------------------------------------------------------------------------------------
# resharding: save at 2 or 4 ranks, load at 1, 2 and 4 ranks into every stage; the same losses and gradient norms as one process

def batches(batch=BATCH):
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, VOCAB, (2 * N, batch, 5), generator=g)

def global_steps(engine, rank, world, first, steps):
    "Steps `first`..`first+steps-1` of the fixed data, this rank's share of each global batch; per step, its part of the loss and the gradient norm"
    batch, gas, micro = engine.train_batch_size(), engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu()
    out, data = [], batches(batch)
    for s in range(first, first + steps):
        total = 0.
        for k in range(gas):
            ids = data[s, (rank * gas + k) * micro:(rank * gas + k + 1) * micro]
            loss = F.cross_entropy(engine(ids).float(), ids[:, 0], reduction='sum') / batch * world * gas
            engine.backward(loss); engine.step(); total += loss.item() / (world * gas)
        out.append((total, engine.get_global_grad_norm()))
    return out

def whole_steps(ranks)->tuple: # (losses, norms), one of each per step
    "The ranks' `global_steps`: each step's loss (the sum of the ranks' parts) and gradient norm (the same on every rank)"
    steps = list(zip(*ranks))
    for s, parts in enumerate(steps): assert len({n for _, n in parts}) == 1, f'step {s}: the ranks report different gradient norms {parts}'
    return [sum(l for l, _ in parts) for parts in steps], [parts[0][1] for parts in steps]

def assert_like_reference(ranks, want:tuple, where): # want: the reference's (losses, norms) of these steps
    "The ranks' `global_steps` give the reference's losses and gradient norms (an unscaled gradient moves the norm, even where Adam and clipping hide it from the losses)"
    losses, norms = whole_steps(ranks)
    assert losses == pytest.approx(want[0], abs=1e-5), (where, 'losses', losses, want[0])
    assert norms == pytest.approx(want[1], rel=1e-5), (where, 'gradient norms', norms, want[1])

def reference_losses(batch=BATCH):
    "One process, the whole batch per step, plain torch: the losses and gradient norms (before clipping) of all 2N steps, the final weights"
    model = make_model(dropout=0.)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.02, weight_decay=0.01)
    import flexrt.schedulers as S
    sched = S.WarmupDecayLR(opt, warmup_num_steps=2, total_num_steps=10)
    losses, norms = [], []
    for ids in batches(batch):
        loss = F.cross_entropy(model(ids), ids[:, 0])
        loss.backward(); norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
        opt.step(); sched.step(); opt.zero_grad(); losses.append(loss.item())
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}

def save_stages(rank, world, root):
    out = {}
    for stage in range(4):
        e = engine_for(stage, gas=1, dropout=0.)
        out[stage] = global_steps(e, rank, world, 0, N)
        e.save_checkpoint(Path(root, f'stage{stage}'), tag='t')
        e.close()
    return out

def load_stages(rank, world, root):
    out = {}
    for saved in range(4):
        for stage in range(4):
            e = engine_for(stage, gas=1, dropout=0., seed=123)
            with warnings.catch_warnings(): warnings.simplefilter('ignore'); e.load_checkpoint(Path(root, f'stage{saved}'))
            assert (e.global_steps, e.global_samples) == (N, N * BATCH)
            out[saved, stage] = global_steps(e, rank, world, N, N), snapshot(e)[0]
            e.close()
    return out

@pytest.fixture(scope='module')
def ref(): return reference_losses()

@pytest.mark.parametrize('save_world', [2, 4])
def test_reshard_to_any_world_size_and_stage(tmp_path, ref, save_world):
    losses, norms, final = ref
    saved = run_distributed(save_stages, save_world, args=(str(tmp_path),), timeout=120)
    for stage in range(4): assert_like_reference([r[stage] for r in saved], (losses[:N], norms[:N]), (save_world, stage))
    for world in (1, 2, 4):
        results = run_distributed(load_stages, world, args=(str(tmp_path),), timeout=180)
        for (saved, stage), (_, tensors) in results[0].items():
            assert_like_reference([r[saved, stage][0] for r in results], (losses[N:], norms[N:]), (save_world, saved, world, stage))
            for k, v in final.items():
                assert torch.allclose(tensors[k].float(), v.float(), atol=1e-5), (save_world, saved, world, stage, k)

def load_accumulations(rank, world, root, accumulations):
    "Load each stage's checkpoint (saved with accumulation 1) with another accumulation and micro-batch, same global batch"
    out = {}
    for gas in accumulations:
        for saved in range(4):
            stage = (saved + 1) % 4   # into another stage, too
            e = engine_for(stage, gas=gas, dropout=0., seed=123)
            assert e.train_batch_size() == BATCH and e.train_micro_batch_size_per_gpu() * gas * world == BATCH
            with warnings.catch_warnings(): warnings.simplefilter('ignore'); e.load_checkpoint(Path(root, f'stage{saved}'))
            assert (e.global_steps, e.global_samples) == (N, N * BATCH)
            losses = global_steps(e, rank, world, N, N)
            assert (e.global_steps, e.global_samples) == (2 * N, 2 * N * BATCH)   # optimizer steps and samples stay right
            out[gas, saved] = losses
            e.close()
    return out

def test_resume_with_another_accumulation_and_micro_batch(tmp_path, ref):
    "Saved on 2 ranks with accumulation 1; resumed on 1 rank with accumulation 2 and 4 (and on 2 with 2, 4): the reference"
    losses, norms, _ = ref
    run_distributed(save_stages, 2, args=(str(tmp_path),), timeout=120)
    for world, accumulations in ((1, (2, 4)), (2, (2,))):
        results = run_distributed(load_accumulations, world, args=(str(tmp_path), accumulations), timeout=240)
        for key in results[0]: assert_like_reference([r[key] for r in results], (losses[N:], norms[N:]), (world, key))

def test_loading_inside_an_accumulation_window_warns_and_starts_a_fresh_one(tmp_path):
    e = engine_for(1, gas=2)
    ids = torch.randint(0, VOCAB, (4, 4))
    for _ in range(2): e.backward(F.cross_entropy(e(ids), ids[:, 0])); e.step()
    e.save_checkpoint(tmp_path, tag='t')
    e.backward(F.cross_entropy(e(ids), ids[:, 0])); e.step()   # one micro-batch into the next window
    with pytest.warns(UserWarning, match='1 of 2 micro-batches accumulated.*dropped.*fresh window'): e.load_checkpoint(tmp_path, tag='t')
    assert e.global_steps == 1
    e.backward(F.cross_entropy(e(ids), ids[:, 0])); e.step(); assert e.global_steps == 1   # a whole window again
    e.backward(F.cross_entropy(e(ids), ids[:, 0])); e.step(); assert e.global_steps == 2
    e.close()

# ---------------------------------------------------------------------------------------------------------------
# consolidate and the 16-bit model

def consolidate_rank(rank, world, d):
    e = engine_for(3, 'bf16', gas=1)
    random_steps(e, 2)
    e.save_checkpoint(d)
    e.save_16bit_model(d, 'model16.bin')
    from flexrt.zero.stage3.gathered import GatheredParameters
    with GatheredParameters(e.module.parameters()):
        working = {k: v.detach().clone() for k, v in e.module.state_dict().items()}
    names = {p: n for n, p in e.module.named_parameters()}
    masters = [(names[p], s, m.detach().view(-1)[off:off + n].clone())   # this rank's pieces of the fp32 masters
               for m, pieces, _ in e.optimizer.fragments() for p, s, n, off in pieces]
    e.close()
    return working, masters

def test_consolidate_and_save_16bit_model(tmp_path):
    from flexrt.checkpoint import consolidate
    results = run_distributed(consolidate_rank, 2, args=(str(tmp_path),))
    working, sd = results[0][0], consolidate(tmp_path)
    pieces = [piece for _, masters in results for piece in masters]
    assert {n for n, *_ in pieces} == {'emb.weight', 'body.0.weight', 'body.0.bias', 'body.3.weight', 'body.3.bias'}
    for name, start, values in pieces:                      # the fp32 masters of every rank, exactly
        assert torch.equal(sd[name].view(-1)[start:start + values.numel()], values), name

    assert list(sd) == list(working)
    assert sd['emb.weight'] is sd['head.weight']           # tied names share one tensor
    for k, v in working.items():
        if v.is_floating_point():
            assert sd[k].dtype == torch.float32                    # fp32 masters, not the bf16 working copy
            assert torch.equal(sd[k].to(torch.bfloat16), v), k     # which is the master rounded
        else: assert torch.equal(sd[k], v)
    sixteen = torch.load(tmp_path / 'model16.bin', weights_only=True)
    assert list(sixteen) == list(working) and all(torch.equal(sixteen[k], working[k]) for k in working)
    assert sixteen['emb.weight'].dtype == torch.bfloat16

# ---------------------------------------------------------------------------------------------------------------
# what is restored with the switches, frozen parameters left out

def switches_rank(rank, world, d):
    e = engine_for(2, gas=1, dropout=0.)
    random_steps(e, 2)
    e.save_checkpoint(d, exclude_frozen_parameters=True)
    trained = snapshot(e)[0]; e.close()
    e = engine_for(1, gas=1, seed=5, dropout=0.)
    frozen = e.module.frozen.weight.detach().clone()
    e.load_checkpoint(d, load_module_only=True)
    only = (e.global_steps, len(e.basic_optimizer.state), torch.equal(e.module.frozen.weight, frozen),
            torch.equal(e.module.body[0].weight, trained['body.0.weight']))
    e.close()
    e = engine_for(1, gas=1, seed=5, dropout=0.)
    e.load_checkpoint(d, load_optimizer_states=False)
    no_opt = (e.global_steps, len(e.basic_optimizer.state), torch.equal(e.module.body[0].weight, trained['body.0.weight']))
    e.close()
    return only, no_opt

def test_load_module_only_and_without_optimizer_state(tmp_path):
    for only, no_opt in run_distributed(switches_rank, 2, args=(str(tmp_path),)):
        assert only == (0, 0, True, True)       # weights only; frozen ones were left out, so they keep their values
        assert no_opt == (2, 0, True)           # counters restored, the optimizer starts afresh

# ---------------------------------------------------------------------------------------------------------------
# errors: clear, on every rank, and nothing changed

def errors_rank(rank, world, d):
    import flexrt
    from flexrt.checkpoint import CheckpointError
    e = engine_for(1, gas=1)
    random_steps(e, 1)
    e.save_checkpoint(d, tag='good')
    before = snapshot(e)[0]
    msgs = {}
    def expect(key, fn, exc=CheckpointError):
        try: fn()
        except exc as err: msgs[key] = str(err)
        else: msgs[key] = None
    class Wide(Net):
        def __init__(self):
            super().__init__(); self.body[0] = nn.Linear(DIM, 14); self.body[3] = nn.Linear(14, DIM)
    torch.manual_seed(0)
    wide = flexrt.initialize(model=Wide(), config=config(1, gas=1))[0]
    expect('shape', lambda: wide.load_checkpoint(d, tag='good'))
    wide.close()
    expect('tag', lambda: e.load_checkpoint(d, tag='missing'))
    expect('client', lambda: e.save_checkpoint(d, tag='bad', client_state={'obj': object()} if rank == 1 else {}), exc=Exception)
    unchanged = all(torch.equal(v, snapshot(e)[0][k]) for k, v in before.items())
    e.close()
    return msgs, unchanged, sorted(os.listdir(d))

def test_errors_are_clear_raised_everywhere_and_change_nothing(tmp_path):
    for rank, (msgs, unchanged, files) in enumerate(run_distributed(errors_rank, 2, args=(str(tmp_path),))):
        assert 'shape mismatch' in msgs['shape'] and 'body.0.weight' in msgs['shape']
        assert "no complete checkpoint with tag 'missing'" in msgs['tag'] and 'good' in msgs['tag']
        assert ('builtins.object' if rank == 1 else 'failed on rank 1') in msgs['client']
        assert unchanged
        assert files == ['good', 'latest', 'zero_to_fp32.py']      # the refused save left nothing behind

def files_of(d)->dict:
    "Every file under `d` with its bytes' digest"
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(d).rglob('*')) if p.is_file()}

def damage(path):
    "Rewrite a checkpoint file as a valid torch file with other bytes: only its checksum can tell"
    payload = torch.load(path, weights_only=True)
    payload['damaged'] = True
    torch.save(payload, path)

def damaged_rank(rank, world, root):
    "Per file of a stage-1 checkpoint: a copy with that file damaged, loaded on every rank; what each load did"
    from flexrt import comm
    e = engine_for(1, gas=1)
    random_steps(e, 1)
    e.save_checkpoint(Path(root, 'good'), tag='t')
    before, out = snapshot(e)[0], {}
    for name in sorted(json.loads(Path(root, 'good', 't', 'manifest.json').read_text())['files']):
        d = Path(root, name)
        if rank == 0: shutil.copytree(Path(root, 'good'), d); damage(d / 't' / name)
        comm.barrier()
        on_disk = files_of(d)
        try: e.load_checkpoint(d); outcome = 'loaded'
        except Exception as err: outcome = f'{type(err).__name__}: {err}'
        out[name] = outcome, files_of(d) == on_disk
    unchanged = all(torch.equal(v, snapshot(e)[0][k]) for k, v in before.items())
    intact = e.load_checkpoint(Path(root, 'good'))[0]   # the ranks are still in step: the next collective works
    e.close()
    return out, unchanged, intact

def test_a_file_one_rank_verifies_fails_the_load_on_every_rank(tmp_path):
    "Each rank checksums only its share of the files; a damaged one raises CheckpointError on every rank, none waits in a collective"
    for rank, (outcomes, unchanged, intact) in enumerate(run_distributed(damaged_rank, 2, args=(str(tmp_path),), timeout=30)):
        assert sorted(outcomes) == ['model_states.pt', 'mp_rank_00_model_states.pt', 'rank_00000.pt', 'rank_00001.pt']
        for name, (outcome, same_files) in outcomes.items():
            assert outcome.startswith('CheckpointError: the checkpoint is corrupted'), (rank, name, outcome)
            assert f"{Path(tmp_path, name, 't', name)} " in outcome, (rank, name, outcome)   # the damaged file, by path
            assert same_files, (rank, name, 'the refused load changed files on disk')
        assert unchanged, (rank, 'a refused load changed the engine')
        assert intact == str(tmp_path / 'good' / 't'), rank

def tag_rank(rank, world, d, mode):
    import flexrt
    cfg = {**config(0, gas=1), 'checkpoint': {'tag_validation': mode}}
    e = flexrt.initialize(model=make_model(), config=cfg)[0]
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter('always')
            e.save_checkpoint(d, tag=f'rank{rank}')
        return [str(x.message) for x in w], sorted(os.listdir(d))
    except Exception as err: return f'{type(err).__name__}: {err}'
    finally: e.close()

def test_tag_validation(tmp_path):
    warned = run_distributed(tag_rank, 2, args=(str(tmp_path / 'w'), 'Warn'))
    assert all(any("not the same on every rank: pass one tag to save_checkpoint on all ranks; saving under rank 0's tag 'rank0'" in m
                   for m in w) for w, _ in warned)
    assert warned[0][1] == ['latest', 'rank0', 'zero_to_fp32.py']
    assert run_distributed(tag_rank, 2, args=(str(tmp_path / 'i'), 'Ignore'))[0] == ([], ['latest', 'rank0', 'zero_to_fp32.py'])
    failed = run_distributed(tag_rank, 2, args=(str(tmp_path / 'f'), 'Fail'))
    assert all(isinstance(f, str) and f.startswith('TagMismatchError') and 'not the same on every rank' in f for f in failed)   # a CheckpointError and AssertionError
    assert not (tmp_path / 'f').exists() or os.listdir(tmp_path / 'f') == []

# ---------------------------------------------------------------------------------------------------------------
# one process: corruption, malicious pickles, missing checkpoints

@pytest.fixture
def saved(tmp_path):
    e = engine_for(0, gas=1)
    random_steps(e, 1)
    e.save_checkpoint(tmp_path)
    yield e, tmp_path, tmp_path / 'global_step1'
    e.close()

def test_truncated_or_altered_shard_fails_its_checksum(saved):
    from flexrt.checkpoint import CheckpointError
    e, d, ckpt = saved
    shard = ckpt / 'rank_00000.pt'
    data = shard.read_bytes()
    shard.write_bytes(data[:len(data) // 2])
    with pytest.raises(CheckpointError, match=r'rank_00000.pt has \d+ bytes, the manifest says'): e.load_checkpoint(d)
    shard.write_bytes(data[:-20] + bytes([data[-20] ^ 0x10]) + data[-19:])
    with pytest.raises(CheckpointError, match='rank_00000.pt fails its checksum'): e.load_checkpoint(d)
    shard.write_bytes(data)
    assert e.load_checkpoint(d)[0] == str(ckpt)

class Payload:
    def __reduce__(self): return (os.system, (f'touch {MARKER}',))
MARKER = '/tmp/flexrt_ckpt_pwned'

def test_malicious_pickle_is_refused_even_with_a_valid_checksum(saved):
    from flexrt.checkpoint import CheckpointError
    from flexrt.checkpoint.storage import checksum_file
    e, d, ckpt = saved
    Path(MARKER).unlink(missing_ok=True)
    torch.save({'masters': [], 'values': [], 'rng': Payload()}, ckpt / 'rank_00000.pt')
    manifest = json.loads((ckpt / 'manifest.json').read_text())
    manifest['files']['rank_00000.pt'] = {'size': (ckpt / 'rank_00000.pt').stat().st_size, 'xxh3_128': checksum_file(ckpt / 'rank_00000.pt')}
    (ckpt / 'manifest.json').write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match='unpickling arbitrary code, which flexrt refuses'): e.load_checkpoint(d)
    assert not Path(MARKER).exists()

def test_missing_checkpoints(tmp_path, saved):
    from flexrt.checkpoint import CheckpointError
    e, d, _ = saved
    with pytest.warns(UserWarning, match="no 'latest' file"): assert e.load_checkpoint(tmp_path / 'nowhere') == (None, None)
    with pytest.raises(CheckpointError, match="no complete checkpoint with tag 'global_step5'.*available tags: global_step1"):
        e.load_checkpoint(d, tag='global_step5')
    (d / 'latest').write_text('gone')
    with pytest.raises(CheckpointError, match="tag 'gone'"): e.load_checkpoint(d)
    with pytest.raises(ValueError, match='needs a save_dir'): e.save_checkpoint('')
    with pytest.raises(ValueError, match="tag '../x'"): e.save_checkpoint(d, tag='../x')
    with pytest.raises(TypeError, match=r"client_state\['f'\] is a builtins.builtin_function_or_method"): e.save_checkpoint(d, client_state={'f': print})

# ---------------------------------------------------------------------------------------------------------------
# crash safety: a real SIGKILL at each moment of a save where files are on their way

def crash_engine(train_batch_size):
    import flexrt
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])   # 2.1M parameters: 25 MB a checkpoint
    return flexrt.initialize(model=model, config={'train_batch_size': train_batch_size, 'steps_per_print': 10**6,
                                                  'optimizer': {'type': 'Adam', 'params': {'lr': 1e-3}},
                                                  'zero_optimization': {'stage': 1}})[0]

CRASH_WORKER = r'''
import os, sys, threading, torch
sys.path.insert(0, sys.argv[2])
from helpers import run_distributed
from test_checkpoint import crash_engine
def loop(rank, world, d, pause_rank, pause_at):
    "Train and save forever; in the third save, rank `pause_rank` stops before its `pause_at`-th file rename and says so"
    e, real_replace, saves, renames = crash_engine(4), os.replace, [0], [0]
    def replace(src, dst, *args, **kwargs):
        if saves[0] == 3 and rank == pause_rank:
            if renames[0] == pause_at:
                print('PAUSED', flush=True)
                threading.Event().wait()   # until the SIGKILL
            renames[0] += 1
        return real_replace(src, dst, *args, **kwargs)
    os.replace = replace
    while True:
        e.backward(e(torch.ones(2, 512)).sum()); e.step()
        saves[0] += 1
        e.save_checkpoint(d, client_state={'step': e.global_steps})
run_distributed(loop, 2, args=(sys.argv[1], int(sys.argv[3]), int(sys.argv[4])), timeout=10**6)
'''

# Where the worker stops (rank, rename): every file of a save is written to a temporary name, then renamed. Rank 0
# renames its shard, the model states, the manifest, the staging directory into place, then `latest`; rank 1 its shard.
PAUSES = [(0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (1, 0)]

def wait_for_pause(proc, timeout=120):
    "Block until the worker prints PAUSED (an event from the process, read from its stdout)"
    import select
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], deadline - time.monotonic())
        if not ready: break
        line = proc.stdout.readline()
        if not line: raise AssertionError(f'the worker ended (exit code {proc.wait()}) before its pause')
        if line.startswith('PAUSED'): return
    raise AssertionError(f'the worker did not reach its pause within {timeout} s')

def test_sigkill_during_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    "A real SIGKILL at each moment of a save where files are on their way: the last published checkpoint still loads"
    from flexrt.checkpoint import consolidate
    from flexrt.checkpoint.layout import read_latest, available_tags
    script = tmp_path / 'worker.py'; script.write_text(CRASH_WORKER)
    for attempt, (pause_rank, pause_at) in enumerate(PAUSES):
        d = tmp_path / f'run{attempt}'
        proc = subprocess.Popen([sys.executable, str(script), str(d), str(Path(__file__).parent), str(pause_rank), str(pause_at)],
                                start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try: wait_for_pause(proc)
        finally: os.killpg(proc.pid, signal.SIGKILL); proc.wait(); proc.stdout.close()
        tag = read_latest(d)
        assert tag == 'global_step2', (attempt, tag)   # saves 1 and 2 completed; the third was killed
        newest = max(int(t.removeprefix('global_step')) for t in available_tags(d))
        assert (any(p.name.endswith(('.partial', '.tmp')) for p in d.rglob('*'))   # files being written, or
                or newest != int(tag.removeprefix('global_step'))), attempt         # published, latest not yet moved
        assert len(consolidate(d)) == 16      # every file's size and checksum verified
        e = crash_engine(2)                   # one process loads what two saved
        path, client = e.load_checkpoint(d)
        assert Path(path).name == tag == f'global_step{e.global_steps}' and client == {'step': e.global_steps}
        e.close()
        shutil.rmtree(d)

# a crash inside the swap of a re-saved tag: the old directory moved aside to `.<tag>.replaced`, then the new one in place

class Crash(BaseException):
    "The process dies here: nothing after it runs, not even the save's clean-up"

# where the second save dies (before or after its rename onto a name), what that leaves, and which save a load must find
SWAP_CRASHES = {'nothing moved': ('before', '.t.replaced', ['.t.partial', 'latest', 't', 'zero_to_fp32.py'], 't', 1),
                'old moved aside, new not in place': ('before', 't', ['.t.partial', '.t.replaced', 'latest', 'zero_to_fp32.py'], '.t.replaced', 1),
                'both present': ('after', 't', ['.t.replaced', 'latest', 't', 'zero_to_fp32.py'], 't', 2)}

def crashed_resave(d, when:str, onto:str):
    "Save tag 't', train on, save 't' again until the crash; the weights of both saves"
    e = engine_for(0, gas=1, dropout=0.)
    random_steps(e, 1); e.save_checkpoint(d, tag='t', client_state={'save': 1}); first = snapshot(e)[0]
    random_steps(e, 1); second = snapshot(e)[0]
    real = os.replace
    def replace(src, dst, *args, **kwargs):
        hit = Path(dst) == Path(d, onto)
        if hit and when == 'before': raise Crash()
        real(src, dst, *args, **kwargs)
        if hit: raise Crash()
    with mock.patch('os.replace', replace), mock.patch('flexrt.checkpoint.save_load.discard_staging', lambda *a: None):
        with pytest.raises(Crash): e.save_checkpoint(d, tag='t', client_state={'save': 2})
    e.close()
    return first, second

@pytest.mark.parametrize('crash', SWAP_CRASHES)
def test_a_crash_inside_the_swap_of_a_resaved_tag(tmp_path, crash):
    "A load finds the complete checkpoint (the old one until the new one is in place), and the next save leaves a clean directory"
    d, (when, onto, left, found, save) = tmp_path / 'ckpt', SWAP_CRASHES[crash]
    saved = dict(zip((1, 2), crashed_resave(d, when, onto)))
    assert sorted(os.listdir(d)) == left, (crash, 'the crash left', sorted(os.listdir(d)))
    e = engine_for(0, gas=1, dropout=0., seed=99)
    assert e.load_checkpoint(d) == (str(d / found), {'save': save}), crash
    got = snapshot(e)[0]
    for k, v in saved[save].items(): assert torch.equal(got[k], v), (crash, k)
    random_steps(e, 1); e.save_checkpoint(d, tag='t', client_state={'save': 3}); third = snapshot(e)[0]
    assert sorted(os.listdir(d)) == ['latest', 't', 'zero_to_fp32.py'], (crash, 'left behind', sorted(os.listdir(d)))
    e.close()
    e = engine_for(0, gas=1, dropout=0., seed=99)
    assert e.load_checkpoint(d) == (str(d / 't'), {'save': 3}), crash
    got = snapshot(e)[0]
    for k, v in third.items(): assert torch.equal(got[k], v), (crash, k)
    e.close()

# ---------------------------------------------------------------------------------------------------------------
# MoE: expert parameters carry their expert-parallel rank in their key; resharding 4 ranks -> 2 keeps every expert

def moe_engine(rank, stage, seed=0):
    import flexrt
    from test_engine_fp16_moe import MoENet
    cfg = {'train_batch_size': 8, 'steps_per_print': 1000, 'optimizer': {'type': 'AdamW', 'params': {'lr': 0.05}},
           'zero_optimization': {'stage': stage, 'reduce_bucket_size': 20}}
    return flexrt.initialize(model=MoENet(seed, seed + 100 + rank % 2, 2), config=cfg)[0]

def moe_save_rank(rank, world, d, stage):
    e = moe_engine(rank, stage)
    for _ in range(2):
        x = torch.randn(e.train_micro_batch_size_per_gpu(), 6)
        e.backward(e(x).pow(2).mean()); e.step()
    e.save_checkpoint(d, tag='moe')
    params = {n: p.detach().clone() for n, p in e.module.named_parameters()}
    e.close()
    return params

def moe_load_rank(rank, world, d, d2, stage):
    e = moe_engine(rank, stage, seed=7)
    with warnings.catch_warnings(): warnings.simplefilter('ignore'); e.load_checkpoint(d, tag='moe')
    params = {n: p.detach().clone() for n, p in e.module.named_parameters()}
    e.save_checkpoint(d2, tag='moe')
    e.close()
    return params

def saved_tensors(d):
    "Every saved (key, field) assembled whole, and each key's scalar state, from a checkpoint directory"
    from flexrt.checkpoint.layout import read_manifest
    from flexrt.checkpoint.storage import safe_load
    from flexrt.checkpoint.shards import FragmentIndex
    world = read_manifest(d)['world_size']
    index = FragmentIndex([safe_load(Path(d, f'rank_{r:05d}.pt')) for r in range(world)])
    out = {}
    for key, frags in index.by_key.items():
        numel = max(s + n for _, s, n, _, _ in frags)
        for field in ['master', *sorted(index.state_keys(key))]:
            t = torch.zeros(numel); index.copy_into(t, key, field); out[key, field] = t
        out[key, 'scalars'] = index.scalars_at(key, 0)
    return out

@pytest.mark.parametrize('save_stage,load_stage', [(0, 2), (2, 1), (1, 0), (3, 1), (2, 3)])
def test_moe_experts_reshard_with_their_optimizer_state(tmp_path, save_stage, load_stage):
    d, d2 = tmp_path / 'w4', tmp_path / 'w2'
    saved = run_distributed(moe_save_rank, 4, args=(str(d), save_stage))
    loaded = run_distributed(moe_load_rank, 2, args=(str(d), str(d2), load_stage))
    for rank, params in enumerate(loaded):           # rank r of 2 holds expert r, as ranks r and r + 2 of 4 did
        for n, p in params.items(): assert torch.equal(p, saved[rank][n]), (rank, n)
    before, after = saved_tensors(d / 'moe'), saved_tensors(d2 / 'moe')
    assert before.keys() == after.keys() and {k for k, _ in before} >= {'expert.weight@ep0', 'expert.weight@ep1', 'shared.weight'}
    for k, v in before.items():
        assert (v.keys() == after[k].keys() and all(torch.equal(v[s], after[k][s]) for s in v)) if isinstance(v, dict) \
            else torch.equal(v, after[k]), k

# ---------------------------------------------------------------------------------------------------------------
# one process: a parameter without optimizer state, and a save in the middle of an accumulation window

class WithUnused(nn.Module):
    def __init__(self):
        super().__init__(); torch.manual_seed(0)
        self.used, self.unused = nn.Linear(4, 2), nn.Linear(3, 3)   # AdamW keeps no state for `unused`, first in the flat master
    def forward(self, x): return self.used(x)

def test_state_missing_for_some_parameters_loads_into_a_flat_shard(tmp_path):
    import flexrt
    cfg = lambda stage: {'train_batch_size': 2, 'optimizer': {'type': 'AdamW', 'params': {'lr': 0.1}}, 'zero_optimization': {'stage': stage}}
    e = flexrt.initialize(model=WithUnused(), config=cfg(0))[0]
    for _ in range(2): e.backward(e(torch.ones(2, 4)).sum()); e.step()
    assert len(e.basic_optimizer.state) == 2                  # used.weight and used.bias only
    e.save_checkpoint(tmp_path); e.close()
    e = flexrt.initialize(model=WithUnused(), config=cfg(1))[0]   # one flat master holding both layers
    e.load_checkpoint(tmp_path)
    (state,) = e.basic_optimizer.state.values()
    assert state['step'].item() == 2 and (state['exp_avg'] != 0).sum() == 10   # used's 8 + 2 elements; unused's 12 stay zero
    e.backward(e(torch.ones(2, 4)).sum()); e.step()           # and training goes on
    e.close()

def test_saving_inside_an_accumulation_window_warns(tmp_path):
    e = engine_for(1, gas=2)
    ids = torch.randint(0, VOCAB, (4, 4))
    e.backward(F.cross_entropy(e(ids), ids[:, 0])); e.step()
    with pytest.warns(UserWarning, match='middle of a gradient accumulation window'): e.save_checkpoint(tmp_path)
    e.backward(F.cross_entropy(e(ids), ids[:, 0])); e.step()
    with warnings.catch_warnings(): warnings.simplefilter('error'); e.save_checkpoint(tmp_path)
    e.close()

# ---------------------------------------------------------------------------------------------------------------
# every element is written once: no replica written twice, nothing a rank holds only in part written as a whole

def elements_rank(rank, world, root):
    import flexrt
    for stage in range(4):   # one bucket for all: some parameters lie wholly in one rank's chunk
        cfg = config(stage, gas=1); cfg['zero_optimization']['reduce_bucket_size'] = 10 ** 6
        e = flexrt.initialize(model=make_model(), config=cfg)[0]
        random_steps(e, 1)
        e.save_checkpoint(Path(root, f's{stage}'), tag='t')
        e.close()

def test_every_element_is_saved_once(tmp_path):
    from flexrt.checkpoint.storage import safe_load
    run_distributed(elements_rank, 2, args=(str(tmp_path),))
    model = make_model()
    trainable = {id(p): p.numel() for p in model.parameters() if p.requires_grad}
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad) + sum(b.numel() for b in model.buffers())
    for stage in range(4):
        payloads = [safe_load(tmp_path / f's{stage}' / 't' / f'rank_{r:05d}.pt') for r in range(2)]
        masters = sum(sum(n for _, _, n, _ in rec['pieces']) for p in payloads for rec in p['masters'])
        state = {k: sum(rec['state'][k].numel() for p in payloads for rec in p['masters'] if k in rec['state'])
                 for k in ('exp_avg', 'exp_avg_sq')}
        values = sum(rec['value'].numel() for p in payloads for rec in p['values'])
        padding = 2 * 8 if stage else 0    # flat shards: at most one element per rank and parameter (stage 3) or bucket
        assert masters + values == sum(trainable.values()) + frozen, stage   # each tensor once, as a master or a value
        assert masters >= sum(trainable.values()), stage    # stage 0's optimizer also holds the frozen layer: a master
        assert all(sum(trainable.values()) <= n <= sum(trainable.values()) + padding for n in state.values()), (stage, state)
