"""The shared-memory layouts the kv_store and its workers agree on, and how a recall's completion
is signalled. A leaf: it imports no other module of the project, and torch only where a tensor is
made (the control API and the pool's geometry go without it).

- The host pool: `[host_block][layer][K|V][kv_head][token][dim]`, so one (block, layer) recall
  unit with all KV heads, K and V together, is one contiguous range of `unit_bytes`
  (`PoolGeometry`; kv_store/pool.py owns the segment, kv_store/view.py maps it).
- A worker's KV cache (`CacheShape`): K then V, each [num_layers, slots, kv_heads, head_dim]; in a
  CPU worker's shared segment they follow a header page whose int64 [0] is the sequence of the
  last recall the kv_store's I/O engine completed (`SegmentHeader`). A CUDA worker's cache is one
  device allocation of the same K, V shape (kv_store/cuda_ipc.py).
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

HEADER_BYTES = 4096  # int64 [0]: sequence of the last completed recall; a page, so K starts aligned
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def unit_bytes(kv_heads: int, block_size: int, head_dim: int, element_bytes: int) -> int:
    """One (block, layer) recall unit: K and V of every kv head of a block."""
    return 2 * kv_heads * block_size * head_dim * element_bytes


class ModelShape(Protocol):
    """The model dimensions the pool's geometry depends on (pulseinfer.common.model.config.ModelConfig has them)."""

    @property
    def kv_layers(self) -> int:
        """Layers whose whole context is kept (sliding-window layers keep only theirs, on the device)."""
        ...

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...


def dtype_name(dtype: torch.dtype) -> str:
    """A torch dtype by the name the pool's layout and the flags give it: torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class PoolGeometry:
    num_blocks: int
    num_layers: int
    unit_bytes: int
    dtype: str  # the units' element type, a DTYPE_BYTES name: a pool of bfloat16 is no pool of float16

    @classmethod
    def for_model(cls, config: ModelShape, block_size: int, tokens: int, dtype: str) -> PoolGeometry:
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"--kv-dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
        if tokens < block_size:
            raise ValueError(f"host KV pool of {tokens} tokens is smaller than one block ({block_size})")
        unit = unit_bytes(config.num_kv_heads, block_size, config.head_dim, DTYPE_BYTES[dtype])
        return cls(num_blocks=tokens // block_size, num_layers=config.kv_layers, unit_bytes=unit, dtype=dtype)

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.unit_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.block_bytes


@dataclass(frozen=True)
class CacheShape:
    """A worker's KV cache; its fields are those of the OpenRecallTarget that opens it as a recall target."""

    num_layers: int
    slots: int
    kv_heads: int
    head_dim: int
    block_size: int

    @property
    def dims(self) -> tuple[int, int, int, int]:
        """K's (and V's) tensor shape: [num_layers, slots, kv_heads, head_dim]."""
        return (self.num_layers, self.slots, self.kv_heads, self.head_dim)

    @property
    def kv_dims(self) -> tuple[int, int, int, int, int]:
        """K and V in one tensor: [2, num_layers, slots, kv_heads, head_dim]."""
        return (2, *self.dims)

    def kv_bytes(self, dtype: torch.dtype) -> int:
        return 2 * math.prod(self.dims) * dtype.itemsize

    def segment_bytes(self, dtype: torch.dtype) -> int:
        return HEADER_BYTES + self.kv_bytes(dtype)

    def tensors(self, buffer: mmap.mmap, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(header, k, v) over a cache segment; k and v: [num_layers, slots, kv_heads, head_dim]."""
        import torch

        header = torch.frombuffer(buffer, dtype=torch.int64, count=HEADER_BYTES // 8)
        kv = torch.frombuffer(buffer, dtype=dtype, offset=HEADER_BYTES).view(*self.kv_dims)
        return header, kv[0], kv[1]


class Completion(Protocol):
    """How a worker learns that the engine's recall into its cache has landed."""

    def last(self) -> int: ...  # the sequence of the last recall known to have landed

    def issue(self) -> None: ...  # before a recall is sent

    def landed(self, sequence: int) -> None: ...  # after the engine answered recall `sequence`


class SegmentHeader:
    """A CPU cache in shared memory: the engine writes each finished recall's sequence into its header."""

    def __init__(self, header: torch.Tensor):
        self.header = header

    def last(self) -> int:
        return int(self.header[0])

    def issue(self) -> None:
        pass

    def landed(self, sequence: int) -> None:
        if int(self.header[0]) != sequence:
            raise RuntimeError(f"kv_store I/O engine answered recall {sequence} but the cache header says {int(self.header[0])}")
