"""Paged decode attention in Triton: one query token per request over a per-kv-head list of KV
blocks (GQA: a program serves every query head of one kv head), online softmax in fp32.

Its reference is kernels.attention.paged_decode_attention (the path the CPU runs). Products
are element-wise and reduced with tl.sum rather than tl.dot: decode is bound by reading K/V,
any block size works, and the interpreter's bf16 tl.dot bug never applies.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    lens_ptr,
    out_ptr,
    max_blocks,
    scale,
    H: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    B: tl.constexpr,
    BP: tl.constexpr,
):
    row, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    g = tl.arange(0, GP)[:, None]
    d = tl.arange(0, DP)[None, :]  # tiles are powers of two: lanes past the head dim and the block are masked
    t = tl.arange(0, BP)
    q_mask = (g < G) & (d < D)
    q_offsets = ((row * H + head) * G + g) * D + d
    q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0).to(tl.float32)  # [GP, DP]
    length = tl.load(lens_ptr + row)
    best = tl.full([GP], float("-inf"), tl.float32)
    total = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    for j in range(0, tl.minimum(tl.cdiv(length, B), max_blocks)):  # like the reference: a table holds at most max_blocks
        block = tl.load(tables_ptr + (row * H + head) * max_blocks + j).to(tl.int64)
        valid = (t < B) & ((j * B + t) < length)
        kv_offsets = ((block * B + t[:, None]) * H + head) * D + d
        kv_mask = valid[:, None] & (d < D)
        k = tl.load(k_ptr + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)  # [BP, DP]
        v = tl.load(v_ptr + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GP, BP]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        p = tl.exp(scores - new_best[:, None])
        rescale = tl.exp(best - new_best)
        total = total * rescale + tl.sum(p, axis=1)
        acc = acc * rescale[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        best = new_best
    total = tl.where(total > 0, total, 1.0)  # an empty context gives 0 (as the reference does), not 0/0
    tl.store(out_ptr + q_offsets, (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=q_mask)


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, block: int) -> None:
    if (
        q.dim() != 3
        or k_cache.dim() != 3
        or k_cache.shape != v_cache.shape
        or k_cache.shape[2] != q.shape[2]
        or q.shape[1] % k_cache.shape[1]
    ):
        raise ValueError(f"decode attention: q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    if tables.dim() != 3 or tables.shape[:2] != (q.shape[0], k_cache.shape[1]) or lens.shape != (q.shape[0],):
        raise ValueError(f"decode attention: block_tables {tuple(tables.shape)}, ctx_lens {tuple(lens.shape)} for q {tuple(q.shape)}")
    if tables.is_floating_point() or lens.is_floating_point():
        raise ValueError(f"decode attention: block_tables ({tables.dtype}) and ctx_lens ({lens.dtype}) must be integers")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("decode attention kernel: the k/v caches must be contiguous (the kernel computes slot offsets)")


def paged_decode_attention_triton(
    q: torch.Tensor,  # [batch, q_heads, dim]
    k_cache: torch.Tensor,  # [slots, kv_heads, dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [batch, kv_heads, max_blocks] int64: each kv head's blocks, in position order
    ctx_lens: torch.Tensor,  # [batch] int64
    block_size: int,
) -> torch.Tensor:
    """Attention of each request's one query over its first ctx_lens positions (at most max_blocks
    blocks, as in the reference), in q's dtype: one program per (request, kv head)."""
    _check(q, k_cache, v_cache, block_tables, ctx_lens, block_size)
    (batch, q_heads, dim), heads = q.shape, k_cache.shape[1]
    q, tables = q.contiguous(), block_tables.contiguous()
    out = torch.empty_like(q)
    group = q_heads // heads
    _decode_kernel[(batch, heads)](
        q, k_cache, v_cache, tables, ctx_lens.contiguous(), out, tables.shape[2], 1.0 / math.sqrt(dim),
        H=heads, G=group, GP=triton.next_power_of_2(group), D=dim, DP=triton.next_power_of_2(dim),
        B=block_size, BP=triton.next_power_of_2(block_size),
    )  # fmt: skip
    return out
