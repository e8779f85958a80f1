"""Recalls into a CUDA worker's KV cache from the kv_store process (docs/architecture.md).

The worker exports its cache (K then V in one device allocation) and two interprocess events
with CUDA IPC (`ExportedCache`); the kv_store's I/O engine maps them (`CudaTarget`) and copies
each recall on its own stream, between a wait on `ready` (recorded by the worker when it sends
the recall: the compute that last read those blocks comes first) and a record of `landed`
(which the worker's compute stream waits on before attention reads them). Neither CPU waits
for the copy (but the staged path's host gather, for `ready`: it reads blocks the worker's kernels
wrote). A worker recalling from its own mapping of the pool orders its copy stream the same way
(`CopyStream`). Two ways to move the bytes, chosen by fragment size:
- mapped: the recall kernel reads the units straight from the page-locked, mapped host pool
  through UVA (no staging; every fragment is its own run of PCIe reads, which small head-wise
  fragments need);
- staged: one gather of whole units into a pinned staging buffer on the host, one DMA of it to
  the device, then the recall kernel scatters from device memory (large units move at DMA speed).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from pulseinfer.common.syncs import to_device
from pulseinfer.kernels.gather_scatter import MappedHost, recall, recall_triton
from pulseinfer.kv_store.layout import CacheShape
from pulseinfer.proto.pulseinfer.v1 import kv_store_pb2 as pb

STAGING_BYTES = 32 << 10  # fragments this size and up go staged; smaller ones mapped


def staged(fragment_bytes: int, heads: torch.Tensor | None, staging_min_bytes: int) -> bool:
    """Whether a recall goes staged: whole units of at least `staging_min_bytes`. A head-wise
    recall's fragments (one kv head of a unit each) are always read in place through UVA:
    staging whole units for them would move every head."""
    return heads is None and fragment_bytes >= staging_min_bytes


class StreamOrder:
    """How copies on a stream of their own are ordered with the worker's compute stream, by two
    events and no CPU wait: `issue` (when a recall is sent) records `ready` on the compute stream,
    which the copy waits on (what compute has queued, the reads of the blocks it overwrites among
    it, comes first); the copy records `landed`, and `landed` (once the copy is queued) makes the
    compute stream wait on it (attention reads the blocks after)."""

    def __init__(self, device: torch.device, interprocess: bool):
        self.stream = torch.cuda.current_stream(device)  # the compute stream: attention reads recalls on it
        self.ready_event = torch.cuda.Event(interprocess=interprocess)
        self.landed_event = torch.cuda.Event(interprocess=interprocess)

    def issue(self) -> None:
        """Before a recall is sent: the copy waits for what the compute stream has queued so far."""
        self.ready_event.record(self.stream)

    def landed(self, sequence: int = 0) -> None:
        """After the copy was queued: the compute stream waits on the GPU, not this thread."""
        self.stream.wait_event(self.landed_event)


class ExportedCache(StreamOrder):
    """The worker's side of the kv_store's recalls: its KV cache, and the events (interprocess) the
    engine's stream waits on and records."""

    def __init__(self, kv: torch.Tensor):
        super().__init__(kv.device, interprocess=True)
        self.kv = kv  # CacheShape.kv_dims: [2, num_layers, slots, kv_heads, head_dim]

    def message(self) -> pb.CudaCache:
        device, handle, size, offset, counter, counter_offset, event, sync = self.kv.untyped_storage()._share_cuda_()
        return pb.CudaCache(
            device=device,
            memory_handle=handle,
            storage_bytes=size,
            storage_offset=offset,
            ref_counter_handle=counter,
            ref_counter_offset=counter_offset,
            sync_event=event or b"",
            sync_required=sync,
            ready_event=self.ready_event.ipc_handle(),
            landed_event=self.landed_event.ipc_handle(),
        )

    def last(self) -> int:
        return 0  # the events carry no sequence: the engine's answer does


class CopyStream(StreamOrder):
    """A worker's own recalls (the in-process pool) on a stream of their own, so they overlap
    compute, ordered with it as the kv_store engine's are."""

    def __init__(self, device: torch.device):
        super().__init__(device, interprocess=False)
        self.copy_stream = torch.cuda.Stream(device)
        self._lock = threading.Lock()  # the I/O thread's recalls and the compute thread's in-line ones share the events

    @contextmanager
    def copying(self) -> Iterator[None]:
        """The body's copies run on the copy stream, after `ready`, before `landed`."""
        with self._lock:
            self.issue()
            self.copy_stream.wait_event(self.ready_event)
            with torch.cuda.stream(self.copy_stream):
                yield
            self.landed_event.record(self.copy_stream)
            self.landed()


