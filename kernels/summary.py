"""Per-block key summaries (Quest): the element-wise min and max of each block's keys, per kv head.
They stay on the device when a block moves to the host pool, so selection never reads host keys."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pulseinfer.kernels.compile_cases import AttentionGeometry, CompileCase, pointer


def _check(k_blocks: torch.Tensor) -> None:
    if k_blocks.dim() != 4 or not k_blocks.is_floating_point():
        raise ValueError(f"key blocks must be float [n, block_size, kv_heads, dim], got {k_blocks.dtype} {tuple(k_blocks.shape)}")


def block_minmax_ref(k_blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k_blocks [n, block_size, kv_heads, dim] -> kmin, kmax [n, kv_heads, dim] in fp32."""
    _check(k_blocks)
    return k_blocks.amin(dim=1).float(), k_blocks.amax(dim=1).float()


@triton.jit
def _minmax_kernel(k_ptr, kmin_ptr, kmax_ptr, B: tl.constexpr, BP: tl.constexpr, H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr):
    block, head = tl.program_id(0).to(tl.int64), tl.program_id(1)  # int64: offsets of large caches pass 2**31
    t = tl.arange(0, BP)[:, None]
    d = tl.arange(0, DP)
    mask = (t < B) & (d[None, :] < D)
    k = tl.load(k_ptr + ((block * B + t) * H + head) * D + d[None, :], mask=mask).to(tl.float32)  # [BP, DP], one read
    out = (block * H + head) * D + d
    tl.store(kmin_ptr + out, tl.min(tl.where(mask, k, float("inf")), axis=0), mask=d < D)
    tl.store(kmax_ptr + out, tl.max(tl.where(mask, k, float("-inf")), axis=0), mask=d < D)


def _minmax_constexprs(block_size: int, kv_heads: int, dim: int) -> dict[str, int]:
    """What the kernel is specialized on: block_minmax_triton launches with these, compile_cases compiles them."""
    return {"B": block_size, "BP": triton.next_power_of_2(block_size), "H": kv_heads, "D": dim, "DP": triton.next_power_of_2(dim)}


def block_minmax_triton(k_blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as block_minmax_ref: one program per (block, kv head) reducing a [block_size, dim] tile."""
    _check(k_blocks)
    k = k_blocks.contiguous()
    n, B, H, D = k.shape
    kmin = torch.empty((n, H, D), dtype=torch.float32, device=k.device)
    kmax = torch.empty_like(kmin)
    if n:
        _minmax_kernel[(n, H)](k, kmin, kmax, **_minmax_constexprs(B, H, D))
    return kmin, kmax


def compile_cases(geometry: AttentionGeometry, dtype: torch.dtype) -> list[CompileCase]:
    """The compile gate's cases (kernels/compile_cases.py): the summaries of a cache of `dtype` keys."""
    constexprs = _minmax_constexprs(geometry.block_size, geometry.kv_heads, geometry.head_dim)
    signature = {"k_ptr": pointer(dtype), "kmin_ptr": "*fp32", "kmax_ptr": "*fp32", **dict.fromkeys(constexprs, "constexpr")}
    return [CompileCase("block_minmax", _minmax_kernel, signature, constexprs)]


def block_minmax(k_blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on CUDA; the reference elsewhere (on the CPU torch's reductions beat the interpreter by far)."""
    return block_minmax_triton(k_blocks) if k_blocks.is_cuda else block_minmax_ref(k_blocks)
