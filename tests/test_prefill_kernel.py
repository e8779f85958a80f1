"""The prefill attention kernel (kernels/prefill_triton.py) against its torch references, under
TRITON_INTERPRET=1 without CUDA, in fp32 and bf16: the paged cache read through a block table,
contiguous K/V (causal or windowed), and a sliding-window ring followed by the chunk's own K/V."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before anything imports triton (conftest does the same for the other tests)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from pulseinfer.gpu_worker.attention.window import window_prefill_attention  # noqa: E402
from pulseinfer.kernels.attention import GatherWorkspace, paged_prefill_attention, prefill_attention  # noqa: E402
from pulseinfer.kernels.prefill_triton import (  # noqa: E402
    paged_prefill_attention_triton,
    prefill_attention_triton,
    tiles,
    window_prefill_attention_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# (q heads, kv heads, head dim, block size): GQA groups 3, 5 (not a power of two) and 4; a block size
# that is not a power of two
GEOMETRIES = [(9, 3, 64, 16), (10, 2, 128, 12), (4, 1, 256, 16)]


def _randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(DEVICE, dtype)


def _close(ours: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert ours.dtype == dtype and ours.shape == ref.shape
    torch.testing.assert_close(ours.float(), ref, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


def _paged_case(q_heads: int, kv_heads: int, dim: int, block: int, n: int, ctx_len: int, dtype: torch.dtype, seed: int = 0):
    """A chunk of n queries at the end of ctx_len positions held in shuffled cache blocks; the cache's
    other blocks and the slots past ctx_len in the last block hold NaN: the kernel must never read them."""
    blocks_used = -(-ctx_len // block)
    num_blocks = blocks_used + 3
    k_cache = _randn(num_blocks * block, kv_heads, dim, dtype=dtype, seed=seed)
    v_cache = _randn(num_blocks * block, kv_heads, dim, dtype=dtype, seed=seed + 1)
    blocks = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed + 2))[:blocks_used].to(DEVICE)
    q = _randn(n, q_heads, dim, dtype=dtype, seed=seed + 3)
    poisoned_k, poisoned_v = k_cache.clone(), v_cache.clone()
    unused = torch.ones(num_blocks * block, dtype=torch.bool, device=DEVICE)
    slots = (blocks[:, None] * block + torch.arange(block, device=DEVICE)).reshape(-1)[:ctx_len]
    unused[slots] = False
    poisoned_k[unused], poisoned_v[unused] = float("nan"), float("nan")
    return q, (k_cache, v_cache), (poisoned_k, poisoned_v), blocks


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("q_heads", "kv_heads", "dim", "block"), GEOMETRIES)
def test_paged_prefill(dtype, q_heads, kv_heads, dim, block):
    """A cached prefix plus the chunk, partial last block, a chunk that is not a multiple of the tiles."""
    n, ctx_len = 45, 45 + 5 * block + 3
    q, (k_cache, v_cache), poisoned, blocks = _paged_case(q_heads, kv_heads, dim, block, n, ctx_len, dtype)
    ref = paged_prefill_attention(q.float(), k_cache.float(), v_cache.float(), blocks, ctx_len, block, GatherWorkspace())
    _close(paged_prefill_attention_triton(q, *poisoned, blocks, ctx_len, block), ref, dtype)


def test_paged_prefill_of_a_whole_prompt_and_of_one_token():
    for n, ctx_len in ((37, 37), (1, 50)):  # no cached prefix; a one-token chunk after a prefix
        q, (k_cache, v_cache), poisoned, blocks = _paged_case(9, 3, 64, 16, n, ctx_len, torch.float32, seed=n)
        ref = paged_prefill_attention(q, k_cache, v_cache, blocks, ctx_len, 16, GatherWorkspace())
        _close(paged_prefill_attention_triton(q, *poisoned, blocks, ctx_len, 16), ref, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("q_heads", "kv_heads", "dim", "window"), [(9, 3, 64, 0), (9, 3, 64, 20), (10, 2, 128, 33), (4, 1, 256, 7)])
def test_contiguous_prefill(dtype, q_heads, kv_heads, dim, window):
    """Contiguous K/V (an offloaded request's context, dense_forward): causal, or a window smaller than
    the context and than the chunk; K/V longer than the context (its last block's padding)."""
    n, ctx_len = 70, 90
    q = _randn(n, q_heads, dim, dtype=dtype, seed=4)
    k, v = _randn(ctx_len + 6, kv_heads, dim, dtype=dtype, seed=5), _randn(ctx_len + 6, kv_heads, dim, dtype=dtype, seed=6)
    ref = prefill_attention(q.float(), k.float(), v.float(), ctx_len, window)
    _close(prefill_attention_triton(q, k, v, ctx_len, window), ref, dtype)


def test_the_window_reference_is_the_causal_one_cut_to_the_window():
    """The reference's window itself: within the window it is the causal attention, past it a query sees nothing older."""
    q, k, v = _randn(12, 2, 16, seed=7), _randn(30, 1, 16, seed=8), _randn(30, 1, 16, seed=9)
    torch.testing.assert_close(prefill_attention(q, k, v, 30, window=30), prefill_attention(q, k, v, 30))
    last = prefill_attention(q[-1:], k, v, 30, window=5)
    torch.testing.assert_close(last, prefill_attention(q[-1:], k[25:], v[25:], 5))


def _ring(k_all: torch.Tensor, start: int, window: int, empty: float) -> torch.Tensor:
    """A request's ring before its chunk at `start`: position p in slot p % window for the last
    `window` positions before start; slots never written hold `empty`."""
    ring = torch.full((window, *k_all.shape[1:]), empty, dtype=k_all.dtype, device=k_all.device)
    positions = torch.arange(max(0, start - window), start, device=k_all.device)
    ring[positions % window] = k_all[positions]
    return ring


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("q_heads", "kv_heads", "dim"), [(9, 3, 64), (4, 1, 256)])
@pytest.mark.parametrize(("start", "n"), [(0, 30), (10, 30), (50, 30), (61, 5)])
def test_window_prefill(dtype, q_heads, kv_heads, dim, start, n):
    """Chunks over a ring: empty (the first chunk), partly filled, wrapped; chunks longer than the
    window and shorter. The ring reference, the kernel and the windowed attention over the whole
    sequence agree; never-written slots are never read."""
    window = 24
    q = _randn(n, q_heads, dim, dtype=dtype, seed=10)
    k_all = _randn(start + n, kv_heads, dim, dtype=dtype, seed=11)
    v_all = _randn(start + n, kv_heads, dim, dtype=dtype, seed=12)
    chunk_k, chunk_v = k_all[start:], v_all[start:]
    rings = [_ring(t.float(), start, window, 0.0) for t in (k_all, v_all)]
    ref = window_prefill_attention(q.float(), chunk_k.float(), chunk_v.float(), *rings, start, window)
    whole = prefill_attention(q.float(), k_all.float(), v_all.float(), start + n, window)
    torch.testing.assert_close(ref, whole, rtol=1e-5, atol=1e-5)
    ring_k, ring_v = _ring(k_all, start, window, float("nan")), _ring(v_all, start, window, float("nan"))
    _close(window_prefill_attention_triton(q, chunk_k, chunk_v, ring_k, ring_v, start, window), ref, dtype)


@pytest.mark.parametrize("window", [0, 512])
def test_long_context(window):
    """~3k keys, a few heads: many key tiles per program, the causal bound and the window's lower one."""
    n, ctx_len, block = 100, 3000, 16
    q, (k_cache, v_cache), poisoned, blocks = _paged_case(2, 1, 64, block, n, ctx_len, torch.bfloat16, seed=13)
    k, v = (t.view(-1, block, 1, 64)[blocks].reshape(-1, 1, 64) for t in poisoned)  # the context, contiguous
    if window:
        ref = prefill_attention(q.float(), k.float(), v.float(), ctx_len, window)
        _close(prefill_attention_triton(q, k, v, ctx_len, window), ref, torch.bfloat16)
    else:
        ref = paged_prefill_attention(q.float(), k_cache.float(), v_cache.float(), blocks, ctx_len, block, GatherWorkspace())
        _close(paged_prefill_attention_triton(q, *poisoned, blocks, ctx_len, block), ref, torch.bfloat16)


def test_tiles_fit_the_dot():
    """tl.dot takes tiles of 16 and up; head dims past the sized ones are refused."""
    for dim in (64, 128, 256):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            shape = tiles(dim, dtype)
            assert shape.rows >= 16 and shape.keys >= 16
    with pytest.raises(ValueError, match="head dim 512"):
        tiles(512, torch.bfloat16)


def test_shape_errors_are_clear():
    q, k = _randn(4, 9, 64), _randn(16, 3, 64)
    with pytest.raises(ValueError, match="does not fit"):
        prefill_attention_triton(q, _randn(16, 4, 64), _randn(16, 4, 64), 16)  # 9 query heads over 4 kv heads
    with pytest.raises(ValueError, match="context positions"):
        prefill_attention_triton(q, k, k, 20)  # more context than keys
    with pytest.raises(ValueError, match="blocks"):
        paged_prefill_attention_triton(q, k, k, torch.tensor([0], device=DEVICE), 20, 16)  # 20 positions in one block of 16
    with pytest.raises(ValueError, match="contiguous"):
        cache = _randn(3, 16, 64).transpose(0, 1)
        paged_prefill_attention_triton(q, cache, cache, torch.tensor([0], device=DEVICE), 16, 16)
    with pytest.raises(ValueError, match="integers"):
        paged_prefill_attention_triton(q, k, k, torch.tensor([0.0], device=DEVICE), 16, 16)
    with pytest.raises(ValueError, match="window prefill"):
        window_prefill_attention_triton(q, k[:4], k[:4], k[:8], k[:8], 0, 16)  # a ring of 8 slots for a window of 16