class Staging:
    """Whole units gathered on the host into one pinned buffer, then one copy to a device buffer.
    On the CPU (tests) the same two copies run without pinning or events."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        self.host = torch.empty(0, dtype=dtype)
        self.on_device = torch.empty(0, dtype=dtype, device=device)
        self.copied = torch.cuda.Event() if device.type == "cuda" else None  # the last DMA out of `host`

    def stage(self, units: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """units[rows] on the device, queued on the current stream: [n, *units.shape[1:]]."""
        n, row = rows.numel(), units[0].numel()
        if self.copied is not None:
            self.copied.synchronize()  # the pinned buffer is free once its last DMA has read it
        if self.host.numel() < n * row:
            size = max(n * row, 2 * self.host.numel())
            self.host = torch.empty(size, dtype=self.dtype, pin_memory=self.device.type == "cuda")
            self.on_device = torch.empty(size, dtype=self.dtype, device=self.device)
        host, out = self.host[: n * row].view(n, row), self.on_device[: n * row].view(n, row)
        torch.index_select(units.view(units.shape[0], row), 0, rows, out=host)
        out.copy_(host, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        return out.view(n, *units.shape[1:])


class CudaTarget:
    """The engine's side: a CUDA worker's cache, mapped, and the engine's own stream for it."""

    def __init__(self, request: pb.OpenRecallTarget, shape: CacheShape, dtype: torch.dtype, staging_min_bytes: int):
        message = request.cuda
        self.shape = shape
        self.device = torch.device("cuda", message.device)
        needed = shape.kv_bytes(dtype)
        if message.storage_bytes < needed:
            raise ValueError(f"worker {request.worker_id}'s CUDA cache is {message.storage_bytes} bytes, its shape needs {needed}")
        try:
            storage = torch.UntypedStorage._new_shared_cuda(
                message.device,
                message.memory_handle,
                message.storage_bytes,
                message.storage_offset,
                message.ref_counter_handle,
                message.ref_counter_offset,
                message.sync_event or None,
                message.sync_required,
            )
            self.ready_event = torch.cuda.Event.from_ipc_handle(self.device, message.ready_event)
            self.landed_event = torch.cuda.Event.from_ipc_handle(self.device, message.landed_event)
        except RuntimeError as e:
            raise ValueError(
                f"worker {request.worker_id}'s CUDA IPC handles did not open ({e}): the worker and the kv_store must see the same "
                "GPU and share the host's IPC namespace and one PID namespace (docker-compose: ipc: host, pid: host)"
            ) from e
        kv = torch.empty(0, dtype=dtype, device=self.device).set_(storage, 0, shape.kv_dims)
        self.k, self.v = kv[0], kv[1]
        self.staging_min_bytes = staging_min_bytes
        self.stream = torch.cuda.Stream(self.device)
        self.staging = Staging(self.device, dtype)

    def copy(self, units: torch.Tensor, rows: torch.Tensor, layer: int, device_blocks: torch.Tensor, heads: torch.Tensor | None) -> None:
        """Queues the recall on the engine's stream, after the worker's `ready`, with no wait for the
        worker's GPU on this thread (it serves every worker) but the staged path's. `units` is the
        engine's CPU view of the pool, which the engine registered as mapped."""
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            k, v = self.k[layer], self.v[layer]
            if staged(units[0].numel() * units.element_size(), heads, self.staging_min_bytes):
                (dst,) = to_device([device_blocks], self.device)  # the rows are read on the host: only the blocks move
                self.stream.wait_event(self.ready_event)
                # the host gather reads blocks the worker wrote with kernels queued before `ready`: they must have run
                self.ready_event.synchronize()
                recall(self.staging.stage(units, rows), torch.arange(rows.numel(), device=self.device), k, v, dst)
            else:
                rows_on, dst, *head_index = to_device([rows, device_blocks] + ([heads] if heads is not None else []), self.device)
                self.stream.wait_event(self.ready_event)
                source = MappedHost(units.data_ptr(), units.dtype)
                recall_triton(units, rows_on, k, v, dst, head_index[0] if head_index else None, source=source)

    def complete(self, sequence: int) -> None:
        self.landed_event.record(self.stream)

    def close(self) -> None:
        self.stream.synchronize()  # no copy may still write into the worker's memory once it is unmapped
        del self.k, self.v
