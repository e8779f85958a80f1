"""The worker's device KV pool: physical storage for the blocks the scheduler assigns."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pulseinfer.common.memory import check_fits
from pulseinfer.common.model.config import ModelConfig
from pulseinfer.kv_store.client import recall_target
from pulseinfer.kv_store.cuda_ipc import ExportedCache
from pulseinfer.kv_store.layout import CacheShape, SegmentHeader, dtype_name
from pulseinfer.kv_store.segments import Segment, cache_name
from pulseinfer.proto.pulseinfer.v1 import kv_store_pb2 as pb

if TYPE_CHECKING:
    from pulseinfer.kv_store.view import PoolView


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

    `shared`: the kv_store's I/O engine recalls blocks straight into this cache. A CPU cache then
    lives in a shared-memory segment whose header carries the engine's completions; a CUDA cache
    keeps K and V in one device allocation, exported with CUDA IPC with its two events."""

    def __init__(self, config: ModelConfig, spec: KVCacheSpec, dtype: torch.dtype, device: torch.device, shared: bool = False):
        self.spec = spec
        self.shape = CacheShape(config.kv_layers, spec.num_tokens, config.num_kv_heads, config.head_dim, spec.block_size)
        what = f"the device KV pool of {spec.num_tokens} tokens (--device-kv-tokens)"
        check_fits(self.shape.segment_bytes(dtype), device, what, shared=shared)
        self.segment: Segment | None = None
        self.completion: SegmentHeader | ExportedCache | None = None  # how a recall by the engine is known to have landed
        if shared and device.type == "cpu":
            self.segment = Segment(cache_name(os.getpid()), self.shape.segment_bytes(dtype))
            header, self.k, self.v = self.shape.tensors(self.segment.map, dtype)
            self.completion = SegmentHeader(header)
            for part in (self.k, self.v):
                part.zero_()  # commits the pages, as below
            return
        # Zeros matter: attention reads the unwritten tail of a partly filled block under a mask, and
        # masked NaN garbage would still poison the weighted sum of V. On CPU the fill also commits the
        # pool's pages at start-up (0.2-1.4 s a GB): faulted in lazily, their first writes fell in decode
        # steps (the first step of 14 offloaded requests, filling their hot buffers: 1.6 s instead of 0.5 s).
        kv = torch.zeros(self.shape.kv_dims, dtype=dtype, device=device)
        self.k, self.v = kv[0], kv[1]
        if shared:
            self.completion = ExportedCache(kv)

    def recall_target(self, worker_id: int) -> pb.OpenRecallTarget:
        """What the kv_store needs to open this (shared) cache as worker `worker_id`'s recall target."""
        if isinstance(self.completion, ExportedCache):
            return recall_target(self.shape, worker_id, dtype_name(self.k.dtype), cuda=self.completion.message())
        if self.segment is None:
            raise ValueError("this KV cache is not shared with the kv_store")
        return recall_target(self.shape, worker_id, dtype_name(self.k.dtype))

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer], self.v[layer]

    def to_host(self, view: PoolView, devices: list[int], hosts: list[int]) -> None:
        """Writes device blocks `devices`, every layer, to host blocks `hosts` of the pool (one scatter per layer)."""
        B = self.spec.block_size
        devs = torch.tensor(devices, dtype=torch.long, device=self.k.device)
        ids = torch.tensor(hosts, dtype=torch.long)
        for layer in range(self.shape.num_layers):
            k, v = (cached.view(-1, B, *cached.shape[1:])[devs] for cached in self.layer(layer))
            view.write(ids, layer, k, v)

    def from_host(self, view: PoolView, hosts: list[int], devices: list[int]) -> None:
        """Reads host blocks `hosts`, every layer, into device blocks `devices` (one gather per layer)."""
        B = self.spec.block_size
        devs = torch.tensor(devices, dtype=torch.long, device=self.k.device)
        ids = torch.tensor(hosts, dtype=torch.long)
        for layer in range(self.shape.num_layers):
            units = view.read(ids, layer, self.k.device)  # [blocks, K|V, kv_heads, block_size, dim]
            for i, cached in enumerate(self.layer(layer)):
                cached.view(-1, B, *cached.shape[1:])[devs] = units[:, i].transpose(1, 2)

    def close(self) -> None:
        """Removes the shared segment's name (the memory goes with the last mapping)."""
        if self.segment is not None:
            self.segment.close()
