"""Paged attention over a flat slot-indexed KV cache (torch reference implementation).

Cache layout per layer: [num_slots, kv_heads, head_dim]; slot = block * block_size + offset.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_decode_attention(
    q: torch.Tensor,  # [batch, q_heads, dim], one query token per sequence
    k_cache: torch.Tensor,  # [slots, kv_heads, dim]
    v_cache: torch.Tensor,
    ctx_slots: torch.Tensor,  # [batch, max_ctx] slot of each context position (padding: any slot)
    ctx_lens: torch.Tensor,  # [batch]
) -> torch.Tensor:
    _check(q, k_cache, v_cache)
    batch, max_ctx = ctx_slots.shape
    if ctx_lens.shape != (batch,) or q.shape[0] != batch:
        raise ValueError(f"decode attention: q {tuple(q.shape)}, ctx_slots {tuple(ctx_slots.shape)}, ctx_lens {tuple(ctx_lens.shape)}")
    k = gather_slots(k_cache, ctx_slots).transpose(1, 2)  # [batch, kv_heads, max_ctx, dim]
    v = gather_slots(v_cache, ctx_slots).transpose(1, 2)
    valid = torch.arange(max_ctx, device=q.device)[None, :] < ctx_lens[:, None]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=valid[:, None, None, :], enable_gqa=True)
    return out.squeeze(2)


def paged_prefill_attention(
    q: torch.Tensor,  # [n, q_heads, dim]: queries at context positions ctx_len-n .. ctx_len-1
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    ctx_slots: torch.Tensor,  # [ctx_len]
) -> torch.Tensor:
    _check(q, k_cache, v_cache)
    n, ctx_len = q.shape[0], ctx_slots.shape[0]
    if n > ctx_len:
        raise ValueError(f"prefill attention: {n} queries but only {ctx_len} context positions")
    k = gather_slots(k_cache, ctx_slots).transpose(0, 1).unsqueeze(0)  # [1, kv_heads, ctx, dim]
    v = gather_slots(v_cache, ctx_slots).transpose(0, 1).unsqueeze(0)
    query_pos = torch.arange(ctx_len - n, ctx_len, device=q.device)
    causal = torch.arange(ctx_len, device=q.device)[None, :] <= query_pos[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k, v, attn_mask=causal, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def gather_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache[slots] for any index shape; index_select is several times faster than advanced indexing on CPU."""
    return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.shape != v_cache.shape or k_cache.dim() != 3:
        raise ValueError(f"k/v cache shapes {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    if q.dim() != 3 or q.shape[-1] != k_cache.shape[-1] or q.shape[1] % k_cache.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} does not fit cache {tuple(k_cache.shape)}")
