"""Per-block key summaries (Quest): the element-wise min and max of each block's keys, per kv head."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _check(k_blocks: torch.Tensor) -> None:
    if k_blocks.dim() != 4:
        raise ValueError(f"key blocks must be [n, block_size, kv_heads, dim], got {tuple(k_blocks.shape)}")


def block_minmax_ref(k_blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k_blocks [n, block_size, kv_heads, dim] -> kmin, kmax [n, kv_heads, dim] in fp32."""
    _check(k_blocks)
    return k_blocks.amin(dim=1).float(), k_blocks.amax(dim=1).float()


@triton.jit
def _minmax_kernel(k_ptr, kmin_ptr, kmax_ptr, B: tl.constexpr, BP: tl.constexpr, H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr):
    block, head = tl.program_id(0), tl.program_id(1)
    t = tl.arange(0, BP)[:, None]
    d = tl.arange(0, DP)[None, :]
    mask = (t < B) & (d < D)
    offsets = ((block * B + t) * H + head) * D + d
    low = tl.min(tl.load(k_ptr + offsets, mask=mask, other=float("inf")).to(tl.float32), axis=0)
    high = tl.max(tl.load(k_ptr + offsets, mask=mask, other=float("-inf")).to(tl.float32), axis=0)
    out = (block * H + head) * D + tl.arange(0, DP)
    tl.store(kmin_ptr + out, low, mask=tl.arange(0, DP) < D)
    tl.store(kmax_ptr + out, high, mask=tl.arange(0, DP) < D)


def block_minmax_triton(k_blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as block_minmax_ref: one program per (block, kv head)."""
    _check(k_blocks)
    k = k_blocks.contiguous()
    n, B, H, D = k.shape
    kmin = torch.empty((n, H, D), dtype=torch.float32, device=k.device)
    kmax = torch.empty_like(kmin)
    if n:
        _minmax_kernel[(n, H)](k, kmin, kmax, B=B, BP=triton.next_power_of_2(B), H=H, D=D, DP=triton.next_power_of_2(D))
    return kmin, kmax


def block_minmax(k_blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return block_minmax_triton(k_blocks) if k_blocks.is_cuda else block_minmax_ref(k_blocks)
