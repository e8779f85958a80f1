"""The worker's device KV pool: physical storage for the blocks the scheduler assigns."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker.model.config import ModelConfig


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
    """K and V per layer as [slots, kv_heads, head_dim]; slot = block * block_size + offset."""

    def __init__(self, config: ModelConfig, spec: KVCacheSpec, dtype: torch.dtype, device: torch.device):
        self.spec = spec
        shape = (config.num_layers, spec.num_tokens, config.num_kv_heads, config.head_dim)
        # Uninitialised on purpose (no multi-GB memset at start-up): attention only ever reads
        # slots that were written (padding repeats a sequence's own first slot).
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer], self.v[layer]
