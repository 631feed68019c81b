"""Three ranks, where no parameter divides evenly: ZeRO stages 0-3 train as one process does (losses and gradient norms)
through partitions of unequal parts, padded buckets and reduce-scatters with a remainder; a 3-rank checkpoint resumes bit
for bit at 3 ranks and loads at 2 and 4 ranks, and a 2-rank checkpoint at 3, each continuing with the reference's losses
and gradient norms. Four process groups in all (3, 2, 4, 3 ranks), each running every stage."""
import warnings
from pathlib import Path
import pytest, torch
from helpers import run_distributed
from test_checkpoint import make_model, config, snapshot, global_steps, reference_losses, assert_like_reference, N

BATCH = 12   # divisible by 2, 3 and 4: the same global batch at every world size here
STAGES = (0, 1, 2, 3)

def engine(stage, seed=0):
    import flexrt
    return flexrt.initialize(model=make_model(seed, dropout=0.), config={**config(stage, gas=1), 'train_batch_size': BATCH})[0]

def save(rank, world, root):
    "Per stage: N steps, save, N more (the straight run a resume must repeat); the steps and the final weights"
    out = {}
    for stage in STAGES:
        e = engine(stage)
        first = global_steps(e, rank, world, 0, N)
        e.save_checkpoint(Path(root, f'world{world}', f'stage{stage}'), tag='t')
        out[stage] = first, global_steps(e, rank, world, N, N), snapshot(e)[0]
        e.close()
    return out

def load(rank, world, root, loads):
    "Per (saved world, saved stage, stage): a fresh engine of that stage loads the checkpoint and trains N steps"
    out = {}
    for saved_world, saved, stage in loads:
        e = engine(stage, seed=123)   # other initial weights: everything must come from the checkpoint
        with warnings.catch_warnings(): warnings.simplefilter('ignore'); e.load_checkpoint(Path(root, f'world{saved_world}', f'stage{saved}'))
        assert (e.global_steps, e.global_samples) == (N, N * BATCH)
        out[saved_world, saved, stage] = global_steps(e, rank, world, N, N), snapshot(e)[0]
        e.close()
    return out

def load_then_save(rank, world, root, loads): return load(rank, world, root, loads), save(rank, world, root)

@pytest.fixture(scope='module')
def ref():
    losses, norms, final = reference_losses(BATCH)
    return (losses[:N], norms[:N]), (losses[N:], norms[N:]), final

@pytest.fixture(scope='module')
def root(tmp_path_factory): return str(tmp_path_factory.mktemp('three_ranks'))

@pytest.fixture(scope='module')
def trained(root): return run_distributed(save, 3, args=(root,), timeout=120)

@pytest.fixture(scope='module')
def two_ranks(root, trained):
    "2 ranks load each 3-rank checkpoint into its stage, then train and save their own: (loaded, saved) per rank"
    return tuple(map(list, zip(*run_distributed(load_then_save, 2, args=(root, [(3, s, s) for s in STAGES]), timeout=120))))

def assert_continues(results, ref, world):
    "Every load continued with the reference's losses and gradient norms, to its final weights"
    _, rest, final = ref
    for key in results[0]:
        assert_like_reference([r[key][0] for r in results], rest, (world, key))
        for k, v in final.items(): assert torch.allclose(results[0][key][1][k].float(), v.float(), atol=1e-5), (world, key, k)

def test_no_parameter_divides_by_three():
    "The premise of this file: every partition of a parameter over 3 ranks has unequal parts"
    sizes = [p.numel() for p in make_model().parameters() if p.requires_grad]
    assert all(n % 3 for n in sizes + [sum(sizes)]), sizes

def test_every_stage_trains_at_three_ranks_like_one_process(ref, trained):
    first, rest, final = ref
    for stage in STAGES:
        assert_like_reference([r[stage][0] for r in trained], first, (3, stage))
        assert_like_reference([r[stage][1] for r in trained], rest, (3, stage, 'after the save'))
        for k, v in final.items(): assert torch.allclose(trained[0][stage][2][k].float(), v.float(), atol=1e-5), (stage, k)

def test_a_three_rank_checkpoint_loads_at_two_and_four_ranks(ref, root, two_ranks):
    assert_continues(two_ranks[0], ref, 2)
    assert_continues(run_distributed(load, 4, args=(root, [(3, s, (s + 1) % 4) for s in STAGES]), timeout=120), ref, 4)

def test_a_two_rank_checkpoint_loads_at_three_and_a_three_rank_one_resumes_bit_for_bit(ref, root, trained, two_ranks):
    for stage in STAGES: assert_like_reference([r[stage][0] for r in two_ranks[1]], ref[0], (2, stage))   # what was saved
    at3 = run_distributed(load, 3, args=(root, [(2, s, (s + 2) % 4) for s in STAGES] + [(3, s, s) for s in STAGES]), timeout=120)
    assert_continues(at3, ref, 3)
    for stage in STAGES:   # 3 ranks to 3 ranks: exactly the straight run
        for rank, (straight, resumed) in enumerate(zip(trained, at3)):
            (steps, tensors), (_, want_steps, want) = resumed[3, stage, stage], straight[stage]
            assert steps == want_steps, (stage, rank, steps, want_steps)
            assert all(torch.equal(v, want[k]) for k, v in tensors.items()), (stage, rank)
