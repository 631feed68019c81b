"TensorMemoryTracker: exact byte counts of live CPU tensor storages, peaks, limits, misuse and fork."
import threading
import numpy as np
import pytest, torch
from torch.utils._python_dispatch import TorchDispatchMode
from helpers import run_distributed
from flexrt.memory.tracker import TensorMemoryTracker, active_tracker

MiB = 1 << 20

@pytest.fixture
def tracker():
    with TensorMemoryTracker() as t: yield t
    assert active_tracker() is None

def test_one_mib_tensor_counts_exactly_one_mib(tracker):
    base = tracker.allocated_bytes
    t = torch.empty(MiB // 4, dtype=torch.float32)
    assert tracker.allocated_bytes - base == MiB
    v = t.view(512, 512)[::2]
    assert tracker.allocated_bytes - base == MiB        # a view adds 0
    del t
    assert tracker.allocated_bytes - base == MiB        # the view keeps the storage alive
    del v
    assert tracker.allocated_bytes == base              # freed bytes come back
    assert tracker.peak_bytes == base + MiB             # the peak keeps them

@pytest.mark.parametrize('dtype', [torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.bool,
                                   torch.complex64, torch.int64])
@pytest.mark.parametrize('shape', [(0,), (1,), (3, 5, 7), (1000, 3)])
def test_bytes_equal_numel_times_element_size(tracker, dtype, shape):
    base = tracker.allocated_bytes
    made = [torch.zeros(shape, dtype=dtype), torch.ones(shape, dtype=dtype).t().contiguous() if len(shape) == 2
            else torch.ones(shape, dtype=dtype)]
    expected = sum(t.numel() * t.element_size() for t in made)
    assert tracker.allocated_bytes - base == expected
    del made
    assert tracker.allocated_bytes == base

def test_views_and_in_place_ops_add_nothing(tracker):
    t = torch.randn(64, 32)
    base = tracker.allocated_bytes
    views = [t.view(-1), t.reshape(32, 64), t.t(), t.narrow(0, 1, 3), t[1:, ::3], t.detach(), t.diagonal(),
             t.unsqueeze(0).expand(4, 64, 32), *t.unbind(0), *t.split(7), *t.chunk(3, 1), t.as_strided((4,), (2,)),
             t.view(torch.int32), t.permute(1, 0), t.unflatten(1, (4, 8))]
    t.add_(1).mul_(2).clamp_(-1, 1)
    t[3:5] = 0
    assert tracker.allocated_bytes == base
    del views

def test_new_tensors_from_python_and_numpy_are_counted(tracker):
    base = tracker.allocated_bytes
    a = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)              # 16 B
    b = torch.from_numpy(np.arange(10, dtype=np.float64))               # 80 B, numpy's buffer
    c = torch.arange(100, dtype=torch.int16)                             # 200 B
    assert tracker.allocated_bytes - base == 296
    del a, b, c
    assert tracker.allocated_bytes == base

def test_out_tensor_growth_is_counted(tracker):
    a = torch.ones(1000)
    base = tracker.allocated_bytes
    out = torch.empty(0)
    torch.mul(a, 2, out=out)
    assert tracker.allocated_bytes - base == 4000
    out.resize_(2000)
    assert tracker.allocated_bytes - base == 8000
    del out
    assert tracker.allocated_bytes == base

