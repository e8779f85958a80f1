"""Paged attention over a block-indexed KV cache (torch reference implementation).

Cache layout per layer: [num_blocks * block_size, kv_heads, head_dim], so a block is one
contiguous range of block_size * kv_heads * head_dim values and context is gathered a
whole block at a time (far faster than per-token rows) into a reused workspace (fresh
multi-MB buffers per layer cost more in page faults than the copy itself).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class GatherWorkspace:
    """Grow-only buffers of every layer's attention: K and V of gathered context blocks (the torch
    path), and the fp32 split partials of the Triton decode (kernels/decode_triton.py)."""

    def __init__(self) -> None:
        self._k = torch.empty(0)
        self._v = torch.empty(0)
        self._partials = torch.empty(0)

    def buffers(self, rows: int, row_size: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        need = rows * row_size
        if self._k.numel() < need or self._k.dtype != like.dtype or self._k.device != like.device:
            self._k = torch.empty(need, dtype=like.dtype, device=like.device)
            self._v = torch.empty(need, dtype=like.dtype, device=like.device)
        return self._k[:need].view(rows, row_size), self._v[:need].view(rows, row_size)

    def partials(self, numel: int, device: torch.device) -> torch.Tensor:
        if self._partials.numel() < numel or self._partials.device != device:
            self._partials = torch.empty(numel, dtype=torch.float32, device=device)
        return self._partials[:numel]


def gather_blocks(
    k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor, block_size: int, workspace: GatherWorkspace
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the given blocks: [*blocks.shape[:-1], blocks.shape[-1] * block_size, kv_heads, dim]."""
    heads, dim = k_cache.shape[1:]
    k_blocks = k_cache.view(-1, block_size * heads * dim)
    v_blocks = v_cache.view(-1, block_size * heads * dim)
    flat = blocks.reshape(-1)
    k_out, v_out = workspace.buffers(flat.numel(), k_blocks.shape[1], k_cache)
    torch.index_select(k_blocks, 0, flat, out=k_out)
    torch.index_select(v_blocks, 0, flat, out=v_out)
    shape = (*blocks.shape[:-1], blocks.shape[-1] * block_size, heads, dim)
    return k_out.view(shape), v_out.view(shape)


def gather_head_blocks(
    k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of per-kv-head block tables [b, kv_heads, n]: [b, kv_heads, n * block_size, dim]."""
    heads, dim = k_cache.shape[1:]
    batch, _, n = tables.shape
    head = torch.arange(heads, device=tables.device)[None, :, None]
    k = k_cache.view(-1, block_size, heads, dim)[tables, :, head]  # [b, kv_heads, n, block_size, dim]
    v = v_cache.view(-1, block_size, heads, dim)[tables, :, head]
    return k.view(batch, heads, n * block_size, dim), v.view(batch, heads, n * block_size, dim)


def paged_decode_attention(
    q: torch.Tensor,  # [batch, q_heads, dim], one query token per sequence
    k_cache: torch.Tensor,  # [slots, kv_heads, dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [batch, max_blocks], or [batch, kv_heads, max_blocks] when each kv head attends its own blocks
    ctx_lens: torch.Tensor,  # [batch]; padding of a table repeats a block of the same row
    block_size: int,
    workspace: GatherWorkspace,
) -> torch.Tensor:
    _check(q, k_cache, v_cache)
    batch, heads = q.shape[0], k_cache.shape[1]
    per_head = block_tables.dim() == 3
    if block_tables.shape[0] != batch or ctx_lens.shape != (batch,) or (per_head and block_tables.shape[1] != heads):
        raise ValueError(
            f"decode attention: q {tuple(q.shape)}, block_tables {tuple(block_tables.shape)}, ctx_lens {tuple(ctx_lens.shape)}"
        )
    if per_head:
        k, v = gather_head_blocks(k_cache, v_cache, block_tables, block_size)  # [batch, kv_heads, ctx, dim]
    else:  # whole blocks, all heads: one contiguous row per block
        k, v = (t.transpose(1, 2) for t in gather_blocks(k_cache, v_cache, block_tables, block_size, workspace))
    valid = torch.arange(k.shape[2], device=q.device)[None, :] < ctx_lens[:, None]
    # The query heads of a GQA group become query rows against their kv head: no K/V expansion.
    grouped = q.view(batch, heads, q.shape[1] // heads, q.shape[2])
    out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=valid[:, None, None, :])
    return out.reshape(q.shape)


def paged_prefill_attention(
    q: torch.Tensor,  # [n, q_heads, dim]: queries at context positions ctx_len-n .. ctx_len-1
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    blocks: torch.Tensor,  # [ceil(ctx_len / block_size)]
    ctx_len: int,
    block_size: int,
    workspace: GatherWorkspace,
) -> torch.Tensor:
    _check(q, k_cache, v_cache)
    if blocks.shape[0] * block_size < ctx_len:
        raise ValueError(f"prefill attention: {ctx_len} context positions, {blocks.shape[0]} blocks")
    k, v = gather_blocks(k_cache, v_cache, blocks, block_size, workspace)
    return prefill_attention(q, k, v, ctx_len)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_len: int, window: int = 0) -> torch.Tensor:
    """Causal attention of n queries at positions ctx_len-n .. ctx_len-1 over k, v [>= ctx_len, kv_heads, dim],
    each seeing the last `window` positions (itself included) when window > 0."""
    n = q.shape[0]
    if n > ctx_len or k.shape[0] < ctx_len or window < 0:
        raise ValueError(f"prefill attention: {n} queries, {ctx_len} context positions, {k.shape[0]} keys, window {window}")
    k, v = k[:ctx_len].transpose(0, 1).unsqueeze(0), v[:ctx_len].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, ctx, dim]
    query_pos = torch.arange(ctx_len - n, ctx_len, device=q.device)
    offset = query_pos[:, None] - torch.arange(ctx_len, device=q.device)[None, :]
    allowed = (offset >= 0) & (offset < window) if window else offset >= 0
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k, v, attn_mask=allowed, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.shape != v_cache.shape or k_cache.dim() != 3:
        raise ValueError(f"k/v cache shapes {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    if q.dim() != 3 or q.shape[-1] != k_cache.shape[-1] or q.shape[1] % k_cache.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} does not fit cache {tuple(k_cache.shape)}")
