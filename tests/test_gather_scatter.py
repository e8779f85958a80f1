"""The host pool's copy kernels against their torch references: the scatter of K/V blocks into
units and the gather of whole units (under TRITON_INTERPRET=1 without CUDA, where a "mapped host"
pointer is the CPU tensor itself); on a GPU, the same kernels and the recall reading a pinned,
mapped pool through UVA, the staged recall, and a worker's own recalls on their copy stream."""

from __future__ import annotations

import pytest
import torch

from pulseinfer.kernels import gather_scatter
from pulseinfer.kernels.compile_cases import AttentionGeometry
from pulseinfer.kernels.gather_scatter import (
    compile_cases,
    gather_units,
    gather_units_ref,
    gather_units_triton,
    recall_ref,
    recall_triton,
    scatter_units,
    scatter_units_ref,
    scatter_units_triton,
)
from pulseinfer.kv_store.view import PoolView

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels run on a GPU where there is one, else interpreted
H = 3
SHAPES = [(16, 64), (12, 48)]  # (block, dim); the second: neither a power of two, and units of 3456 elements: a partial gather tile
DTYPES = [torch.float32, torch.bfloat16]


def _randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("block", "dim"), SHAPES)
def test_scatter_units_writes_slot_major_blocks_into_units_like_the_reference(dtype, block, dim):
    units = _randn(10, 2, H, block, dim, dtype=dtype, seed=1, device=DEVICE)
    k, v = _randn(3, block, H, dim, dtype=dtype, seed=2, device=DEVICE), _randn(3, block, H, dim, dtype=dtype, seed=3, device=DEVICE)
    rows = torch.tensor([7, 0, 4], device=DEVICE)
    expected = units.clone()
    scatter_units_ref(expected, rows, k, v)
    scatter_units_triton(units, rows, k, v)
    assert torch.equal(units, expected)  # a copy: bit-exact
    # the reference itself: block 0 lands in unit 7, transposed to [kv_head][token][dim]; other units untouched
    assert torch.equal(expected[7, 0], k[0].transpose(0, 1)) and torch.equal(expected[7, 1], v[0].transpose(0, 1))
    untouched = [u for u in range(10) if u not in rows.tolist()]
    assert torch.equal(expected[untouched], _randn(10, 2, H, block, dim, dtype=dtype, seed=1, device=DEVICE)[untouched])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("block", "dim"), SHAPES)
def test_gather_units_reads_whole_units_like_the_reference(dtype, block, dim):
    units = _randn(10, 2, H, block, dim, dtype=dtype, seed=4, device=DEVICE)
    rows = torch.tensor([9, 2, 2, 5], device=DEVICE)  # a unit twice: a gather, not a permutation
    out = torch.zeros(4, 2, H, block, dim, dtype=dtype, device=DEVICE)
    expected = torch.zeros_like(out)
    gather_units_ref(units, rows, expected)
    gather_units_triton(units, rows, out)
    assert torch.equal(out, expected)
    assert torch.equal(expected[0], units[9]) and torch.equal(expected[2], units[2])


def test_an_empty_gather_or_scatter_launches_nothing():
    units, rows = _randn(4, 2, H, 16, 64, device=DEVICE), torch.empty(0, dtype=torch.long, device=DEVICE)
    gather_units_triton(units, rows, torch.empty(0, 2, H, 16, 64, device=DEVICE))
    scatter_units_triton(units, rows, torch.empty(0, 16, H, 64, device=DEVICE), torch.empty(0, 16, H, 64, device=DEVICE))
    assert torch.equal(units, _randn(4, 2, H, 16, 64, device=DEVICE))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU dispatch")
