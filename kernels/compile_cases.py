"""What the compile gate (bench/kernels_compile.py) compiles of each Triton kernel.

Every kernel module of kernels/ that has a `@triton.jit` function exposes

    def compile_cases(geometry: AttentionGeometry, dtype: torch.dtype) -> list[CompileCase]

with one case per kernel specialization its wrappers launch at that geometry and dtype. A case's
constexprs and launch options come from the same function the wrapper launches with, so what
the gate compiles is what a GPU runs. The gate hands each case to
`triton.compile(ASTSource(case.fn, case.signature, case.constexprs), target=GPUTarget("cuda", arch, 32))`,
which needs no GPU: ptxas runs on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

POINTER_TYPES = {
    torch.float32: "*fp32",
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.int64: "*i64",
    torch.int32: "*i32",
}


def pointer(dtype: torch.dtype) -> str:
    """Triton's signature type of a pointer to `dtype` elements."""
    return POINTER_TYPES[dtype]


@dataclass(frozen=True)
class AttentionGeometry:
    """The attention shape of a model, as the kernels see it."""

    name: str  # the shipped config it comes from, e.g. "qwen3-8b"
    q_heads: int
    kv_heads: int
    head_dim: int
    block_size: int = 16
    window: int = 0  # its sliding layers' window; 0: it has none

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads


@dataclass(frozen=True)
class CompileCase:
    """One specialization of one kernel: its arguments' types and its constexprs."""

    kernel: str  # e.g. "decode_split": the gate's row name
    fn: Any  # the @triton.jit function
    signature: dict[str, str]  # every argument by name: "*bf16", "i32", "i64", "fp32", or "constexpr"
    constexprs: dict[str, Any]
    options: dict[str, Any] = field(default_factory=dict)  # launch options: num_warps, num_stages
