"""The recall copy: host pool units ([K|V][kv_head][token][dim], one row per (block, layer)) into
device cache blocks (slot-major [slot][kv_head][dim]), whole units (SoloHead) or one kv head of
each (the head-wise baseline)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class MappedHost:
    """Page-locked host memory registered as mapped, as Triton takes a pointer argument: its launcher
    turns the host address into the device's UVA address of the same bytes."""

    address: int
    dtype: torch.dtype

    def data_ptr(self) -> int:
        return self.address


def _check(
    units: torch.Tensor,
    unit_index: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    dst_blocks: torch.Tensor,
    heads: torch.Tensor | None,
) -> None:
    if units.dim() != 5 or units.shape[1] != 2 or k_cache.dim() != 3 or k_cache.shape[1:] != (units.shape[2], units.shape[4]):
        raise ValueError(f"recall: units {tuple(units.shape)} do not fit cache {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"recall: k/v cache shapes {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    if not (units.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("recall: the units and the caches must be contiguous (copies go by computed offsets, in place)")
    if unit_index.shape != dst_blocks.shape or (heads is not None and heads.shape != dst_blocks.shape):
        raise ValueError(f"recall: {unit_index.numel()} units for {dst_blocks.numel()} device blocks")


def recall_ref(
    units: torch.Tensor,  # [U, 2, kv_heads, block_size, dim]
    unit_index: torch.Tensor,  # [n] rows of units
    k_cache: torch.Tensor,  # [slots, kv_heads, dim]
    v_cache: torch.Tensor,
    dst_blocks: torch.Tensor,  # [n] device blocks
    heads: torch.Tensor | None = None,  # [n] the one kv head to move of each unit; None: all
) -> None:
    """Copies unit unit_index[i] (or only its kv head heads[i]) into device block dst_blocks[i], in place."""
    _check(units, unit_index, k_cache, v_cache, dst_blocks, heads)
    _, _, kv_heads, block, dim = units.shape
    k_blocks, v_blocks = k_cache.view(-1, block, kv_heads, dim), v_cache.view(-1, block, kv_heads, dim)
    if heads is None:  # one gather of whole rows, then a transposing index_copy_: 1.5x faster than one index_put
        src = torch.index_select(units.view(units.shape[0], -1), 0, unit_index).view(-1, *units.shape[1:])  # [n, 2, kv_heads, block, dim]
        k_blocks.index_copy_(0, dst_blocks, src[:, 0].transpose(1, 2))
        v_blocks.index_copy_(0, dst_blocks, src[:, 1].transpose(1, 2))
    else:
        src = units[unit_index, :, heads]  # [n, 2, block, dim]
        k_blocks[dst_blocks, :, heads] = src[:, 0]
        v_blocks[dst_blocks, :, heads] = src[:, 1]


@triton.jit
def _recall_kernel(
    units_ptr,
    index_ptr,
    heads_ptr,
    k_ptr,
    v_ptr,
    dst_ptr,
    H: tl.constexpr,
    B: tl.constexpr,
    BP: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    PER_HEAD: tl.constexpr,
):
    i = tl.program_id(0)
    if PER_HEAD:
        head = tl.load(heads_ptr + i)
    else:
        head = tl.program_id(1)
    unit = tl.load(index_ptr + i).to(tl.int64)  # int64: pool offsets pass 2**31
    dst = tl.load(dst_ptr + i).to(tl.int64)
    t = tl.arange(0, BP)[:, None]  # power-of-two tiles, masked to the block and the head dim
    d = tl.arange(0, DP)[None, :]
    mask = (t < B) & (d < D)
    src = unit * (2 * H * B * D) + (head * B + t) * D + d
    out = ((dst * B + t) * H + head) * D + d
    tl.store(k_ptr + out, tl.load(units_ptr + src, mask=mask), mask=mask)
    tl.store(v_ptr + out, tl.load(units_ptr + src + H * B * D, mask=mask), mask=mask)


def recall_triton(
    units: torch.Tensor,
    unit_index: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    dst_blocks: torch.Tensor,
    heads: torch.Tensor | None = None,
    source: MappedHost | None = None,
) -> None:
    """The same as recall_ref: one program per (unit, kv head) moving a [block, dim] K tile and V tile.
    On CUDA the kernel reads `units` from device memory (staged there), or, given `source`, the
    same units in mapped host memory through UVA (`units` then is its CPU view, for the checks)."""
    _check(units, unit_index, k_cache, v_cache, dst_blocks, heads)
    _, _, kv_heads, block, dim = units.shape
    n = unit_index.numel()
    if n:
        grid = (n, 1 if heads is not None else kv_heads)
        head_index = heads if heads is not None else dst_blocks  # unread without PER_HEAD
        _recall_kernel[grid](
            source or units,
            unit_index,
            head_index,
            k_cache,
            v_cache,
            dst_blocks,
            H=kv_heads,
            B=block,
            BP=triton.next_power_of_2(block),
            D=dim,
            DP=triton.next_power_of_2(dim),
            PER_HEAD=heads is not None,
        )


def recall(
    units: torch.Tensor,
    unit_index: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    dst_blocks: torch.Tensor,
    heads: torch.Tensor | None = None,
) -> None:
    """The kernel when the cache is on CUDA; the reference (torch's row copies) elsewhere."""
    (recall_triton if k_cache.is_cuda else recall_ref)(units, unit_index, k_cache, v_cache, dst_blocks, heads)
