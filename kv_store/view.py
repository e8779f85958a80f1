"""A worker's mapping of the host KV pool, as a tensor.

`[host_block][layer][K|V][kv_head][token][dim]`: one (block, layer) unit, all heads, K and V,
is one contiguous range; within it each head's K (and V) tokens are one contiguous run, which
is what a head-wise recall moves. KV bytes go through this mapping only, never a socket.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pulseinfer.common.memory import check_fits
from pulseinfer.common.syncs import to_device
from pulseinfer.kernels.gather_scatter import MappedHost, gather_units, scatter_units
from pulseinfer.kv_store.layout import dtype_name, unit_bytes
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
        self._unpin: weakref.finalize | None = None  # unregisters what pin() registered: at close(), or when collected

    @classmethod
    def attach(cls, layout: kv_store_pb2.PoolLayout, kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype) -> PoolView:
        """Maps the kv_store's segment named in `layout` (pre-faulted: no minor faults on the first recalls)."""
        element = dtype.itemsize
        unit = unit_bytes(kv_heads, block_size, head_dim, element)
        if layout.dtype != dtype_name(dtype):  # fp16 and bf16 units are the same size: only the name tells them apart
            raise PoolMismatch(
                f"kv_store pool units are {layout.dtype or 'of an unnamed dtype'}, this worker's KV is {dtype_name(dtype)}: "
                "start kv_store with this worker's --kv-dtype"
            )
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
        device cache's slot-major layout. On CPU one transposing scatter per K and V; from a CUDA
        device one scatter kernel into the pinned, mapped pool, queued on the current stream (so
        later reads on it are ordered; a reader elsewhere waits for an event recorded after it)."""
        rows = self.unit_rows(blocks, layer)
        if k.device.type == "cpu":
            scatter_units(self.units, rows, k, v)
        else:
            scatter_units(self.units, *to_device([rows], k.device), k, v, self.mapped())

    def read(self, blocks: torch.Tensor, layer: int, device: torch.device | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """[n, 2, kv_heads, block_size, head_dim] for host blocks `blocks` of one layer, on `device`
        (default: the CPU), into `out` when given (a reused buffer: a fresh one costs page faults).
        On CPU one gather; to a CUDA device one gather kernel reading the pinned, mapped pool,
        queued on the current stream after the write-backs before it."""
        rows = self.unit_rows(blocks, layer)
        device = out.device if out is not None else device or torch.device("cpu")
        if out is None:
            out = torch.empty((len(blocks), *self._unit_shape), dtype=self._units.dtype, device=device)
        if device.type == "cpu":
            gather_units(self.units, rows, out)
        else:
            gather_units(self.units, *to_device([rows], device), out, self.mapped())
        return out

    def pin(self, host: HostRegistrar | None = None) -> None:
        """Registers the mapping with CUDA (page-locked, mapped): DMAs to and from it need no bounce
        buffer, and kernels read and write it in place through UVA (`mapped`)."""
        if self._unpin is not None:
            raise ValueError("this view of the host KV pool is pinned already")
        host = host or CUDA_HOST
        pinned = register_host_range(self._units.data_ptr(), self._units.numel() * self._units.element_size(), host)
        # a view dropped unclosed (an error path, a reference cycle) must not leave a stale registration
        # behind: the next mapping at its address could not be pinned
        self._unpin = weakref.finalize(self, unregister_host_ranges, pinned, host)

    def mapped(self) -> MappedHost:
        """The pool as the kernels take it on CUDA: its host address, which the launcher maps to the device's."""
        if self._unpin is None:
            raise ValueError("CUDA reaches the host KV pool only once it is pinned: PoolView.pin() first")
        return MappedHost(self._units.data_ptr(), self._units.dtype)

    @property
    def closed(self) -> bool:
        return self._map.closed

    def close(self) -> None:
        """Unregisters what pin() registered, then unmaps. Every view that pinned must be closed: a
        registration outlives the mapping, and the next mapping at its address could not be pinned."""
        if self.closed:
            return
        if self._unpin is not None:
            self._unpin()  # runs once: a later collection does nothing
        del self.blocks, self._units
        self._map.close()


CUDA_REGISTER_CHUNK = 64 << 30  # one cudaHostRegister call over more than this fails on some drivers
CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
CUDA_HOST_REGISTER_PORTABLE, CUDA_HOST_REGISTER_MAPPED = 1, 2


@dataclass(frozen=True)
class HostRegistrar:
    """How host memory is registered with CUDA and let go: cudaHostRegister and cudaHostUnregister
    (tests pass fakes). Both return a CUDA error code, 0 for success."""

    register: Callable[[int, int], int]  # (address, size) -> error
    unregister: Callable[[int], int]  # (address) -> error


def register_host_range(address: int, size: int, host: HostRegistrar) -> list[tuple[int, int]]:
    """cudaHostRegister over [address, address+size) in chunks of at most 64 GiB; returns the chunks,
    which unregister_host_ranges lets go. A failed chunk lets go of those before it and raises: a
    range that is already registered (error 712) is never accepted, since the caller has just mapped
    it: that registration is stale, left over from an earlier mapping at the same address that was
    unmapped without being unregistered, and holds that mapping's freed pages, not these."""
    registered: list[tuple[int, int]] = []
    for offset in range(0, size, CUDA_REGISTER_CHUNK):
        length = min(CUDA_REGISTER_CHUNK, size - offset)
        code = host.register(address + offset, length)
        if code != 0:
            unregister_host_ranges(registered, host)
            raise RuntimeError(_register_error(address + offset, length, code))
        registered.append((address + offset, length))
    return registered


def _register_error(address: int, length: int, code: int) -> str:
    what = f"cudaHostRegister of {length} bytes of the host KV pool at {address:#x} failed with CUDA error {code}"
    if code == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED:
        return (
            f"{what} (already registered): a stale registration of an earlier mapping at this address, unmapped without "
            "being unregistered (a PoolView or Engine not closed); its pages are not this pool's"
        )
    return f"{what} (is the memlock limit unlimited?)"


def unregister_host_ranges(ranges: list[tuple[int, int]], host: HostRegistrar) -> None:
    failed = [(address, code) for address, _ in ranges if (code := host.unregister(address)) != 0]
    if failed:
        raise RuntimeError(f"cudaHostUnregister of the host KV pool failed (address, CUDA error): {failed}")


def cuda_host_register(address: int, size: int) -> int:
    """Page-locked and mapped: DMAs need no bounce buffer, and kernels read it through UVA."""
    return _cleared(torch.cuda.cudart().cudaHostRegister(address, size, CUDA_HOST_REGISTER_PORTABLE | CUDA_HOST_REGISTER_MAPPED))


def cuda_host_unregister(address: int) -> int:
    return _cleared(torch.cuda.cudart().cudaHostUnregister(address))


def _cleared(error: object) -> int:
    """A CUDA runtime call's error code, after clearing it from the thread's last error: left there,
    torch's check after its next kernel launch (cudaGetLastError) would raise it as that kernel's."""
    code = int(error)
    if code != 0:
        _cuda_runtime().cudaGetLastError()
    return code


@functools.cache
def _cuda_runtime() -> ctypes.CDLL:
    """The CUDA runtime torch loaded: dlopen by its soname returns that library, whose last error is torch's
    (torch's own bindings, torch.cuda.cudart(), have no cudaGetLastError)."""
    return ctypes.CDLL(f"libcudart.so.{torch.version.cuda.split('.')[0]}")


CUDA_HOST = HostRegistrar(cuda_host_register, cuda_host_unregister)
