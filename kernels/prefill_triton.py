"""Prefill attention in Triton (flash-attention 2): a chunk's queries over the keys before and of
the chunk, causal and optionally within a sliding window, with no score matrix in memory.

A program takes a tile of query rows of one kv head, the rows being (token, query head of the
kv head's GQA group) pairs, so K/V are read once per group and never repeated; it walks the
visible key tiles with an online softmax in fp32 (exp2). Keys are read through a block table
(key j lives in slot table[j // block_size] * block_size + j % block_size of the cache), so the
paged cache needs no gather; contiguous keys are one block. Key j sits at position
key_start + j, query i at q_start + i: causal and window masks come from positions, and key
tiles entirely before the window or after the causal bound are skipped.

Its references are kernels.attention.paged_prefill_attention and prefill_attention, and
gpu_worker.attention.window.window_prefill_attention (the paths the CPU runs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pulseinfer.kernels.compile_cases import AttentionGeometry, CompileCase, pointer


# integers left unspecialized: Triton would compile a variant for each that is 1 or a multiple of 16,
# and chunk lengths and positions vary with every request (a JIT stall in the middle of serving)
@triton.jit(do_not_specialize=["n", "num_keys", "block_size", "q_start", "key_start", "window"])
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    out_ptr,
    n,  # query tokens
    num_keys,
    block_size,  # keys per table entry
    q_start,  # position of query 0
    key_start,  # position of key 0; keys at negative positions are empty and never read
    window,  # positions a query sees, its own included
    scale_log2,  # score scale times log2(e): the softmax runs in exp2
    H: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # the latest (longest) tiles first: a shorter tail
    head = tl.program_id(1)
    rows = tile * BM + tl.arange(0, BM)
    token = rows // G
    d = tl.arange(0, DP)  # a power of two: lanes past the head dim are masked
    if D == DP:  # a mask constant along the head dim: loads and stores stay vectorized
        d_ok = tl.full([DP], 1, tl.int1)
    else:
        d_ok = d < D
    q_offsets = ((token.to(tl.int64) * H + head) * G + rows % G)[:, None] * D + d[None, :]
    q_mask = (token < n)[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0)
    if UPCAST:  # the interpreter's tl.dot is wrong for 16-bit inputs
        q = q.to(tl.float32)
    q_pos = q_start + token
    first = (tile * BM) // G
    last = tl.minimum((tile * BM + BM - 1) // G, n - 1)
    lo = tl.maximum(tl.maximum(q_start + first - window + 1, 0) - key_start, 0)
    hi = tl.minimum(q_start + last + 1 - key_start, num_keys)
    # finite: a row whose first tiles are all masked (window) gets p = 0 there, not exp(-inf + inf)
    best = tl.full([BM], -1.0e30, tl.float32)
    total = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, DP], tl.float32)
    for j in range(lo, hi, BN):
        keys = j + tl.arange(0, BN)
        key_ok = keys < hi
        block = tl.load(table_ptr + keys // block_size, mask=key_ok, other=0).to(tl.int64)
        slot = block * block_size + keys % block_size
        kv_offsets = (slot * H + head)[:, None] * D + d[None, :]
        kv_mask = key_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_offsets, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BM, BN], fp32
        k_pos = (key_start + keys)[None, :]
        visible = key_ok[None, :] & (k_pos <= q_pos[:, None]) & (k_pos > q_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        p = tl.exp2(scores - new_best[:, None])
        rescale = tl.exp2(best - new_best)
        total = total * rescale + tl.sum(p, axis=1)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        best = new_best
    total = tl.where(total > 0, total, 1.0)  # padding rows past the chunk may see no key: no 0/0 (they are not stored)
    tl.store(out_ptr + q_offsets, (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=q_mask)


@dataclass(frozen=True)
class Tiles:
    """The kernel's tiles and launch options at one head dim and dtype."""

    rows: int  # query rows (token, group head) per program
    keys: int  # keys per loop step
    num_warps: int
    num_stages: int


def tiles(head_dim: int, dtype: torch.dtype) -> Tiles:
    """Sized so Q, the fp32 accumulator and the pipelined K/V tiles fit registers and shared memory
    without spills on both sm_80 and sm_90 (the compile gate checks it); fp32 (an exact dot on the
    FMA units: its operands live in registers) takes smaller tiles."""
    if head_dim > 256:
        raise ValueError(f"prefill attention kernel: head dim {head_dim} is past the largest it is sized for (256)")
    wide = dtype == torch.float32
    if head_dim <= 64:
        return Tiles(64, 32, 8, 2) if wide else Tiles(128, 64, 8, 3)
    if head_dim <= 128:
        return Tiles(32, 16, 4, 2) if wide else Tiles(128, 32, 8, 3)
    return Tiles(32, 16, 8, 2) if wide else Tiles(64, 32, 8, 2)


def _constexprs(q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, upcast: bool) -> dict[str, object]:
    shape = tiles(head_dim, dtype)
    return {
        "H": kv_heads,
        "G": q_heads // kv_heads,
        "D": head_dim,
        "DP": max(16, triton.next_power_of_2(head_dim)),  # tl.dot takes dims of 16 and up
        "BM": shape.rows,
        "BN": shape.keys,
        "UPCAST": upcast,
        "PRECISION": "ieee" if dtype == torch.float32 else "tf32",  # fp32 stays fp32; 16-bit inputs are exact in either
    }


