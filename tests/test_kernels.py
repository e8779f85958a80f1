"""Every Triton kernel against its torch reference on small shapes (under TRITON_INTERPRET=1
without CUDA), in fp32 and bf16; the dispatchers pick the reference on the CPU."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before anything imports triton (conftest does the same for the other tests)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from pulseinfer.kernels.attention import GatherWorkspace, paged_decode_attention  # noqa: E402
from pulseinfer.kernels.decode_triton import MAX_SPLITS, MIN_SPLIT, WAVES, num_splits, paged_decode_attention_triton  # noqa: E402
from pulseinfer.kernels.gather_scatter import recall, recall_ref, recall_triton  # noqa: E402
from pulseinfer.kernels.scoring import (  # noqa: E402
    lowrank_block_lse,
    lowrank_scores,
    quest_scores,
    quest_scores_ref,
    quest_scores_triton,
    quest_weights,
)
from pulseinfer.kernels.summary import block_minmax, block_minmax_ref, block_minmax_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
B, H, HQ, D = 16, 3, 9, 64
DTYPES = [torch.float32, torch.bfloat16]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_block_minmax(dtype):
    k = _randn(5, B, H, D, dtype=dtype)
    for ours, ref in zip(block_minmax_triton(k), block_minmax_ref(k)):
        assert ours.dtype == torch.float32 and torch.equal(ours, ref)  # min and max are exact
    odd = _randn(3, 12, H, 48, dtype=dtype, seed=1)  # sizes that are not powers of two are masked
    for shift in (-10, 10):  # all keys of one sign: a padded lane that took part would win the min or the max
        for ours, ref in zip(block_minmax_triton(odd + shift), block_minmax_ref(odd + shift)):
            assert torch.equal(ours, ref)


def test_quest_bound_holds_for_every_key():
    """The reference is an upper bound of each key's q.k summed over the GQA group, tight for a constant block."""
    k = _randn(6, B, H, D, seed=11)
    k[2] = k[2, :1]  # block 2: one key repeated, so min == max == that key
    q = _randn(HQ, D, seed=12)
    kmin, kmax = block_minmax_ref(k)
    every = torch.arange(6, device=DEVICE)[None]
    (scores,) = quest_scores_ref(quest_weights(q[None], H), kmin, kmax, every, per_head=True)
    dots = torch.einsum("ibhd,hd->hib", k, q.view(H, HQ // H, D).sum(dim=1))  # [kv_heads, n, tokens]
    assert (dots.amax(dim=2) <= scores + 1e-4).all()
    torch.testing.assert_close(scores[:, 2], dots[:, 2, 0], rtol=1e-5, atol=1e-4)
    (solo,) = quest_scores_ref(quest_weights(q[None], H), kmin, kmax, every, per_head=False)  # SoloHead: summed over the kv heads
    torch.testing.assert_close(solo, scores.sum(dim=0, keepdim=True), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_quest_scores(dtype):
    """Three rows of 70 blocks (two tiles, the second partial), each naming its own slots of one pool of summaries in the cache's dtype."""
    weights = quest_weights(_randn(3, HQ, D, dtype=dtype, seed=2), H)
    kmin, kmax = (s.to(dtype) for s in block_minmax_ref(_randn(100, B, H, D, dtype=dtype, seed=3)))
    generator = torch.Generator().manual_seed(4)
    table = torch.stack([torch.randperm(100, generator=generator)[:70] for _ in range(3)]).to(DEVICE)
    for per_head, groups in ((True, H), (False, 1)):
        ours, ref = quest_scores_triton(weights, kmin, kmax, table, per_head), quest_scores_ref(weights, kmin, kmax, table, per_head)
        assert ours.shape == (3, groups, 70)
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-3)
        assert torch.equal(ours.topk(8, dim=2).indices.sort().values, ref.topk(8, dim=2).indices.sort().values)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lowrank_block_lse(dtype):
    """Three rows of 21 blocks (a tile and a part), each naming its own slots of one pool of projected
    keys in the cache's dtype: each query head's log-sum-exp over each block's tokens."""
    group, rank, slots, width = HQ // H, 8, 40, 21
    projected = _randn(3, H, group, rank, seed=5)
    keys = _randn(H, rank, slots, B, dtype=dtype, seed=6)
    generator = torch.Generator().manual_seed(7)
    table = torch.stack([torch.randperm(slots, generator=generator)[:width] for _ in range(3)]).to(DEVICE)
    logits = torch.einsum("rhgk,hkrnb->rhgnb", projected, keys.float()[:, :, table])  # [rows, kv_heads, group, width, block]
    torch.testing.assert_close(lowrank_block_lse(projected, keys, table), logits.logsumexp(dim=4), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(DEVICE != "cuda", reason="the kernel's dispatch: CUDA only")
@pytest.mark.parametrize("per_head", [False, True])
def test_lowrank_scores_on_cuda_equal_the_reference(per_head):
    q, basis = _randn(3, HQ, D, seed=8), torch.linalg.qr(_randn(H, D, D, seed=9)).Q[..., :16]
    keys, table = _randn(H, 16, 40, B, seed=10), torch.arange(30, device=DEVICE).view(3, 10)
    valid = torch.arange(10, device=DEVICE) < torch.tensor([10, 4, 0], device=DEVICE)[:, None]  # a short row, an empty one
    ours = lowrank_scores(q, basis, keys, table, valid, per_head)
    ref = lowrank_scores(*(t.cpu() for t in (q, basis, keys, table, valid)), per_head)
    torch.testing.assert_close(ours.cpu(), ref, rtol=1e-4, atol=1e-5)


def _decode_case(dtype: torch.dtype, per_head: bool):
    slots = 40 * B
    k_cache, v_cache = _randn(slots, H, D, dtype=dtype, seed=4), _randn(slots, H, D, dtype=dtype, seed=5)
    q = _randn(3, HQ, D, dtype=dtype, seed=6)
    generator = torch.Generator().manual_seed(7)
    shape = (3, H, 7) if per_head else (3, 7)
    tables = torch.randint(0, 40, shape, generator=generator)
    lens = torch.tensor([7 * B, 5 * B - 3, 9])  # full, a partial last block, shorter than one block (padded tables)
    return q, k_cache, v_cache, tables.to(DEVICE), lens.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_head", [False, True])
def test_paged_decode_attention(dtype, per_head):
    """One split writes the output itself; three: partials combined (the third of the first row
    and the last two of the third are empty). Shared [b, n] and per-head [b, kv_heads, n] tables."""
    q, k_cache, v_cache, tables, lens = _decode_case(dtype, per_head)
    ref = paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), tables, lens, B, GatherWorkspace())
    workspace = GatherWorkspace()  # one for both calls: partials are a grow-only buffer
    for splits in (1, 3):
        ours = paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, B, workspace, splits=splits)
        assert ours.dtype == dtype
        torch.testing.assert_close(ours.float(), ref, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    if per_head:  # each head really reads its own blocks: the same tables for every head give another answer
        shared = paged_decode_attention_triton(q, k_cache, v_cache, tables[:, 0], lens, B, workspace, splits=3)
        assert not torch.allclose(shared[:, HQ // H :].float(), ours[:, HQ // H :].float(), atol=TOLERANCE[dtype])


@pytest.mark.parametrize(("block", "heads", "q_heads", "dim"), [(8, 2, 8, 32), (64, 1, 1, 16), (24, 2, 6, 48)])
def test_paged_decode_attention_geometries(block, heads, q_heads, dim):
    """Other block sizes and GQA groups (4, 1, 3), block sizes and head dims that are not powers of
    two; a length past the table is clamped to it as in the reference, 0 gives 0."""
    k_cache, v_cache = _randn(6 * block, heads, dim, seed=13), _randn(6 * block, heads, dim, seed=14)
    q = _randn(3, q_heads, dim, seed=15)
    tables = torch.randint(0, 6, (3, heads, 4), generator=torch.Generator().manual_seed(16)).to(DEVICE)
    lens = torch.tensor([4 * block + 3, 2 * block + 1, 0], device=DEVICE)
    ref = paged_decode_attention(q, k_cache, v_cache, tables, lens, block, GatherWorkspace())
    ours = paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, block, GatherWorkspace(), splits=2)
    torch.testing.assert_close(ours[:2], ref[:2], rtol=1e-5, atol=1e-5)
    assert torch.equal(ours[2], torch.zeros_like(ours[2]))


# (q heads, kv heads, head dim, sliding window): attention shapes of the models served
GEOMETRIES = {
    "gemma3-4b": (8, 4, 256, 1024),
    "mistral-7b": (32, 8, 128, 4096),
    "qwen3-14b": (40, 8, 128, 0),  # a group of 5: not a power of two
    "smollm2-135m": (9, 3, 64, 0),
    "gemma3-270m": (4, 1, 256, 512),
}


@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_decode_attention_at_model_geometries(name):
    """bf16 at each geometry, per-head tables, two splits; a windowed one reads a table as wide as
    its ring (window / block_size blocks), as its sliding layers do, but short rows: the
    interpreter is slow, and the kernel's tiles do not depend on the context."""
    q_heads, heads, dim, window = GEOMETRIES[name]
    width = window // B or 6
    k_cache, v_cache = (_randn(2 * width * B, heads, dim, dtype=torch.bfloat16, seed=s) for s in (20, 21))
    q = _randn(2, q_heads, dim, dtype=torch.bfloat16, seed=22)
    tables = torch.randint(0, 2 * width, (2, heads, width), generator=torch.Generator().manual_seed(23)).to(DEVICE)
    lens = torch.tensor([3 * B + 5, B - 1], device=DEVICE)
    ref = paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), tables, lens, B, GatherWorkspace())
    ours = paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, B, GatherWorkspace(), splits=2)
    torch.testing.assert_close(ours.float(), ref, rtol=2e-2, atol=2e-2)


