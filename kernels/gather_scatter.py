"""Copies between host pool units ([K|V][kv_head][token][dim], one row per (block, layer)) and
device cache blocks (slot-major [slot][kv_head][dim]):
- recall: units into cache blocks, whole units (SoloHead) or one kv head of each (the head-wise baseline);
- scatter_units: blocks of K and V into units (the host pool's write-back);
- gather_units: whole units into a contiguous buffer, unit layout kept (the host pool's read-back).
On CUDA the pool is page-locked host memory registered as mapped: the kernels read and write it
in place through UVA (`MappedHost`), one launch per call, queued on the current stream."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pulseinfer.kernels.compile_cases import AttentionGeometry, CompileCase, pointer


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
def _unit_copy_kernel(
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
    TO_UNITS: tl.constexpr,
):
    """One [block, dim] K tile and V tile of one kv head between unit index[i] and a cache block:
    block dst[i] of the cache (a recall), or with TO_UNITS from block i of k and v into the unit."""
    i = tl.program_id(0)
    if PER_HEAD:
        head = tl.load(heads_ptr + i)
    else:
        head = tl.program_id(1)
    unit = tl.load(index_ptr + i).to(tl.int64)  # int64: pool offsets pass 2**31
    if TO_UNITS:
        block = i.to(tl.int64)
    else:
        block = tl.load(dst_ptr + i).to(tl.int64)
    t = tl.arange(0, BP)[:, None]  # power-of-two tiles, masked to the block and the head dim
    d = tl.arange(0, DP)[None, :]
    mask = (t < B) & (d < D)
    in_unit = unit * (2 * H * B * D) + (head * B + t) * D + d
    in_cache = ((block * B + t) * H + head) * D + d
    if TO_UNITS:
        tl.store(units_ptr + in_unit, tl.load(k_ptr + in_cache, mask=mask), mask=mask)
        tl.store(units_ptr + in_unit + H * B * D, tl.load(v_ptr + in_cache, mask=mask), mask=mask)
    else:
        tl.store(k_ptr + in_cache, tl.load(units_ptr + in_unit, mask=mask), mask=mask)
        tl.store(v_ptr + in_cache, tl.load(units_ptr + in_unit + H * B * D, mask=mask), mask=mask)


def _unit_copy_constexprs(kv_heads: int, block_size: int, dim: int, per_head: bool, to_units: bool) -> dict[str, int | bool]:
    """What the kernel is specialized on: recall_triton and scatter_units_triton launch with these, compile_cases compiles them."""
    BP, DP = triton.next_power_of_2(block_size), triton.next_power_of_2(dim)
    return {"H": kv_heads, "B": block_size, "BP": BP, "D": dim, "DP": DP, "PER_HEAD": per_head, "TO_UNITS": to_units}


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
        constexprs = _unit_copy_constexprs(kv_heads, block, dim, per_head=heads is not None, to_units=False)
        _unit_copy_kernel[grid](source or units, unit_index, head_index, k_cache, v_cache, dst_blocks, **constexprs)


def recall(
    units: torch.Tensor,
    unit_index: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    dst_blocks: torch.Tensor,
    heads: torch.Tensor | None = None,
    source: MappedHost | None = None,
) -> None:
    """The kernel when the cache is on CUDA (reading `source` when given); the reference (torch's row copies) elsewhere."""
    if k_cache.is_cuda:
        recall_triton(units, unit_index, k_cache, v_cache, dst_blocks, heads, source)
    else:
        recall_ref(units, unit_index, k_cache, v_cache, dst_blocks, heads)


def _check_blocks(units: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """scatter_units' blocks as the recall's cache: k, v [n, block_size, kv_heads, dim] -> [n * block_size, kv_heads, dim]."""
    if units.dim() != 5 or k.dim() != 4 or v.shape != k.shape or k.shape[1] != units.shape[3] or rows.shape != k.shape[:1]:
        raise ValueError(f"scatter_units: blocks {tuple(k.shape)} / {tuple(v.shape)} for {rows.numel()} units {tuple(units.shape)}")
    if not (k.is_contiguous() and v.is_contiguous()):
        raise ValueError("scatter_units: the blocks must be contiguous (copies go by computed offsets)")
    k_cache, v_cache = k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])
    _check(units, rows, k_cache, v_cache, rows, None)
    return k_cache, v_cache