def test_peak_is_the_high_water_mark(tracker):
    base = tracker.allocated_bytes
    tracker.reset_peak()
    a = torch.empty(MiB, dtype=torch.uint8); del a
    b = torch.empty(MiB // 2, dtype=torch.uint8)
    assert tracker.peak_bytes == base + MiB
    tracker.reset_peak()
    assert tracker.peak_bytes == tracker.allocated_bytes == base + MiB // 2
    del b

def test_autograd_saved_tensors_and_gradients(tracker):
    x = torch.randn(128, 256, requires_grad=True)
    base = tracker.allocated_bytes
    y = x.sigmoid()                                    # output, saved for backward: 128 KiB
    assert tracker.allocated_bytes - base == 128 * 256 * 4
    y.sum().backward()
    del y                                              # graph and output gone, the gradient stays
    assert tracker.allocated_bytes - base == x.grad.numel() * 4
    x.grad = None
    assert tracker.allocated_bytes == base

def test_existing_tensors_are_found_and_their_frees_subtract():
    p = torch.nn.Parameter(torch.randn(MiB // 4))
    p.grad = torch.zeros(MiB // 4)
    with TensorMemoryTracker() as tracker:
        with_both = tracker.allocated_bytes
        p.grad = None
        assert with_both - tracker.allocated_bytes == MiB
        del p
        assert with_both - tracker.allocated_bytes == 2 * MiB
    keep = torch.empty(100)
    with TensorMemoryTracker(count_existing=False) as tracker:
        assert (tracker.allocated_bytes, tracker.num_storages) == (0, 0)
        del keep                                        # not counted, so nothing to subtract
        assert tracker.allocated_bytes == 0

def test_non_cpu_tensors_and_other_threads_are_not_counted(tracker):
    base = tracker.allocated_bytes
    m = torch.empty(10**6, device='meta')
    box = []
    th = threading.Thread(target=lambda: box.append(torch.empty(1000))); th.start(); th.join()
    assert tracker.allocated_bytes == base              # the documented limits: meta storage, other thread
    del m, box

def test_disable_keeps_last_counts_and_enable_starts_again():
    tracker = TensorMemoryTracker(count_existing=False)
    with tracker:
        t = torch.empty(256)
    assert not tracker.enabled and tracker.allocated_bytes == 1024
    u = torch.empty(256)                               # not seen: disabled
    assert tracker.allocated_bytes == 1024
    with tracker:
        assert tracker.allocated_bytes == 0
        w = torch.empty(8, dtype=torch.uint8)
        assert tracker.allocated_bytes == 8
    del t, u, w

def test_misuse_is_refused_with_a_message(tracker):
    with pytest.raises(RuntimeError, match='another TensorMemoryTracker is enabled'):
        TensorMemoryTracker().enable()
    with pytest.raises(RuntimeError, match='already enabled'):
        tracker.enable()
    errors = []
    def disable_elsewhere():
        try: tracker.disable()
        except RuntimeError as e: errors.append(str(e))
    th = threading.Thread(target=disable_elsewhere); th.start(); th.join()
    assert len(errors) == 1 and 'thread that called enable()' in errors[0]
    class Other(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None): return func(*args, **(kwargs or {}))
    with Other():
        with pytest.raises(RuntimeError, match='exit it before disabling'):
            tracker.disable()
        base = tracker.allocated_bytes
        t = torch.empty(100, dtype=torch.uint8)         # still counted below another mode
        assert tracker.allocated_bytes - base == 100
        del t
    assert tracker.enabled

def _child_counts(rank, world_size, tracker, holder_started):
    assert active_tracker() is tracker and tracker.enabled
    base = tracker.allocated_bytes                     # would hang if the lock held by the parent's thread were copied
    t = torch.empty(MiB // 4)
    grown = tracker.allocated_bytes - base
    del t
    return grown, tracker.allocated_bytes - base

def test_forked_child_keeps_counting_even_if_a_parent_thread_held_the_lock(tracker):
    held, release = threading.Event(), threading.Event()
    def hold():
        with tracker._lock:
            held.set(); release.wait(30)
    th = threading.Thread(target=hold); th.start(); held.wait(10)
    try:
        assert run_distributed(_child_counts, 1, args=(tracker, held), init=False, timeout=30) == [(MiB, 0)]
    finally:
        release.set(); th.join()

@pytest.mark.filterwarnings('ignore:Sparse CSR tensor support is in beta')
def test_sparse_and_wrapper_subclass_tensors_count_their_parts():
    from torch.testing._internal.two_tensor import TwoTensor
    with TensorMemoryTracker(count_existing=False) as tracker:
        csr = torch.eye(4).to_sparse_csr()
        parts = sum(p.untyped_storage().nbytes() for p in (csr.crow_indices(), csr.col_indices(), csr.values()))
        assert tracker.allocated_bytes == parts >= 40 + 32 + 16     # crow, col (int64) and values (float32)
        pair = TwoTensor(torch.ones(1500, dtype=torch.float64), torch.ones(1500, dtype=torch.float64))
        assert tracker.allocated_bytes - parts == 24000             # the wrapper's placeholder storage adds 0
        tripled = pair * 3
        assert tracker.allocated_bytes - parts == 48000
        del csr, pair, tripled
        assert tracker.allocated_bytes == 0
