"""Quest upper bounds of q.k per host block: for kv head h and block i, the sum over h's GQA
group of query heads and over dims of max(q * kmax, q * kmin), which no key in the block exceeds.

Since kmax >= kmin, max(q * kmax, q * kmin) = relu(q) * kmax + min(q, 0) * kmin: summing the
group's positive and negative parts first turns the bound into two dot products per block."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _check(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> None:
    if q.dim() != 2 or kmin.dim() != 3 or kmin.shape != kmax.shape or q.shape[1] != kmin.shape[2] or q.shape[0] % kmin.shape[1]:
        raise ValueError(f"quest scores: q {tuple(q.shape)}, kmin {tuple(kmin.shape)}, kmax {tuple(kmax.shape)}")


def quest_scores_ref(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """q [q_heads, dim]; kmin, kmax [n, kv_heads, dim] -> scores [kv_heads, n] in fp32."""
    _check(q, kmin, kmax)
    heads, dim = kmin.shape[1:]
    grouped = q.float().reshape(heads, -1, dim)  # [kv_heads, group, dim]
    positive, negative = grouped.clamp(min=0).sum(dim=1), grouped.clamp(max=0).sum(dim=1)  # [kv_heads, dim]
    return torch.einsum("hd,nhd->hn", positive, kmax.float()) + torch.einsum("hd,nhd->hn", negative, kmin.float())


@triton.jit
def _quest_kernel(
    q_ptr, kmin_ptr, kmax_ptr, out_ptr, n, H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, TILE: tl.constexpr
):
    head, tile = tl.program_id(0), tl.program_id(1).to(tl.int64)
    blocks = tile * TILE + tl.arange(0, TILE)
    d = tl.arange(0, DP)
    mask = (blocks[:, None] < n) & (d[None, :] < D)
    offsets = (blocks[:, None] * H + head) * D + d[None, :]
    kmin = tl.load(kmin_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    kmax = tl.load(kmax_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    positive = tl.zeros([DP], dtype=tl.float32)
    negative = tl.zeros([DP], dtype=tl.float32)
    for g in tl.static_range(G):
        qg = tl.load(q_ptr + (head * G + g) * D + d, mask=d < D, other=0.0).to(tl.float32)
        positive += tl.maximum(qg, 0.0)
        negative += tl.minimum(qg, 0.0)
    score = tl.sum(kmax * positive[None, :] + kmin * negative[None, :], axis=1)
    tl.store(out_ptr + head * n + blocks, score, mask=blocks < n)


def quest_scores_triton(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, tile: int = 64) -> torch.Tensor:
    """The same as quest_scores_ref: one program per (kv head, tile of blocks)."""
    _check(q, kmin, kmax)
    n, heads, dim = kmin.shape
    out = torch.empty((heads, n), dtype=torch.float32, device=q.device)
    if n:
        grid = (heads, triton.cdiv(n, tile))
        _quest_kernel[grid](
            q.contiguous(),
            kmin.contiguous(),
            kmax.contiguous(),
            out,
            n,
            H=heads,
            G=q.shape[0] // heads,
            D=dim,
            DP=triton.next_power_of_2(dim),
            TILE=tile,
        )
    return out


def quest_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """The kernel on CUDA; the reference elsewhere."""
    return quest_scores_triton(q, kmin, kmax) if q.is_cuda else quest_scores_ref(q, kmin, kmax)