def _attend(
    q: torch.Tensor,  # [n, q_heads, dim]
    k_cache: torch.Tensor,  # [slots, kv_heads, dim]
    v_cache: torch.Tensor,
    table: torch.Tensor,  # [>= ceil(num_keys / block_size)]
    block_size: int,
    num_keys: int,
    q_start: int,
    key_start: int,
    window: int,  # 0: causal over the whole context
) -> torch.Tensor:
    fits = q.dim() == 3 and k_cache.dim() == 3 and k_cache.shape == v_cache.shape and k_cache.shape[2] == q.shape[2]
    if not fits or q.shape[1] % k_cache.shape[1]:
        raise ValueError(f"prefill attention: q {tuple(q.shape)} does not fit k/v {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("prefill attention kernel: the k/v caches must be contiguous (the kernel computes slot offsets)")
    if table.is_floating_point():
        raise ValueError(f"prefill attention: the block table must hold integers, got {table.dtype}")
    n, q_heads, dim = q.shape
    q, table = q.contiguous(), table.to(torch.long).contiguous()
    out = torch.empty_like(q)
    if n == 0:
        return out
    kv_heads = k_cache.shape[1]
    constexprs = _constexprs(q_heads, kv_heads, dim, q.dtype, upcast=not q.is_cuda)  # off CUDA: the interpreter
    shape = tiles(dim, q.dtype)
    grid = (triton.cdiv(n * constexprs["G"], shape.rows), kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, table, out, n, num_keys, block_size, q_start, key_start, window or q_start + n,
        math.log2(math.e) / math.sqrt(dim), num_warps=shape.num_warps, num_stages=shape.num_stages, **constexprs,
    )  # fmt: skip
    return out


def paged_prefill_attention_triton(
    q: torch.Tensor,  # [n, q_heads, dim]: queries at context positions ctx_len-n .. ctx_len-1
    k_cache: torch.Tensor,  # [slots, kv_heads, dim], the chunk's own K/V written already
    v_cache: torch.Tensor,
    blocks: torch.Tensor,  # [>= ceil(ctx_len / block_size)]: the blocks of positions 0 .. ctx_len-1
    ctx_len: int,
    block_size: int,
) -> torch.Tensor:
    """Causal attention of the chunk over its whole context, read in place through `blocks`."""
    if q.shape[0] > ctx_len or blocks.dim() != 1 or blocks.shape[0] * block_size < ctx_len:
        raise ValueError(f"prefill attention: {q.shape[0]} queries, {ctx_len} context positions, {tuple(blocks.shape)} blocks")
    return _attend(q, k_cache, v_cache, blocks, block_size, ctx_len, ctx_len - q.shape[0], 0, 0)


def prefill_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_len: int, window: int = 0) -> torch.Tensor:
    """Causal attention of n queries at positions ctx_len-n .. ctx_len-1 over k, v [>= ctx_len, kv_heads, dim],
    each seeing the last `window` positions (itself included) when window > 0."""
    if q.shape[0] > ctx_len or k.shape[0] < ctx_len or window < 0:
        raise ValueError(f"prefill attention: {q.shape[0]} queries, {ctx_len} context positions, {k.shape[0]} keys, window {window}")
    one_block = torch.zeros(1, dtype=torch.long, device=q.device)
    return _attend(q, k.contiguous(), v.contiguous(), one_block, max(ctx_len, 1), ctx_len, ctx_len - q.shape[0], 0, window)


def window_prefill_attention_triton(
    q: torch.Tensor,  # [n, q_heads, dim]: the chunk's queries at positions start .. start+n-1
    k: torch.Tensor,  # [n, kv_heads, dim]: the chunk's own K/V
    v: torch.Tensor,
    ring_k: torch.Tensor,  # [window, kv_heads, dim]: position p in slot p % window, for the positions before start
    ring_v: torch.Tensor,
    start: int,
    window: int,
) -> torch.Tensor:
    """Each query sees the keys at positions (p - window, p]: the ring, rotated into position order
    (positions start-window .. start-1, those below 0 empty), followed by the chunk's own keys."""
    if window < 1 or ring_k.shape[0] != window or ring_v.shape != ring_k.shape or k.shape[0] != q.shape[0] or v.shape != k.shape:
        raise ValueError(f"window prefill attention: q {tuple(q.shape)}, k {tuple(k.shape)}, ring {tuple(ring_k.shape)}, window {window}")
    shift = -(start % window)  # slot (start + s) % window holds position start - window + s
    keys, values = torch.cat([ring_k.roll(shift, 0), k]), torch.cat([ring_v.roll(shift, 0), v])
    one_block = torch.zeros(1, dtype=torch.long, device=q.device)
    return _attend(q, keys, values, one_block, len(keys), len(keys), start, start - window, window)


def compile_cases(geometry: AttentionGeometry, dtype: torch.dtype) -> list[CompileCase]:
    """The one specialization every wrapper launches at this geometry and dtype on CUDA."""
    shape = tiles(geometry.head_dim, dtype)
    ints = ("n", "num_keys", "block_size", "q_start", "key_start", "window")
    signature = {"q_ptr": pointer(dtype), "k_ptr": pointer(dtype), "v_ptr": pointer(dtype), "table_ptr": pointer(torch.int64)}
    signature |= {"out_ptr": pointer(dtype), **dict.fromkeys(ints, "i32"), "scale_log2": "fp32"}
    constexprs = _constexprs(geometry.q_heads, geometry.kv_heads, geometry.head_dim, dtype, upcast=False)
    signature |= dict.fromkeys(constexprs, "constexpr")
    options = {"num_warps": shape.num_warps, "num_stages": shape.num_stages}
    return [CompileCase("prefill", _prefill_kernel, signature, constexprs, options)]
