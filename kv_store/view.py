"""A worker's mapping of the host KV pool, as a tensor.

`[host_block][layer][K|V][kv_head][token][dim]`: one (block, layer) unit, all heads, K and V,
is one contiguous range; within it each head's K (and V) tokens are one contiguous run, which
is what a head-wise recall moves. KV bytes go through this mapping only, never a socket.
"""

from __future__ import annotations

import mmap
import os

import torch

from kv_store.pool import SHM_DIR
from proto.pulseinfer.v1 import kv_store_pb2


class PoolMismatch(ValueError):
    pass


class PoolView:
    def __init__(self, layout: kv_store_pb2.PoolLayout, kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype):
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
            self._map = mmap.mmap(fd, layout.num_blocks * layout.num_layers * unit)
        finally:
            os.close(fd)
        flat = torch.frombuffer(self._map, dtype=dtype)
        self.blocks = flat.view(layout.num_blocks, layout.num_layers, 2, kv_heads, block_size, head_dim)

    def write(self, block: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [block_size, kv_heads, head_dim], the device cache's slot-major layout."""
        unit = self.blocks[block, layer]
        unit[0].copy_(k.transpose(0, 1))
        unit[1].copy_(v.transpose(0, 1))

    def read(self, blocks: torch.Tensor, layer: int) -> torch.Tensor:
        """[n, 2, kv_heads, block_size, head_dim] for host blocks `blocks` of one layer, one gather."""
        return self.blocks[:, layer].index_select(0, blocks)

    def close(self) -> None:
        del self.blocks
        self._map.close()
