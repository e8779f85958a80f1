"""A worker's mapping of the host KV pool, as a tensor.

`[host_block][layer][K|V][kv_head][token][dim]`: one (block, layer) unit, all heads, K and V,
is one contiguous range; within it each head's K (and V) tokens are one contiguous run, which
is what a head-wise recall moves. KV bytes go through this mapping only, never a socket.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable

import torch

from pulseinfer.common.memory import check_fits
from pulseinfer.kv_store.layout import unit_bytes
from pulseinfer.kv_store.pool import prefault
from pulseinfer.kv_store.segments import open_segment
from pulseinfer.proto.pulseinfer.v1 import kv_store_pb2


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
        self.kv_heads = kv_heads
        self.unit_bytes = self._units.shape[1] * self._units.element_size()

    @classmethod
    def attach(cls, layout: kv_store_pb2.PoolLayout, kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype) -> PoolView:
        """Maps the kv_store's segment named in `layout` (pre-faulted: no minor faults on the first recalls)."""
        element = dtype.itemsize
        unit = unit_bytes(kv_heads, block_size, head_dim, element)
        if unit != layout.unit_bytes:
            raise PoolMismatch(
                f"kv_store pool units are {layout.unit_bytes} bytes, this worker's are {unit} "
                f"({kv_heads} kv heads x {block_size} tokens x {head_dim} dims x {element} B x K,V): "
                "start kv_store with this worker's model, --block-size and --kv-dtype"
            )
        buffer = open_segment(layout.shm_name, layout.num_blocks * layout.num_layers * unit)  # the name is checked
        prefault(buffer)
        return cls(buffer, layout.num_blocks, layout.num_layers, kv_heads, block_size, head_dim, dtype)

    @classmethod
    def private(cls, num_blocks: int, num_layers: int, kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype) -> PoolView:
        """A pool of this process alone (the in-process engine): anonymous memory, zero and faulted in lazily."""
        unit = unit_bytes(kv_heads, block_size, head_dim, dtype.itemsize)
        what = f"the host KV pool of {num_blocks * block_size} tokens (--host-kv-tokens)"
        check_fits(num_blocks * num_layers * unit, torch.device("cpu"), what)
        buffer = mmap.mmap(-1, num_blocks * num_layers * unit)
        return cls(buffer, num_blocks, num_layers, kv_heads, block_size, head_dim, dtype)

    @property
    def units(self) -> torch.Tensor:
        """[num_blocks * num_layers, 2, kv_heads, block_size, head_dim]: one row per (block, layer) unit."""
        return self._units.view(-1, *self._unit_shape)

    def unit_rows(self, blocks: torch.Tensor, layer: int) -> torch.Tensor:
        """Rows of `units` holding layer `layer` of host blocks `blocks`."""
        return blocks.cpu() * self.num_layers + layer

    def write(self, blocks: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Writes back full blocks of one layer. k, v: [n, block_size, kv_heads, head_dim], the
        device cache's slot-major layout. On CPU one transposing scatter per K and V; from a CUDA device one async copy per
        unit into the pinned pool, queued on the current stream (so later reads on it are ordered)."""
        rows = self.unit_rows(blocks, layer)
        if k.device.type == "cpu":  # transposing straight into the pool: twice as fast as stacking units first
            self.units[rows, 0] = k.transpose(1, 2)
            self.units[rows, 1] = v.transpose(1, 2)
            return
        units = torch.stack((k.transpose(1, 2), v.transpose(1, 2)), dim=1).view(len(blocks), -1)  # the pool's unit layout
        for i, row in enumerate(rows.tolist()):
            self._units[row].copy_(units[i], non_blocking=True)

    def read(self, blocks: torch.Tensor, layer: int, device: torch.device | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """[n, 2, kv_heads, block_size, head_dim] for host blocks `blocks` of one layer, on `device`
        (default: the CPU), into `out` when given (a reused buffer: a fresh one costs page faults).
        On CPU one gather; to a CUDA device one async copy per unit, queued on the current stream
        after the write-backs before it."""
        rows = self.unit_rows(blocks, layer)
        device = out.device if out is not None else device or torch.device("cpu")
        if out is None:
            out = torch.empty((len(blocks), self._units.shape[1]), dtype=self._units.dtype, device=device)
        flat = out.view(len(blocks), -1)
        if device.type == "cpu":
            torch.index_select(self._units, 0, rows, out=flat)
        else:
            for i, row in enumerate(rows.tolist()):
                flat[i].copy_(self._units[row], non_blocking=True)
        return flat.view(len(blocks), *self._unit_shape)

    def pin(self, register: Callable[[int, int], int] | None = None) -> None:
        """Registers the mapping with CUDA (page-locked, device-addressable), so copies to and from
        it are DMA without a bounce buffer and can be asynchronous."""
        address = self._units.data_ptr()
        self._pinned = register_host_range(address, self._units.numel() * self._units.element_size(), register or cuda_host_register)

    def close(self) -> None:
        unregister_host_ranges(getattr(self, "_pinned", []))
        del self.blocks, self._units
        self._map.close()


CUDA_REGISTER_CHUNK = 64 << 30  # one cudaHostRegister call over more than this fails on some drivers
CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
CUDA_HOST_REGISTER_PORTABLE, CUDA_HOST_REGISTER_MAPPED = 1, 2


def register_host_range(address: int, size: int, register: Callable[[int, int], int]) -> list[tuple[int, int]]:
    """cudaHostRegister over [address, address+size) in chunks of at most 64 GiB. A chunk this
    process already registered (another mapping of the same pool) is accepted as it is and not
    returned, so closing this view leaves it registered for its owner."""
    registered = []
    for offset in range(0, size, CUDA_REGISTER_CHUNK):
        length = min(CUDA_REGISTER_CHUNK, size - offset)
        code = register(address + offset, length)
        if code == 0:
            registered.append((address + offset, length))
        elif code != CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED:
            raise RuntimeError(f"cudaHostRegister of {length} bytes of the host KV pool failed with CUDA error {code}")
    return registered


def cuda_host_register(address: int, size: int) -> int:
    """Page-locked and mapped: DMAs need no bounce buffer, and kernels read it through UVA."""
    return int(torch.cuda.cudart().cudaHostRegister(address, size, CUDA_HOST_REGISTER_PORTABLE | CUDA_HOST_REGISTER_MAPPED))


def unregister_host_ranges(ranges: list[tuple[int, int]]) -> None:
    for address, _ in ranges:
        torch.cuda.cudart().cudaHostUnregister(address)
