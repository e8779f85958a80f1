"""Paged decode attention in Triton, split over the context (flash-decoding): one query token per
request over a per-kv-head (or shared) list of KV blocks, in two kernels.

- `_split_kernel`, one program per (request, kv head, query-head tile, split): the split's share of
  the request's context, read BLOCK_N tokens at a time through the block table (any block size;
  a sliding-window ring is a table of `window / block_size` blocks), online softmax in fp32; it
  writes its normalized partial output and its log-sum-exp.
- `_combine_kernel`, one program per (request, query head): the splits' partials weighted by
  their share of the softmax mass. With one split the first kernel writes the output itself.

The query heads of a GQA group are the rows of tl.dot (padded to its least 16; a group of more
than 16 takes several tiles), so K and V are read once per group. Its reference is
kernels.attention.paged_decode_attention (the path the CPU runs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pulseinfer.kernels.attention import GatherWorkspace
from pulseinfer.kernels.compile_cases import AttentionGeometry, CompileCase, pointer

BLOCK_H = 16  # query rows of a program: tl.dot's least M
MAX_SPLITS = 64
MIN_SPLIT = 128  # tokens: a shorter split costs more in partials written and combined than it spreads
WAVES = 4  # programs per SM the splits aim for, so that the last wave's tail is short


@dataclass(frozen=True)
class DecodeTiles:
    """How the split kernel is launched at a head dim: tokens per iteration, warps, stages."""

    block_n: int
    num_warps: int
    num_stages: int


def decode_tiles(head_dim: int) -> DecodeTiles:
    """K^T [D, N] and V [N, D] are upcast to fp32 in registers, and every warp holds the whole
    [16, D] query as tl.dot's A operand: tiles of 2048 values (16 tokens at least, tl.dot's least
    N) take at most 184 registers with 4 warps at D = 32 .. 256 in any dtype on sm_80 and sm_90,
    no spills (32 tokens at D = 128 take up to 255 and spill in fp32), so 2 to 3 programs per SM
    have their reads in flight. No stages: the loads are indirect, Triton does not pipeline them."""
    dim = triton.next_power_of_2(head_dim)
    if dim > 256:
        raise ValueError(f"decode attention: head_dim {head_dim} > 256 has no tiles (its registers would spill)")
    return DecodeTiles(block_n=max(16, 2048 // dim), num_warps=4, num_stages=1)


def num_splits(programs: int, max_ctx: int, sm_count: int) -> int:
    """Splits of each request's context: enough for `programs` (requests x kv heads x head tiles) to
    cover the SMs WAVES times, none shorter than MIN_SPLIT tokens at the longest context, at most
    MAX_SPLITS. Host integers only: nothing is read back from the device."""
    return max(1, min(MAX_SPLITS, triton.cdiv(WAVES * sm_count, programs), max_ctx // MIN_SPLIT))


# table strides and widths vary with the batch: unspecialized, one compile serves them all
@triton.jit(do_not_specialize=["table_row_stride", "table_head_stride", "max_blocks"])
def _split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    lens_ptr,
    part_ptr,  # [batch, q_heads, splits, D]: the output itself when there is one split
    lse_ptr,  # [batch, q_heads, splits], log2 units
    table_row_stride,
    table_head_stride,  # 0: one table shared by the kv heads
    max_blocks,
    scale_log2,
    H: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    B: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    tiles: tl.constexpr = (G + BLOCK_H - 1) // BLOCK_H
    head, tile = tl.program_id(1) // tiles, tl.program_id(1) % tiles
    split, splits = tl.program_id(2), tl.num_programs(2)
    g = tile * BLOCK_H + tl.arange(0, BLOCK_H)  # query heads of the group: lanes past it compute on zeros, unstored
    d = tl.arange(0, DP)  # lanes past the head dim are masked
    q_rows = row * (H * G) + head * G + g
    q_mask = (g < G)[:, None] & (d < D)[None, :]
    # fp32 operands for tl.dot: the interpreter's bf16 tl.dot is wrong, and on the GPU tf32 holds
    # bf16 and fp16 values exactly at a cost decode (bound by reading K/V) does not notice
    q = tl.load(q_ptr + q_rows[:, None] * D + d[None, :], mask=q_mask, other=0.0).to(tl.float32)  # [BLOCK_H, DP]
    length = tl.minimum(tl.load(lens_ptr + row), max_blocks * B)  # like the reference: a table holds at most max_blocks
    per_split = tl.cdiv(tl.cdiv(length, splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, length)
    table = tables_ptr + row * table_row_stride + head * table_head_stride
    best = tl.full([BLOCK_H], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, DP], tl.float32)
    for n in range(start, end, BLOCK_N):  # every iteration holds at least one valid token: no exp(-inf - -inf)
        pos = n + tl.arange(0, BLOCK_N)
        valid = pos < end
        block = tl.load(table + pos // B, mask=valid, other=0).to(tl.int64)
        kv = ((block * B + pos % B) * H + head) * D  # [BLOCK_N] row offsets of the tokens' K/V
        # V is loaded with K, before the first dot's barriers: both tiles' reads are in flight at once
        k = tl.load(k_ptr + kv[None, :] + d[:, None], mask=valid[None, :] & (d < D)[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + kv[:, None] + d[None, :], mask=valid[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)
        scores = tl.dot(q, k, input_precision=PRECISION) * scale_log2  # [BLOCK_H, BLOCK_N], log2 units
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        p = tl.exp2(scores - new_best[:, None])
        rescale = tl.exp2(best - new_best)
        acc = acc * rescale[:, None] + tl.dot(p, v, input_precision=PRECISION)
        total = total * rescale + tl.sum(p, axis=1)
        best = new_best
    out_rows = q_rows * splits + split
    norm = tl.where(total > 0, total, 1.0)  # an empty split (or context) gives 0 and weighs nothing
    tl.store(part_ptr + out_rows[:, None] * D + d[None, :], (acc / norm[:, None]).to(part_ptr.dtype.element_ty), mask=q_mask)
    tl.store(lse_ptr + out_rows, tl.where(total > 0, best + tl.log2(norm), float("-inf")), mask=g < G)


@triton.jit(do_not_specialize=["splits"])
def _combine_kernel(part_ptr, lse_ptr, out_ptr, splits, D: tl.constexpr, DP: tl.constexpr, SP: tl.constexpr):
    q_row = tl.program_id(0).to(tl.int64)  # request * q_heads + query head
    s = tl.arange(0, SP)
    lse = tl.load(lse_ptr + q_row * splits + s, mask=s < splits, other=float("-inf"))
    best = tl.max(lse, axis=0)
    best = tl.where(best > float("-inf"), best, 0.0)  # every split empty: every weight is 0
    total = tl.sum(tl.exp2(lse - best), axis=0)
    d = tl.arange(0, DP)
    acc = tl.zeros([DP], tl.float32)
    for i in range(splits):
        weight = tl.exp2(tl.load(lse_ptr + q_row * splits + i) - best)
        acc += weight * tl.load(part_ptr + (q_row * splits + i) * D + d, mask=d < D, other=0.0)
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + q_row * D + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


def _split_constexprs(kv_heads: int, group: int, dim: int, block_size: int, dtype: torch.dtype) -> tuple[dict, DecodeTiles]:
    """What the split kernel is specialized on, and its launch: the wrapper and compile_cases both use it."""
    tiles = decode_tiles(dim)
    constexprs = {
        "H": kv_heads,
        "G": group,
        "D": dim,
        "DP": triton.next_power_of_2(dim),
        "B": block_size,
        "BLOCK_H": BLOCK_H,
        "BLOCK_N": tiles.block_n,
        "PRECISION": "ieee" if dtype == torch.float32 else "tf32",  # tf32 would round fp32 inputs
    }
    return constexprs, tiles


def _combine_constexprs(dim: int) -> dict:
    return {"D": dim, "DP": triton.next_power_of_2(dim), "SP": triton.next_power_of_2(MAX_SPLITS)}


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor) -> None:
    if (
        q.dim() != 3
        or k_cache.dim() != 3
        or k_cache.shape != v_cache.shape
        or k_cache.shape[2] != q.shape[2]
        or q.shape[1] % k_cache.shape[1]
        or q.dtype != k_cache.dtype
        or k_cache.dtype != v_cache.dtype
    ):
        raise ValueError(
            f"decode attention: q {tuple(q.shape)} {q.dtype} does not fit caches {tuple(k_cache.shape)} {k_cache.dtype} / "
            f"{tuple(v_cache.shape)} {v_cache.dtype}"
        )
    shared = tables.dim() == 2 and tables.shape[0] == q.shape[0]
    per_head = tables.dim() == 3 and tables.shape[:2] == (q.shape[0], k_cache.shape[1])
    if not (shared or per_head) or lens.shape != (q.shape[0],):
        raise ValueError(f"decode attention: block_tables {tuple(tables.shape)}, ctx_lens {tuple(lens.shape)} for q {tuple(q.shape)}")
    if tables.is_floating_point() or lens.is_floating_point():
        raise ValueError(f"decode attention: block_tables ({tables.dtype}) and ctx_lens ({lens.dtype}) must be integers")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("decode attention kernel: the k/v caches must be contiguous (the kernel computes slot offsets)")
    if len({t.device for t in (q, k_cache, v_cache, tables, lens)}) > 1:
        raise ValueError(
            f"decode attention kernel: q, caches, block_tables and ctx_lens on devices {q.device}, {k_cache.device}, "
            f"{v_cache.device}, {tables.device}, {lens.device}"
        )


def paged_decode_attention_triton(
    q: torch.Tensor,  # [batch, q_heads, dim]
    k_cache: torch.Tensor,  # [slots, kv_heads, dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [batch, max_blocks], or [batch, kv_heads, max_blocks] when each kv head has its own
    ctx_lens: torch.Tensor,  # [batch]
    block_size: int,
    workspace: GatherWorkspace,
    splits: int | None = None,
) -> torch.Tensor:
    """Attention of each request's one query over its first ctx_lens positions (at most max_blocks
    blocks, as in the reference), in q's dtype. `splits` of each context (None: from the table
    width, which bounds every context, and the device's SM count: no device value is read)."""
    _check(q, k_cache, v_cache, block_tables, ctx_lens)
    (batch, q_heads, dim), heads = q.shape, k_cache.shape[1]
    group = q_heads // heads
    tables = block_tables if block_tables.dim() == 3 else block_tables[:, None, :].expand(-1, heads, -1)  # head stride 0
    if tables.stride(2) != 1:
        tables = tables.contiguous()
    q = q.contiguous()
    out = torch.empty_like(q)
    if batch == 0:
        return out
    constexprs, tiles = _split_constexprs(heads, group, dim, block_size, q.dtype)
    head_programs = heads * triton.cdiv(group, BLOCK_H)
    if splits is None:
        sm_count = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1  # the interpreter: 1
        splits = num_splits(batch * head_programs, tables.shape[2] * block_size, sm_count)
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"decode attention: {splits} splits, not in [1, {MAX_SPLITS}]")
    partials = batch * q_heads * splits
    scratch = workspace.partials(partials * (dim + 1), q.device)  # the partial outputs first: both stay 16-byte aligned
    part = out if splits == 1 else scratch[: partials * dim]
    lse = scratch[partials * dim :]
    _split_kernel[(batch, head_programs, splits)](
        q, k_cache, v_cache, tables, ctx_lens, part, lse, tables.stride(0), tables.stride(1), tables.shape[2],
        math.log2(math.e) / math.sqrt(dim), **constexprs, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    if splits > 1:
        _combine_kernel[(batch * q_heads,)](part, lse, out, splits, **_combine_constexprs(dim))
    return out


def compile_cases(geometry: AttentionGeometry, dtype: torch.dtype) -> list[CompileCase]:
    """The compile gate's cases (kernels/compile_cases.py): the split kernel writing fp32 partials
    and writing the output (one split), and the combine; a window ring is read as a table of the
    same block size, so the same cases serve the sliding layers."""
    g = geometry
    constexprs, tiles = _split_constexprs(g.kv_heads, g.group, g.head_dim, g.block_size, dtype)
    options = {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    data, ints = pointer(dtype), ("table_row_stride", "table_head_stride", "max_blocks")
    split = {"q_ptr": data, "k_ptr": data, "v_ptr": data, "tables_ptr": "*i64", "lens_ptr": "*i64", "lse_ptr": "*fp32"}
    split |= dict.fromkeys(ints, "i32") | {"scale_log2": "fp32"} | dict.fromkeys(constexprs, "constexpr")
    combine_constexprs = _combine_constexprs(g.head_dim)
    combine = {"part_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": data, "splits": "i32", **dict.fromkeys(combine_constexprs, "constexpr")}
    cases = [
        CompileCase("decode_split", _split_kernel, split | {"part_ptr": "*fp32"}, constexprs, options),
        CompileCase("decode_combine", _combine_kernel, combine, combine_constexprs),
    ]
    if dtype != torch.float32:  # else the same specialization as decode_split
        cases.append(CompileCase("decode_single", _split_kernel, split | {"part_ptr": data}, constexprs, options))
    return cases