def test_decode_attention_over_a_ring():
    """A sliding layer's ring as its decode reads it (gpu_worker/attention/window.py): position p of
    a request in slot p % window of its ring, a ring of ceil(window / block_size) whole blocks (the
    last one partial here: 24 does not divide 512) read as a shared table, masked by slot <
    min(p + 1, window). Against attention over the last `window` positions of the sequence itself:
    one request's ring has wrapped, one has not, at Gemma 3 270M's geometry and window."""
    q_heads, heads, dim, window = GEOMETRIES["gemma3-270m"]
    block = 24
    ring_blocks = -(-window // block)
    k_seq, v_seq = _randn(window + 37, heads, dim, seed=24), _randn(window + 37, heads, dim, seed=25)
    k_rings, v_rings = (torch.zeros(3 * ring_blocks * block, heads, dim, device=DEVICE) for _ in range(2))
    q = _randn(2, q_heads, dim, seed=26)
    rows = ((2, window + 36), (0, 100))  # each request's ring and its latest position
    for ring, last in rows:
        positions = torch.arange(max(0, last + 1 - window), last + 1, device=DEVICE)  # those the ring still holds
        for ring_cache, seq in ((k_rings, k_seq), (v_rings, v_seq)):
            ring_cache[ring * ring_blocks * block + positions % window] = seq[positions]
    tables = torch.tensor([ring for ring, _ in rows], device=DEVICE)[:, None] * ring_blocks + torch.arange(ring_blocks, device=DEVICE)
    lens = torch.tensor([min(last + 1, window) for _, last in rows], device=DEVICE)
    ours = paged_decode_attention_triton(q, k_rings, v_rings, tables, lens, block, GatherWorkspace(), splits=3)
    ring_ref = paged_decode_attention(q, k_rings, v_rings, tables, lens, block, GatherWorkspace())
    for i, (_, last) in enumerate(rows):
        first = max(0, last + 1 - window)
        keys, values = (seq[first : last + 1].transpose(0, 1) for seq in (k_seq, v_seq))  # [kv_heads, n, dim]
        grouped = q[i].view(heads, q_heads // heads, dim)
        expected = torch.nn.functional.scaled_dot_product_attention(grouped, keys, values).reshape(q_heads, dim)
        torch.testing.assert_close(ours[i], expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ring_ref[i], expected, rtol=1e-5, atol=1e-5)


def test_decode_attention_over_a_long_context():
    """A context of 2053 positions (a partial last block) in the splits chosen without splits=
    (on the CPU: as for one SM), combined."""
    q_heads, heads, dim, _ = GEOMETRIES["gemma3-270m"]
    blocks = 2053 // B + 1
    k_cache, v_cache = _randn(blocks * B, heads, dim, seed=27), _randn(blocks * B, heads, dim, seed=28)
    q = _randn(1, q_heads, dim, seed=29)
    tables = torch.randperm(blocks, generator=torch.Generator().manual_seed(30))[None].to(DEVICE)
    lens = torch.tensor([2053], device=DEVICE)
    assert num_splits(heads, blocks * B, sm_count=1) == 4
    ref = paged_decode_attention(q, k_cache, v_cache, tables, lens, B, GatherWorkspace())
    ours = paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, B, GatherWorkspace())
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_num_splits_fill_the_device_within_bounds():
    h100 = 132
    assert num_splits(1 * 8, 32768, h100) == MAX_SPLITS  # one long request: as many as allowed
    assert num_splits(1 * 8, 1024, h100) == 1024 // MIN_SPLIT  # no split shorter than MIN_SPLIT
    assert num_splits(8 * 8, 4096, h100) == -(-WAVES * h100 // 64)  # enough programs for the SMs, no more
    assert num_splits(256 * 8, 4096, h100) == 1  # a large batch fills the device by itself
    assert num_splits(8, 100, h100) == 1  # a context too short to split
    for programs, ctx in ((1, 10**6), (3, 5000), (40, 2000), (5000, 10**5)):
        splits = num_splits(programs, ctx, h100)
        assert 1 <= splits <= MAX_SPLITS and (splits == 1 or ctx // splits >= MIN_SPLIT)


def _recall_case(dtype: torch.dtype, block: int = B, dim: int = D):
    units = _randn(12, 2, H, block, dim, dtype=dtype, seed=8)
    caches = [_randn(8 * block, H, dim, dtype=dtype, seed=s) for s in (9, 10)]
    index = torch.tensor([11, 0, 5], device=DEVICE)
    dst = torch.tensor([6, 2, 3], device=DEVICE)
    return units, index, caches, dst


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize(("block", "dim"), [(B, D), (12, 48)])  # the second: neither a power of two
def test_recall(dtype, per_head, block, dim):
    units, index, (k_cache, v_cache), dst = _recall_case(dtype, block, dim)
    heads = torch.tensor([2, 0, 1], device=DEVICE) if per_head else None
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    recall_ref(units, index, k_ref, v_ref, dst, heads)
    recall_triton(units, index, k_cache, v_cache, dst, heads)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)  # a copy: bit-exact
    # the reference itself: unit 11's K of head 2 lands in device block 6, slot-major
    assert torch.equal(k_ref.view(-1, block, H, dim)[6, :, 2], units[11, 0, 2])
    assert torch.equal(v_ref.view(-1, block, H, dim)[6, :, 2], units[11, 1, 2])
    if per_head:  # the other heads of the block are untouched
        assert not torch.equal(k_ref.view(-1, block, H, dim)[6, :, 0], units[11, 0, 0])


@pytest.mark.skipif(DEVICE == "cuda", reason="checks the CPU dispatch")
def test_dispatchers_run_the_reference_on_cpu(monkeypatch):
    import pulseinfer.kernels.gather_scatter as gather_scatter
    import pulseinfer.kernels.scoring as scoring
    import pulseinfer.kernels.summary as summary

    def forbidden(*args, **kwargs):
        raise AssertionError("a Triton kernel was dispatched for CPU tensors")

    for module, name in ((summary, "block_minmax_triton"), (scoring, "quest_scores_triton"), (gather_scatter, "recall_triton")):
        monkeypatch.setattr(module, name, forbidden)
    k = _randn(4, B, H, D)
    kmin, kmax = block_minmax(k)
    assert torch.equal(kmax, k.amax(dim=1))
    weights, every = quest_weights(_randn(1, HQ, D), H), torch.arange(4)[None]
    torch.testing.assert_close(quest_scores(weights, kmin, kmax, every, True), quest_scores_ref(weights, kmin, kmax, every, True))
    units, index, (k_cache, v_cache), dst = _recall_case(torch.float32)
    recall(units, index, k_cache, v_cache, dst)
    assert torch.equal(k_cache.view(-1, B, H, D)[3], units[5, 0].transpose(0, 1))


def test_shape_errors_are_clear():
    with pytest.raises(ValueError, match="recall"):
        recall_ref(_randn(2, 2, H, B, D), torch.tensor([0]), _randn(4 * B, 2, D), _randn(4 * B, 2, D), torch.tensor([0]))
    with pytest.raises(ValueError, match="contiguous"):
        cache = _randn(H, 4 * B, D).transpose(0, 1)
        recall_triton(_randn(2, 2, H, B, D), torch.tensor([0]), cache, cache, torch.tensor([0]))
    with pytest.raises(ValueError, match="quest scores"):
        quest_scores_ref(quest_weights(_randn(1, HQ, 32), H), _randn(3, H, D), _randn(3, H, D), torch.arange(3)[None], per_head=True)
    with pytest.raises(ValueError, match="quest scores"):
        quest_weights(_randn(HQ, D), 4)  # 9 query heads do not split into 4 groups
    with pytest.raises(ValueError, match="key blocks"):
        block_minmax_triton(_randn(3, B, D))
    q, cache, lens = _randn(2, HQ, D), _randn(4 * B, H, D), torch.ones(2, dtype=torch.long, device=DEVICE)
    table = torch.zeros(2, 5, dtype=torch.long, device=DEVICE)  # every tensor on the device: only the flaw under test differs
    with pytest.raises(ValueError, match="block_tables"):  # a table per kv head, but H + 1 of them
        paged_decode_attention_triton(q, cache, cache, table[:, None].expand(-1, H + 1, -1), lens, B, GatherWorkspace())
    with pytest.raises(ValueError, match="does not fit"):  # the cache in another dtype
        paged_decode_attention_triton(q.bfloat16(), cache, cache, table, lens, B, GatherWorkspace())
    with pytest.raises(ValueError, match="splits"):
        paged_decode_attention_triton(q, cache, cache, table, lens, B, GatherWorkspace(), splits=0)
    wide = _randn(4 * B, H, 320)
    with pytest.raises(ValueError, match="head_dim 320"):
        paged_decode_attention_triton(_randn(2, HQ, 320), wide, wide, table, lens, B, GatherWorkspace())