def test_the_dispatchers_run_the_references_on_cpu(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a Triton kernel was dispatched for CPU tensors")

    for name in ("gather_units_triton", "scatter_units_triton"):
        monkeypatch.setattr(gather_scatter, name, forbidden)
    units = _randn(6, 2, H, 16, 64)
    k, v = _randn(2, 16, H, 64, seed=5), _randn(2, 16, H, 64, seed=6)
    scatter_units(units, torch.tensor([5, 1]), k, v)
    out = torch.empty(2, 2, H, 16, 64)
    gather_units(units, torch.tensor([1, 5]), out)
    assert torch.equal(out[0, 0], k[1].transpose(0, 1)) and torch.equal(out[1, 1], v[0].transpose(0, 1))


def test_shape_errors_are_clear():
    units = _randn(4, 2, H, 16, 64)
    with pytest.raises(ValueError, match="scatter_units: blocks"):
        scatter_units_ref(units, torch.tensor([0]), _randn(1, 8, H, 64), _randn(1, 8, H, 64))  # blocks of 8 tokens, units of 16
    with pytest.raises(ValueError, match="scatter_units: blocks"):
        scatter_units_ref(units, torch.tensor([0, 1]), _randn(1, 16, H, 64), _randn(1, 16, H, 64))
    with pytest.raises(ValueError, match="contiguous"):
        k = _randn(1, H, 16, 64).transpose(1, 2)
        scatter_units_triton(units, torch.tensor([0]), k, k)
    with pytest.raises(ValueError, match="gather_units"):
        gather_units_ref(units, torch.tensor([0]), torch.empty(1, 2, H, 16, 32))
    with pytest.raises(ValueError, match="gather_units"):
        gather_units_ref(units, torch.tensor([0]), torch.empty(1, 2, H, 16, 64, dtype=torch.bfloat16))


def test_compile_cases_cover_every_kernel_with_every_argument():
    """The compile gate compiles what the wrappers launch: each kernel, each argument typed or constexpr."""
    cases = compile_cases(AttentionGeometry("test", q_heads=9, kv_heads=H, head_dim=64), torch.bfloat16)
    assert {c.kernel for c in cases} == {"recall", "recall_head", "scatter_units", "gather_units"}
    for case in cases:
        assert set(case.signature) == set(case.fn.arg_names), case.kernel
        assert {name for name, kind in case.signature.items() if kind == "constexpr"} == set(case.constexprs), case.kernel
    gather = next(c for c in cases if c.kernel == "gather_units")
    assert gather.constexprs["ROW"] == 2 * H * 16 * 64


# ---------------------------------------------------------------- CUDA: the pinned, mapped pool


def _pinned_pool(dtype: torch.dtype, block: int = 16, dim: int = 64, blocks: int = 12, layers: int = 2) -> PoolView:
    view = PoolView.private(blocks, layers, H, block, dim, dtype)
    view.units.copy_(_randn(*view.units.shape, dtype=dtype, seed=7))
    view.pin()
    return view


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("per_head", [False, True])
def test_the_recall_kernel_reads_a_pinned_mapped_pool_through_uva(dtype, per_head):
    view = _pinned_pool(dtype)
    try:
        rows = view.unit_rows(torch.tensor([11, 3, 6]), 1)
        dst = torch.tensor([5, 0, 2])
        heads = torch.tensor([2, 0, 1]) if per_head else None
        k, v = (_randn(8 * 16, H, 64, dtype=dtype, seed=s) for s in (8, 9))
        expected_k, expected_v = k.clone(), v.clone()
        recall_ref(view.units, rows, expected_k, expected_v, dst, heads)
        k_gpu, v_gpu = k.cuda(), v.cuda()
        cuda_heads = heads.cuda() if per_head else None
        recall_triton(view.units, rows.cuda(), k_gpu, v_gpu, dst.cuda(), cuda_heads, source=view.mapped())
        assert torch.equal(k_gpu.cpu(), expected_k) and torch.equal(v_gpu.cpu(), expected_v)
    finally:
        view.close()


@pytest.mark.gpu
@pytest.mark.parametrize(("block", "dim"), SHAPES)
def test_the_pool_writes_and_reads_cuda_blocks_with_one_kernel_each(block, dim):
    """PoolView.write from the device scatters into the mapped pool; read gathers back to the device."""
    view = _pinned_pool(torch.bfloat16, block, dim)
    try:
        blocks = torch.tensor([4, 10, 1])
        k, v = (_randn(3, block, H, dim, dtype=torch.bfloat16, seed=s, device="cuda") for s in (10, 11))
        expected = view.read(torch.arange(12), 0).clone()  # the CPU path: the reference
        scatter_units_ref(expected, blocks, k.cpu(), v.cpu())
        view.write(blocks, 0, k, v)  # queued on the current stream
        on_device = view.read(torch.arange(12), 0, torch.device("cuda"))  # after the write on the same stream
        assert torch.equal(on_device.cpu(), expected)
        torch.cuda.synchronize()
        assert torch.equal(view.read(torch.arange(12), 0), expected)  # the host sees the kernel's writes
        assert torch.equal(view.read(torch.arange(12), 1), _randn(12, 2, 2, H, block, dim, dtype=torch.bfloat16, seed=7)[:, 1])
    finally:
        view.close()


@pytest.mark.gpu
def test_the_staged_recall_reads_the_pool_after_the_writes_it_was_ordered_after():
    """The kv_store's staged path (its host gather waits for the worker's `ready`): here the writes
    are this process's kernels, `ready` recorded after them on the same stream."""
    from pulseinfer.kv_store.cuda_ipc import Staging

    view = _pinned_pool(torch.bfloat16)
    try:
        k, v = (_randn(4, 16, H, 64, dtype=torch.bfloat16, seed=s, device="cuda") for s in (12, 13))
        view.write(torch.tensor([0, 5, 7, 9]), 1, k, v)
        ready = torch.cuda.Event()
        ready.record()
        ready.synchronize()  # what CudaTarget.copy does before the host gather
        rows = view.unit_rows(torch.tensor([9, 0]), 1)
        staging = Staging(torch.device("cuda"), torch.bfloat16)
        k_cache, v_cache = (torch.zeros(4 * 16, H, 64, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        dst = torch.tensor([3, 1], device="cuda")
        gather_scatter.recall(staging.stage(view.units, rows), torch.arange(2, device="cuda"), k_cache, v_cache, dst)
        blocks = k_cache.view(4, 16, H, 64)
        assert torch.equal(blocks[3].cpu(), k[3].cpu()) and torch.equal(blocks[1].cpu(), k[0].cpu())
        assert torch.equal(v_cache.view(4, 16, H, 64)[3].cpu(), v[3].cpu())
    finally:
        view.close()


@pytest.mark.gpu
def test_a_workers_own_recalls_run_on_its_copy_stream_and_compute_waits_for_them():
    """HostCopier on CUDA: the recall kernel on the copy stream, after compute's queued work (which
    here overwrites the target blocks first), and compute's later reads after the recall."""
    from pulseinfer.gpu_worker.offload.recall import HostCopier, Recall
    from pulseinfer.kv_store.cuda_ipc import CopyStream

    class Cache:  # what HostCopier reads of a PagedKVCache
        def __init__(self):
            self.k, self.v = (torch.zeros(2, 8 * 16, H, 64, dtype=torch.bfloat16, device="cuda") for _ in range(2))

        def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            return self.k[layer], self.v[layer]

    view, cache = _pinned_pool(torch.bfloat16), Cache()
    try:
        copier = HostCopier(view, None, cache, False, CopyStream(torch.device("cuda")))
        torch.cuda._sleep(50_000_000)  # compute still busy when the copy is queued: the copy must wait
        cache.k[1].fill_(7.0)
        copier(1, [Recall("a", 0, 0, 11, 2), Recall("a", 1, 0, 3, 6)])
        k = cache.k[1].view(8, 16, H, 64).cpu()  # a read on the compute stream
        expected = view.read(torch.tensor([11, 3]), 1)[:, 0].transpose(1, 2)
        assert torch.equal(k[2], expected[0]) and torch.equal(k[6], expected[1])
        assert (k[0] == 7.0).all()  # compute's own write before the recall, elsewhere, kept
    finally:
        view.close()
