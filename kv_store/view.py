"""A worker's mapping of the host KV pool, as a tensor.

`[host_block][layer][K|V][kv_head][token][dim]`: one (block, layer) unit, all heads, K and V,
is one contiguous range; within it each head's K (and V) tokens are one contiguous run, which
is what a head-wise recall moves. KV bytes go through this mapping only, never a socket.
"""

from __future__ import annotations

import mmap
import os

import torch

from kv_store.pool import SHM_DIR, prefault
from proto.pulseinfer.v1 import kv_store_pb2


class PoolMismatch(ValueError):
    pass


class PoolView:
    def __init__(
        self, buffer: mmap.mmap, num_blocks: int, num_layers: int, kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype
    ):
        flat = torch.frombuffer(buffer, dtype=dtype)
        self._map = buffer
        self.num_layers = num_layers
        self.blocks = flat.view(num_blocks, num_layers, 2, kv_heads, block_size, head_dim)
        # one row per (block, layer) unit: gathers and scatters on a contiguous 2-d tensor take torch's fast row-copy path
        self._units = flat.view(num_blocks * num_layers, -1)
        self._unit_shape = (2, kv_heads, block_size, head_dim)

    @classmethod
    def attach(cls, layout: kv_store_pb2.PoolLayout, kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype) -> PoolView:
        """Maps the kv_store's segment named in `layout` (pre-faulted: no minor faults on the first recalls)."""
        element = torch.empty((), dtype=dtype).element_size()
        unit = 2 * kv_heads * block_size * head_dim * element
        if unit != layout.unit_bytes:
            raise PoolMismatch(
                f"kv_store pool units are {layout.unit_bytes} bytes, this worker's are {unit} "
                f"({kv_heads} kv heads x {block_size} tokens x {head_dim} dims x {element} B x K,V): "
                "start kv_store with this worker's model, --block-size and --kv-dtype"
            )
        fd = os.open(SHM_DIR / layout.shm_name, os.O_RDWR)
        try:
            buffer = mmap.mmap(fd, layout.num_blocks * layout.num_layers * unit)
            prefault(buffer)
        finally:
            os.close(fd)
        return cls(buffer, layout.num_blocks, layout.num_layers, kv_heads, block_size, head_dim, dtype)

    @classmethod
    def private(cls, num_blocks: int, num_layers: int, kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype) -> PoolView:
        """A pool of this process alone (the in-process engine): anonymous memory, zero and faulted in lazily."""
        element = torch.empty((), dtype=dtype).element_size()
        buffer = mmap.mmap(-1, num_blocks * num_layers * 2 * kv_heads * block_size * head_dim * element)
        return cls(buffer, num_blocks, num_layers, kv_heads, block_size, head_dim, dtype)

    def write(self, blocks: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Writes back full blocks of one layer in one scatter.
        k, v: [n, block_size, kv_heads, head_dim], the device cache's slot-major layout."""
        units = torch.stack((k.transpose(1, 2), v.transpose(1, 2)), dim=1)  # into the pool's unit layout
        self._units.index_copy_(0, blocks * self.num_layers + layer, units.view(len(blocks), -1))

    def read(self, blocks: torch.Tensor, layer: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """[n, 2, kv_heads, block_size, head_dim] for host blocks `blocks` of one layer, one gather
        (into `out`, a reused buffer, when given: a fresh one costs page faults)."""
        rows = None if out is None else out.view(len(blocks), -1)
        rows = torch.index_select(self._units, 0, blocks * self.num_layers + layer, out=rows)
        return rows.view(len(blocks), *self._unit_shape)

    def close(self) -> None:
        del self.blocks, self._units
        self._map.close()