def scatter_units_ref(units: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Writes block i of k and v ([n, block_size, kv_heads, dim], slot-major) into unit rows[i] of
    `units` ([U, 2, kv_heads, block_size, dim]), in place: one transposing scatter per K and V."""
    _check_blocks(units, rows, k, v)
    units[rows, 0] = k.transpose(1, 2)
    units[rows, 1] = v.transpose(1, 2)


def scatter_units_triton(
    units: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, source: MappedHost | None = None
) -> None:
    """The same as scatter_units_ref: the recall's kernel run the other way, one program per (unit,
    kv head); on CUDA into `source` (the mapped host pool, `units` its CPU view) when given."""
    k_cache, v_cache = _check_blocks(units, rows, k, v)
    _, _, kv_heads, block, dim = units.shape
    if rows.numel():
        constexprs = _unit_copy_constexprs(kv_heads, block, dim, per_head=False, to_units=True)
        _unit_copy_kernel[(rows.numel(), kv_heads)](source or units, rows, rows, k_cache, v_cache, rows, **constexprs)  # heads, dst unread


def scatter_units(units: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, source: MappedHost | None = None) -> None:
    """The kernel when the blocks are on CUDA; the reference elsewhere."""
    if k.is_cuda:
        scatter_units_triton(units, rows, k, v, source)
    else:
        scatter_units_ref(units, rows, k, v)


def _check_gather(units: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> None:
    if units.dim() != 5 or rows.dim() != 1 or out.shape != (rows.numel(), *units.shape[1:]) or out.dtype != units.dtype:
        raise ValueError(f"gather_units: {rows.numel()} units {tuple(units.shape)} {units.dtype} into {tuple(out.shape)} {out.dtype}")
    if not (units.is_contiguous() and out.is_contiguous()):
        raise ValueError("gather_units: the units and the output must be contiguous (copies go by computed offsets)")


def gather_units_ref(units: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> None:
    """out[i] = units[rows[i]]: whole units, their layout kept. out: [n, 2, kv_heads, block_size, dim]."""
    _check_gather(units, rows, out)
    row = units[0].numel()
    torch.index_select(units.view(-1, row), 0, rows, out=out.view(rows.numel(), row))


@triton.jit
def _gather_units_kernel(units_ptr, rows_ptr, out_ptr, ROW: tl.constexpr, TILE: tl.constexpr):
    """TILE elements of unit rows[i] into row i of out."""
    i = tl.program_id(0)
    offsets = tl.program_id(1) * TILE + tl.arange(0, TILE)
    mask = offsets < ROW
    row = tl.load(rows_ptr + i).to(tl.int64)  # int64: pool offsets pass 2**31
    values = tl.load(units_ptr + row * ROW + offsets, mask=mask)
    tl.store(out_ptr + i.to(tl.int64) * ROW + offsets, values, mask=mask)


GATHER_TILE = 2048  # elements per program: contiguous runs, so UVA reads of the host pool coalesce


def _gather_constexprs(row: int) -> dict[str, int]:
    """What the kernel is specialized on: gather_units_triton launches with these, compile_cases compiles them."""
    return {"ROW": row, "TILE": min(GATHER_TILE, triton.next_power_of_2(row))}


def gather_units_triton(units: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, source: MappedHost | None = None) -> None:
    """The same as gather_units_ref: one program per TILE elements of a unit; on CUDA from `source`
    (the mapped host pool, `units` its CPU view) when given."""
    _check_gather(units, rows, out)
    row = units[0].numel()
    if rows.numel():
        constexprs = _gather_constexprs(row)
        _gather_units_kernel[(rows.numel(), triton.cdiv(row, constexprs["TILE"]))](source or units, rows, out, **constexprs)


def gather_units(units: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, source: MappedHost | None = None) -> None:
    """The kernel when `out` is on CUDA; the reference elsewhere."""
    if out.is_cuda:
        gather_units_triton(units, rows, out, source)
    else:
        gather_units_ref(units, rows, out)


def compile_cases(geometry: AttentionGeometry, dtype: torch.dtype) -> list[CompileCase]:
    """The compile gate's cases (kernels/compile_cases.py): the recall of whole units and of one head
    of each, the scatter into units and the gather of units, over `dtype`, with int64 indices (as the
    recall paths and the host pool pass them)."""
    cases = []
    data = dict.fromkeys(("units_ptr", "k_ptr", "v_ptr"), pointer(dtype))
    indices = dict.fromkeys(("index_ptr", "heads_ptr", "dst_ptr"), "*i64")
    for name, per_head, to_units in (("recall", False, False), ("recall_head", True, False), ("scatter_units", False, True)):
        constexprs = _unit_copy_constexprs(geometry.kv_heads, geometry.block_size, geometry.head_dim, per_head, to_units)
        signature = {**data, **indices, **dict.fromkeys(constexprs, "constexpr")}
        cases.append(CompileCase(name, _unit_copy_kernel, signature, constexprs))
    constexprs = _gather_constexprs(2 * geometry.kv_heads * geometry.block_size * geometry.head_dim)
    signature = {"units_ptr": pointer(dtype), "rows_ptr": "*i64", "out_ptr": pointer(dtype), **dict.fromkeys(constexprs, "constexpr")}
    cases.append(CompileCase("gather_units", _gather_units_kernel, signature, constexprs))
    return cases
