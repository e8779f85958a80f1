"""Block scores for selection: Quest bounds of min/max summaries, or attention estimated from
low-rank keys.

Quest upper bounds of q.k per host block: for kv head h and block i, the sum over h's GQA
group of query heads and over dims of max(q * kmax, q * kmin), which no key in the block exceeds.

Since kmax >= kmin, max(q * kmax, q * kmin) = relu(q) * kmax + min(q, 0) * kmin: summing the
group's positive and negative parts first (`quest_weights`, once per query) turns the bound into
two dot products per block; summed over the kv heads too (SoloHead), two matrix-vector products."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pulseinfer.kernels.compile_cases import AttentionGeometry, CompileCase

# Host blocks per program: 64, fewer at head dims past 128, so that a program's [blocks, dim] kmin
# and kmax tiles stay within 8192 values each (at 256, 64 blocks spill registers on sm_80 and sm_90).
QUEST_TILE_BLOCKS, QUEST_TILE_VALUES = 64, 8192


def quest_weights(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """q [..., q_heads, dim] -> [..., 2, kv_heads, dim] fp32: each GQA group's summed positive
    parts (what kmax multiplies) and negative parts (what kmin multiplies)."""
    if q.dim() < 2 or q.shape[-2] % kv_heads:
        raise ValueError(f"quest scores: q {tuple(q.shape)} for {kv_heads} kv heads")
    grouped = q.float().reshape(*q.shape[:-2], kv_heads, -1, q.shape[-1])  # [..., kv_heads, group, dim]
    return torch.stack((grouped.clamp(min=0).sum(dim=-2), grouped.clamp(max=0).sum(dim=-2)), dim=-3)


def _check(weights: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> None:
    if weights.dim() != 3 or kmin.dim() != 3 or kmin.shape != kmax.shape or weights.shape[1:] != kmin.shape[1:]:
        raise ValueError(f"quest scores: weights {tuple(weights.shape)}, kmin {tuple(kmin.shape)}, kmax {tuple(kmax.shape)}")


def quest_scores_ref(weights: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, per_head: bool) -> torch.Tensor:
    """weights [2, kv_heads, dim] (quest_weights of one query); kmin, kmax [n, kv_heads, dim] ->
    scores [kv_heads, n] per kv head, or [1, n] summed over the heads, in fp32."""
    _check(weights, kmin, kmax)
    kmin, kmax = kmin.float(), kmax.float()
    if per_head:
        return torch.einsum("hd,nhd->hn", weights[0], kmax) + torch.einsum("hd,nhd->hn", weights[1], kmin)
    n = kmin.shape[0]
    return torch.mv(kmax.reshape(n, -1), weights[0].reshape(-1)).addmv_(kmin.reshape(n, -1), weights[1].reshape(-1))[None]


@triton.jit
def _quest_kernel(w_ptr, kmin_ptr, kmax_ptr, out_ptr, n, H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, TILE: tl.constexpr):
    head, tile = tl.program_id(0), tl.program_id(1).to(tl.int64)
    blocks = tile * TILE + tl.arange(0, TILE)
    d = tl.arange(0, DP)
    mask = (blocks[:, None] < n) & (d[None, :] < D)
    offsets = (blocks[:, None] * H + head) * D + d[None, :]
    kmin = tl.load(kmin_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    kmax = tl.load(kmax_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    positive = tl.load(w_ptr + head * D + d, mask=d < D, other=0.0)
    negative = tl.load(w_ptr + (H + head) * D + d, mask=d < D, other=0.0)
    score = tl.sum(kmax * positive[None, :] + kmin * negative[None, :], axis=1)
    tl.store(out_ptr + head * n + blocks, score, mask=blocks < n)


def _quest_constexprs(kv_heads: int, dim: int) -> dict[str, int]:
    """What the kernel is specialized on: quest_scores_triton launches with these, compile_cases compiles them."""
    padded = triton.next_power_of_2(dim)
    return {"H": kv_heads, "D": dim, "DP": padded, "TILE": min(QUEST_TILE_BLOCKS, QUEST_TILE_VALUES // padded)}


def quest_scores_triton(weights: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, per_head: bool) -> torch.Tensor:
    """The same as quest_scores_ref: one program per (kv head, tile of blocks)."""
    _check(weights, kmin, kmax)
    n, heads, dim = kmin.shape
    out = torch.empty((heads, n), dtype=torch.float32, device=kmin.device)
    if n:
        constexprs = _quest_constexprs(heads, dim)
        grid = (heads, triton.cdiv(n, constexprs["TILE"]))
        _quest_kernel[grid](weights.float().contiguous(), kmin.contiguous(), kmax.contiguous(), out, n, **constexprs)
    return out if per_head else out.sum(dim=0, keepdim=True)


def compile_cases(geometry: AttentionGeometry, dtype: torch.dtype) -> list[CompileCase]:
    """The compile gate's cases (kernels/compile_cases.py). The summaries and weights are fp32 whatever
    the cache's dtype, so every dtype gives the same case."""
    constexprs = _quest_constexprs(geometry.kv_heads, geometry.head_dim)
    pointers = dict.fromkeys(("w_ptr", "kmin_ptr", "kmax_ptr", "out_ptr"), "*fp32")
    signature = {**pointers, "n": "i32", **dict.fromkeys(constexprs, "constexpr")}
    return [CompileCase("quest_scores", _quest_kernel, signature, constexprs)]


def quest_scores(weights: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, per_head: bool) -> torch.Tensor:
    """The kernel on CUDA; the reference elsewhere."""
    return (quest_scores_triton if kmin.is_cuda else quest_scores_ref)(weights, kmin, kmax, per_head)


def lowrank_scores(q: torch.Tensor, basis: torch.Tensor, keys: torch.Tensor, per_head: bool) -> torch.Tensor:
    """Each block's estimated share of a query's attention over the host blocks, from keys
    projected on a low-rank basis: per query head, the softmax over blocks of each block's
    log-sum-exp of q.k / sqrt(dim) in the projection, summed over each kv head's GQA group
    ([kv_heads, n]) or over all heads ([1, n], SoloHead). A share, unlike a raw score, lets no
    head dominate the sum by the scale of its logits.
    q [q_heads, dim]; basis [kv_heads, dim, rank]; keys [kv_heads, rank, n, block_size]: each
    projected coordinate of a head's blocks contiguous, so the logits are one batched matmul
    over the stored keys as they lie (1.4x faster in a 16-row decode step than the keys stored
    rank-last and read transposed)."""
    kv_heads, dim, rank = basis.shape
    if q.dim() != 2 or q.shape[1] != dim or q.shape[0] % kv_heads or keys.dim() != 4 or keys.shape[:2] != (kv_heads, rank):
        raise ValueError(f"low-rank scores: q {tuple(q.shape)}, basis {tuple(basis.shape)}, keys {tuple(keys.shape)}")
    _, _, n, block_size = keys.shape
    projected = torch.matmul(q.float().view(kv_heads, -1, dim), basis.float()) / math.sqrt(dim)  # [kv_heads, group, rank]
    logits = torch.bmm(projected, keys.float().reshape(kv_heads, rank, n * block_size))  # [kv_heads, group, n * block_size]
    mass = logits.sub_(logits.amax(dim=2, keepdim=True)).exp_().view(kv_heads, -1, n, block_size).sum(dim=3)  # up to each head's factor
    shares = mass / mass.sum(dim=2, keepdim=True)  # [kv_heads, group, n]
    return shares.sum(dim=1) if per_head else shares.sum(dim=(0, 1))[None]
