"""The worker's device KV pool: physical storage for the blocks the scheduler assigns."""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from gpu_worker.model.config import ModelConfig
from kv_store.engine import SHM_DIR, CacheShape, map_segment


@dataclass(frozen=True)
class KVCacheSpec:
    num_blocks: int
    block_size: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @classmethod
    def for_tokens(cls, tokens: int, block_size: int) -> KVCacheSpec:
        if tokens < block_size:
            raise ValueError(f"device KV pool of {tokens} tokens is smaller than one block ({block_size})")
        return cls(num_blocks=tokens // block_size, block_size=block_size)


class PagedKVCache:
    """K and V per layer as [slots, kv_heads, head_dim]; slot = block * block_size + offset.

    With `segment` (CPU only) the pool lives in that shared-memory segment, so the kv_store's
    I/O engine can recall blocks straight into it; `header[0]` is its completion counter."""

    def __init__(self, config: ModelConfig, spec: KVCacheSpec, dtype: torch.dtype, device: torch.device, segment: str | None = None):
        self.spec = spec
        self.shape = CacheShape(config.num_layers, spec.num_tokens, config.num_kv_heads, config.head_dim, spec.block_size)
        self.segment = segment
        if segment is None:
            self.k, self.v = _zeroed(self.shape.dims, dtype, device), _zeroed(self.shape.dims, dtype, device)
            return
        if device.type != "cpu":
            raise ValueError("a KV cache in shared memory is for CPU workers (CUDA workers export device buffers instead)")
        (SHM_DIR / segment).unlink(missing_ok=True)  # left by an earlier process of this pid (a restarted container)
        self._map = map_segment(segment, self.shape.segment_bytes(dtype), create=True)
        self.header, self.k, self.v = self.shape.tensors(self._map, dtype)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer], self.v[layer]

    def close(self) -> None:
        """Removes the shared segment's name (the memory goes with the last mapping)."""
        if self.segment is not None:
            (SHM_DIR / self.segment).unlink(missing_ok=True)


def _zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled pool. Zeros matter: attention reads the unwritten tail of a partly filled
    block under a mask, and masked NaN garbage would still poison the weighted sum of V.
    On CPU an anonymous mapping is zero by contract and faulted in lazily, which avoids a
    multi-GB memset at start-up."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    buffer = mmap.mmap(-1, math.prod(shape) * dtype.itemsize)
    return torch.frombuffer(buffer, dtype=dtype).view(shape)
