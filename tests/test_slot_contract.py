"""The optimizer-slot contract (flexrt.zero.base.OptimizerSlot) is all the engine and flexrt.checkpoint need: a toy slot
defined here — stage 0 with its masters in ONE flat fp32 buffer in reverse parameter order and its gradients averaged
in fp64 — plugs into the engine through `initialize(..., optimizer_slot=...)`, trains like plain torch, and its
checkpoints reshard to another world size and into real ZeRO stages (and back) through flexrt.checkpoint unchanged."""
import warnings
from pathlib import Path
import pytest, torch
from helpers import run_distributed
from flexrt import comm as dist
from flexrt.zero.base import OptimizerSlot, consecutive
from test_checkpoint import make_model, config, global_steps, reference_losses, assert_like_reference, N, BATCH

class ReversedFp64Slot(OptimizerSlot):
    "Replicated (stage-0-like): one flat fp32 master, parameters in reverse order; gradients all-reduced in fp64"
    stage = 'toy'
    def __init__(self, args): # a flexrt.zero.SlotArgs
        self.module, self.group, self.optimizer = args.module, args.group, args.optimizer
        args.precision.cast_model(args.module)
        self.params = [p for p in reversed(list(args.module.parameters())) if p.requires_grad]
        self.master = torch.nn.Parameter(torch.cat([p.detach().reshape(-1).float() for p in self.params]))
        assert len(self.optimizer.param_groups) == 1, "the toy steps one param group"
        self.optimizer.param_groups[0]['params'] = [self.master]
        self.views = list(self.master.detach().split([p.numel() for p in self.params]))
        self.grad64, self.comm_bytes = None, 0

    def set_boundary(self, is_boundary): pass   # gradients accumulate in p.grad; reduced at the boundary
    def reduced_gradients(self):
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).double() for p in self.params])
        if dist.get_world_size(self.group) > 1: dist.all_reduce(flat, group=self.group)
        self.grad64 = flat.div_(dist.get_world_size(self.group))
        self.comm_bytes += flat.nbytes
        self.master.grad = self.grad64.float()
        return [self.master.grad]
    def clip_grad_norm(self, max_norm):
        norm = float(self.grad64.norm())
        if max_norm > 0 and norm > max_norm:
            self.master.grad.mul_(max_norm / (norm + 1e-6)); return norm, norm * max_norm / (norm + 1e-6)
        return norm, norm
    def step(self): self.optimizer.step(); self.sync_model()
    def zero_grad(self, set_to_none=True):
        for p in self.params: p.grad = None
        self.master.grad = self.grad64 = None
    def memory_breakdown(self):
        params = sum(p.numel() * p.element_size() for p in self.module.parameters())
        state = self.master.nbytes + sum(t.nbytes for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t))
        return {'params': params, 'grads': 0, 'optimizer_state': state, 'total': params + state}
    def close(self): self.zero_grad()
    def fragments(self): return [consecutive(self.master, self.params, replicated=True)]
    def stepped_params(self): return list(self.params)
    @torch.no_grad()
    def sync_model(self): torch._foreach_copy_([p.data.view(-1) for p in self.params], self.views)

def engine(stage, slot=None, seed=0):
    import flexrt
    return flexrt.initialize(model=make_model(seed, dropout=0.), config=config(stage, gas=1), optimizer_slot=slot)[0]

def save_rank(rank, world, root):
    e = engine(0, ReversedFp64Slot)
    assert isinstance(e.optimizer, ReversedFp64Slot) and e.optimizer.comm_bytes == 0
    toy = global_steps(e, rank, world, 0, N)
    assert e.optimizer.comm_bytes > 0 and e.memory_breakdown()['total'] > 0
    e.save_checkpoint(Path(root, 'toy'), tag='t'); e.close()
    e = engine(2)
    stage2 = global_steps(e, rank, world, 0, N)
    e.save_checkpoint(Path(root, 'stage2'), tag='t'); e.close()
    return toy, stage2

def load_rank(rank, world, root):
    out = {}
    for saved, stage, slot in (('toy', 0, ReversedFp64Slot), ('toy', 1, None), ('toy', 3, None), ('stage2', 0, ReversedFp64Slot)):
        e = engine(stage, slot, seed=123)   # other initial weights: everything must come from the checkpoint
        with warnings.catch_warnings(): warnings.simplefilter('ignore'); e.load_checkpoint(Path(root, saved))
        assert (e.global_steps, e.global_samples) == (N, N * BATCH)
        out[saved, stage if slot is None else 'toy'] = global_steps(e, rank, world, N, N)
        e.close()
    return out

def test_a_toy_slot_trains_checkpoints_and_reshards_through_the_contract(tmp_path):
    losses, norms, _ = reference_losses()
    saved = run_distributed(save_rank, 2, args=(str(tmp_path),), timeout=120)
    for k, name in enumerate(('toy', 'stage2')): assert_like_reference([r[k] for r in saved], (losses[:N], norms[:N]), name)
    for world in (1, 2):
        results = run_distributed(load_rank, world, args=(str(tmp_path),), timeout=180)
        for key in results[0]: assert_like_reference([r[key] for r in results], (losses[N:], norms[N:]), (world, key))

def test_a_slot_missing_a_method_or_of_the_wrong_type_is_refused():
    class Partial(OptimizerSlot):
        def step(self): pass
    import flexrt
    # an abc.ABC: a slot lacking a method cannot be built, and the error names what lacks
    with pytest.raises(TypeError, match="Can't instantiate abstract class Partial.*set_boundary"):
        flexrt.initialize(model=make_model(), config=config(0, gas=1), optimizer_slot=lambda args: Partial(), dist_init_required=False)
    with pytest.raises(TypeError, match='must be a flexrt.zero.base.OptimizerSlot'):
        flexrt.initialize(model=make_model(), config=config(0, gas=1), optimizer_slot=lambda args: args.optimizer,
                          dist_init_required=False)

def explicit_reduction_rank(rank, world):
    "Per stage: the weights after 2 steps with `engine.allreduce_gradients()` (twice) before each `step()`, and without"
    import flexrt
    out = {}
    for stage in (0, 1, 2, 3):
        for explicit in (False, True):
            torch.manual_seed(0)
            e = flexrt.initialize(model=torch.nn.Linear(3, 2), config={
                'train_batch_size': 8, 'zero_optimization': {'stage': stage},
                'optimizer': {'type': 'SGD', 'params': {'lr': 0.1}}})[0]
            torch.manual_seed(rank)
            for _ in range(2):
                e.backward(e(torch.randn(4, 3)).pow(2).mean())
                if explicit:
                    e.allreduce_gradients()   # the slot's wait_for_reduction()
                    e.allreduce_gradients()   # the round is finished: nothing is reduced again
                e.step()
            out[stage, explicit] = e.module_state_dict()['weight']
            e.close()
    return out

def test_wait_for_reduction_finishes_the_round_once_at_every_stage():
    for result in run_distributed(explicit_reduction_rank, 2, timeout=120):
        for stage in (0, 1, 2, 3):
            torch.testing.assert_close(result[stage, True], result[stage, False], msg=f'stage {stage}')
