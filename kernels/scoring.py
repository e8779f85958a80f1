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

from pulseinfer.kernels.compile_cases import AttentionGeometry, CompileCase, pointer

# Host blocks per program: 64, fewer at head dims past 128, so that a program's [blocks, dim] kmin
# and kmax tiles stay within 8192 values each (at 256, 64 blocks spill registers on sm_80 and sm_90).
QUEST_TILE_BLOCKS, QUEST_TILE_VALUES = 64, 8192


def quest_weights(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """q [..., q_heads, dim] -> [..., 2, kv_heads, dim] fp32: each GQA group's summed positive
    parts (what kmax multiplies) and negative parts (what kmin multiplies)."""
    if q.dim() < 2 or q.shape[-2] % kv_heads:
        raise ValueError(f"quest scores: q {tuple(q.shape)} for {kv_heads} kv heads")
    grouped = q.float().reshape(*q.shape[:-2], kv_heads, q.shape[-2] // kv_heads, q.shape[-1])  # [..., kv_heads, group, dim]
    return torch.stack((grouped.clamp(min=0).sum(dim=-2), grouped.clamp(max=0).sum(dim=-2)), dim=-3)


def _check(weights: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, table: torch.Tensor) -> None:
    if (
        weights.dim() != 4
        or kmin.dim() != 3
        or kmin.shape != kmax.shape
        or weights.shape[2:] != kmin.shape[1:]
        or table.dim() != 2
        or table.shape[0] != weights.shape[0]
    ):
        raise ValueError(
            f"quest scores: weights {tuple(weights.shape)}, kmin {tuple(kmin.shape)}, kmax {tuple(kmax.shape)}, table {tuple(table.shape)}"
        )


def quest_scores_ref(weights: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, table: torch.Tensor, per_head: bool) -> torch.Tensor:
    """weights [rows, 2, kv_heads, dim] (quest_weights of each row's query); kmin, kmax [slots,
    kv_heads, dim] (every block's summaries); table [rows, width] the slots each row scores ->
    scores [rows, kv_heads, width] per kv head, or [rows, 1, width] summed over the heads, in fp32."""
    _check(weights, kmin, kmax, table)
    kmin, kmax = kmin[table].float(), kmax[table].float()  # [rows, width, kv_heads, dim]
    if per_head:
        return torch.einsum("rhd,rnhd->rhn", weights[:, 0], kmax) + torch.einsum("rhd,rnhd->rhn", weights[:, 1], kmin)
    flat = weights.flatten(2)  # [rows, 2, kv_heads * dim]
    kmax, kmin = kmax.flatten(2), kmin.flatten(2)  # [rows, width, kv_heads * dim]
    return (kmax @ flat[:, 0, :, None]).add_(kmin @ flat[:, 1, :, None]).transpose(1, 2)


@triton.jit
def _quest_kernel(
    w_ptr, kmin_ptr, kmax_ptr, table_ptr, out_ptr, width, H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, TILE: tl.constexpr
):
    row, head, tile = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    blocks = tile * TILE + tl.arange(0, TILE)
    d = tl.arange(0, DP)
    slots = tl.load(table_ptr + row * width + blocks, mask=blocks < width, other=0)  # the row's blocks, read in place
    mask = (blocks[:, None] < width) & (d[None, :] < D)
    offsets = (slots[:, None] * H + head) * D + d[None, :]
    kmin = tl.load(kmin_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    kmax = tl.load(kmax_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    positive = tl.load(w_ptr + (row * 2 * H + head) * D + d, mask=d < D, other=0.0)
    negative = tl.load(w_ptr + ((row * 2 + 1) * H + head) * D + d, mask=d < D, other=0.0)
    score = tl.sum(kmax * positive[None, :] + kmin * negative[None, :], axis=1)
    tl.store(out_ptr + (row * H + head) * width + blocks, score, mask=blocks < width)


def _quest_constexprs(kv_heads: int, dim: int) -> dict[str, int]:
    """What the kernel is specialized on: quest_scores_triton launches with these, compile_cases compiles them."""
    padded = triton.next_power_of_2(dim)
    return {"H": kv_heads, "D": dim, "DP": padded, "TILE": min(QUEST_TILE_BLOCKS, QUEST_TILE_VALUES // padded)}


def quest_scores_triton(weights: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, table: torch.Tensor, per_head: bool) -> torch.Tensor:
    """The same as quest_scores_ref: one program per (row, kv head, tile of its blocks), each
    block's summaries read where they lie through the row's table (no gathered copy)."""
    _check(weights, kmin, kmax, table)
    rows, width = table.shape
    heads, dim = kmin.shape[1:]
    out = torch.empty((rows, heads, width), dtype=torch.float32, device=kmin.device)
    if rows and width:
        constexprs = _quest_constexprs(heads, dim)
        grid = (rows, heads, triton.cdiv(width, constexprs["TILE"]))
        summaries = (kmin.contiguous(), kmax.contiguous())
        _quest_kernel[grid](weights.float().contiguous(), *summaries, table.contiguous(), out, width, **constexprs)
    return out if per_head else out.sum(dim=1, keepdim=True)


def compile_cases(geometry: AttentionGeometry, dtype: torch.dtype) -> list[CompileCase]:
    """The compile gate's cases (kernels/compile_cases.py): summaries of a cache of `dtype` (they are
    stored in the cache's dtype), fp32 query weights."""
    constexprs = _quest_constexprs(geometry.kv_heads, geometry.head_dim)
    summaries = dict.fromkeys(("kmin_ptr", "kmax_ptr"), pointer(dtype))
    signature = {"w_ptr": "*fp32", **summaries, "table_ptr": "*i64", "out_ptr": "*fp32", "width": "i32"}
    quest = CompileCase("quest_scores", _quest_kernel, {**signature, **dict.fromkeys(constexprs, "constexpr")}, constexprs)
    constexprs = _lowrank_constexprs(geometry.kv_heads, geometry.group, geometry.head_dim // 4, geometry.block_size)  # the default rank
    signature = {"q_ptr": "*fp32", "keys_ptr": pointer(dtype), "table_ptr": "*i64", "out_ptr": "*fp32", "width": "i32", "slots": "i32"}
    lowrank = CompileCase("lowrank_block_lse", _lowrank_lse_kernel, {**signature, **dict.fromkeys(constexprs, "constexpr")}, constexprs)
    return [quest, lowrank]


def quest_scores(weights: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, table: torch.Tensor, per_head: bool) -> torch.Tensor:
    """The kernel on CUDA; the reference elsewhere."""
    return (quest_scores_triton if kmin.is_cuda else quest_scores_ref)(weights, kmin, kmax, table, per_head)


# Host blocks per program of the low-rank kernel: its [group, blocks, block_size] logits stay within
# 4096 fp32 values (GQA groups up to 8 at block size 16 with 32 blocks).
LOWRANK_TILE_VALUES = 4096


# Per (row, kv head, tile of the row's blocks): each query head's log-sum-exp of its projected logits
# over each block's tokens, the keys read in place through the row's slot table.
@triton.jit
def _lowrank_lse_kernel(
    q_ptr,
    keys_ptr,
    table_ptr,
    out_ptr,
    width,
    slots,
    H: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    R: tl.constexpr,
    B: tl.constexpr,
    BP: tl.constexpr,
    TILE: tl.constexpr,
):
    row, head, tile = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    blocks = tile * TILE + tl.arange(0, TILE)
    in_row = blocks < width
    at = tl.load(table_ptr + row * width + blocks, mask=in_row, other=0)
    t = tl.arange(0, BP)
    g = tl.arange(0, GP)
    tokens = in_row[:, None] & (t[None, :] < B)
    logits = tl.zeros((GP, TILE, BP), dtype=tl.float32)
    for r in range(R):
        k = tl.load(keys_ptr + ((head * R + r) * slots + at[:, None]) * B + t[None, :], mask=tokens, other=0.0).to(tl.float32)
        q = tl.load(q_ptr + ((row * H + head) * G + g) * R + r, mask=g < G, other=0.0)
        logits += q[:, None, None] * k[None, :, :]
    logits = tl.where((t < B)[None, None, :], logits, float("-inf"))
    peak = tl.max(logits, axis=2)
    lse = peak + tl.log(tl.sum(tl.exp(logits - peak[:, :, None]), axis=2))
    out = ((row * H + head) * G + g[:, None]) * width + blocks[None, :]
    tl.store(out_ptr + out, lse, mask=(g[:, None] < G) & in_row[None, :])


def _lowrank_constexprs(kv_heads: int, group: int, rank: int, block_size: int) -> dict[str, int]:
    """What the kernel is specialized on: lowrank_block_lse launches with these, compile_cases compiles them."""
    padded_group, padded_block = triton.next_power_of_2(group), triton.next_power_of_2(block_size)
    tile = max(1, min(64, LOWRANK_TILE_VALUES // (padded_group * padded_block)))
    return {"H": kv_heads, "G": group, "GP": padded_group, "R": rank, "B": block_size, "BP": padded_block, "TILE": tile}


def lowrank_block_lse(projected: torch.Tensor, keys: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """projected [rows, kv_heads, group, rank] (fp32 queries on the basis, scaled); keys [kv_heads,
    rank, slots, block_size]; table [rows, width] -> [rows, kv_heads, group, width]: each query
    head's log-sum-exp over the tokens of each block the table names. One program per (row, kv
    head, tile of blocks), no gathered copy of the keys."""
    rows, heads, group, rank = projected.shape
    width, slots, block_size = table.shape[1], keys.shape[2], keys.shape[3]
    out = torch.empty((rows, heads, group, width), dtype=torch.float32, device=keys.device)
    if rows and width:
        constexprs = _lowrank_constexprs(heads, group, rank, block_size)
        grid = (rows, heads, triton.cdiv(width, constexprs["TILE"]))
        _lowrank_lse_kernel[grid](projected.contiguous(), keys.contiguous(), table.contiguous(), out, width, slots, **constexprs)
    return out


def lowrank_scores(
    q: torch.Tensor, basis: torch.Tensor, keys: torch.Tensor, table: torch.Tensor, valid: torch.Tensor, per_head: bool
) -> torch.Tensor:
    """Each block's estimated share of a row's query's attention over its host blocks, from keys
    projected on a low-rank basis: per query head, the softmax over the row's blocks of each
    block's log-sum-exp of q.k / sqrt(dim) in the projection, summed over each kv head's GQA group
    ([rows, kv_heads, width]) or over all heads ([rows, 1, width], SoloHead). A share, unlike a raw
    score, lets no head dominate the sum by the scale of its logits.
    q [rows, q_heads, dim]; basis [kv_heads, dim, rank]; keys [kv_heads, rank, slots, block_size]:
    every block's projected keys, each coordinate's blocks contiguous; table [rows, width] the
    slots each row scores, `valid` [rows, width] which of them are its blocks (the rest weigh
    nothing). All rows in one batched matmul."""
    kv_heads, dim, rank = basis.shape
    if q.dim() != 3 or q.shape[2] != dim or q.shape[1] % kv_heads or keys.dim() != 4 or keys.shape[:2] != (kv_heads, rank):
        raise ValueError(f"low-rank scores: q {tuple(q.shape)}, basis {tuple(basis.shape)}, keys {tuple(keys.shape)}")
    rows, width = table.shape
    block_size = keys.shape[3]
    group = q.shape[1] // kv_heads
    projected = torch.matmul(q.float().view(rows, kv_heads, group, dim), basis.float()) / math.sqrt(dim)  # [rows, kv_heads, group, rank]
    if keys.is_cuda:  # the same shares as a softmax over the blocks' log-sum-exps, the keys read in place
        lse = lowrank_block_lse(projected, keys, table).masked_fill_(~valid[:, None, None, :], float("-inf"))
        shares = torch.softmax(lse, dim=3).nan_to_num_(0.0)  # a row of no block: no share
        return shares.sum(dim=2) if per_head else shares.sum(dim=(1, 2))[:, None]
    gathered = keys.index_select(2, table.flatten()).float().view(kv_heads, rank, rows, width * block_size)
    logits = torch.einsum("rhgk,hkrn->rhgn", projected, gathered).view(rows, kv_heads, group, width, block_size)
    logits.masked_fill_(~valid[:, None, None, :, None], float("-inf"))
    peak = logits.amax(dim=(3, 4), keepdim=True).clamp_(min=torch.finfo(torch.float32).min)  # a row of no block stays finite
    mass = logits.sub_(peak).exp_().sum(dim=4)  # [rows, kv_heads, group, width], up to each head's factor
    shares = mass / mass.sum(dim=3, keepdim=True).clamp_(min=torch.finfo(torch.float32).tiny)
    return shares.sum(dim=2) if per_head else shares.sum(dim=(1, 2))[:, None]
