"""The gather-scatter I/O engine of the kv_store process.

A worker registers its KV cache here as a recall target: a CPU worker's cache lives in a
shared-memory segment, a CUDA worker's stays on its device and is exported with CUDA IPC
(kv_store/cuda_ipc.py). Per layer of a decode step the worker sends one RecallRequest (all of
the batch's missed blocks); the engine, on its own thread and core, gathers those units from the
pool and scatters them into the worker's cache, then signals completion (CPU: the request's
sequence number in the segment's header; CUDA: an interprocess event recorded on the engine's
stream) and wakes the worker with a RecallDone (the worker blocks on the socket, so an idle
engine and an idle worker spin on nothing).
"""

from __future__ import annotations

import dataclasses
import mmap
import threading
import time

import torch
import zmq
from google.protobuf.message import DecodeError

from pulseinfer.kernels.gather_scatter import recall
from pulseinfer.kv_store.cuda_ipc import CudaTarget
from pulseinfer.kv_store.layout import CacheShape, PoolGeometry, unit_bytes
from pulseinfer.kv_store.segments import open_segment
from pulseinfer.kv_store.view import HostRegistrar, register_host_range, unregister_host_ranges
from pulseinfer.proto.pulseinfer.v1 import kv_store_pb2 as pb

POLL_MS = 200  # how soon a shutdown signal is noticed


def shape_of(request: pb.OpenRecallTarget) -> CacheShape:
    """The shape of the cache `request` opens (kv_store/client.py's recall_target writes it)."""
    return CacheShape(**{f.name: getattr(request, f.name) for f in dataclasses.fields(CacheShape)})


def int64s(values: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(values), dtype=torch.int64) if values else torch.empty(0, dtype=torch.int64)


class SharedTarget:
    """A CPU worker's KV cache, mapped by the kv_store."""

    def __init__(self, request: pb.OpenRecallTarget, segment: str, dtype: torch.dtype):
        self.shape = shape_of(request)
        self._map = open_segment(segment, self.shape.segment_bytes(dtype))
        self.header, self.k, self.v = self.shape.tensors(self._map, dtype)

    def copy(self, units: torch.Tensor, rows: torch.Tensor, layer: int, device_blocks: torch.Tensor, heads: torch.Tensor | None) -> None:
        recall(units, rows, self.k[layer], self.v[layer], device_blocks, heads)

    def complete(self, sequence: int) -> None:
        self.header[0] = sequence

    def close(self) -> None:
        del self.header, self.k, self.v
        self._map.close()


RecallTarget = SharedTarget | CudaTarget


class RecallEngine:
    def __init__(self, pool_map: mmap.mmap, geometry: PoolGeometry, staging_min_bytes: int, cuda_host: HostRegistrar | None = None):
        """`cuda_host`: how the pool is registered with CUDA; None without a CUDA device (CUDA targets
        are then refused). The pool is pinned here, once, before the kv_store reports ready: seconds
        per 10 GB, which no worker's open_recall may wait for."""
        self.geometry = geometry
        self.dtype = getattr(torch, geometry.dtype)
        self.staging_min_bytes = staging_min_bytes
        self.pool = torch.frombuffer(pool_map, dtype=self.dtype)
        self.targets: dict[int, RecallTarget] = {}
        self.recalls = 0  # completed, since start
        self.busy_s = 0.0
        self._cuda_host = cuda_host
        # page-locked and mapped: the recall kernel reads it through UVA, DMAs need no bounce buffer
        size = self.pool.numel() * self.pool.element_size()
        self._pinned = register_host_range(self.pool.data_ptr(), size, cuda_host) if cuda_host is not None else None
        self._lock = threading.Lock()  # targets are opened and dropped on the control thread, used on the engine's

    def open(self, request: pb.OpenRecallTarget, segment: str) -> None:
        """Opens worker `request.worker_id`'s cache: exported from its CUDA device, or else in `segment`."""
        if request.dtype != self.geometry.dtype:  # fp16 and bf16 units are the same size: only the name tells them apart
            raise ValueError(
                f"worker {request.worker_id}'s cache is {request.dtype or '(no dtype)'}, the pool's units are {self.geometry.dtype}"
            )
        unit = unit_bytes(request.kv_heads, request.block_size, request.head_dim, self.dtype.itemsize)
        if unit != self.geometry.unit_bytes or request.num_layers != self.geometry.num_layers:
            raise ValueError(
                f"worker {request.worker_id}'s cache: {request.num_layers} layers of {unit}-byte units do not match the pool's "
                f"{self.geometry.num_layers} layers of {self.geometry.unit_bytes}-byte units"
            )
        target = self._cuda_target(request) if request.HasField("cuda") else SharedTarget(request, segment, self.dtype)
        with self._lock:
            self._drop(request.worker_id)
            self.targets[request.worker_id] = target

    def _cuda_target(self, request: pb.OpenRecallTarget) -> CudaTarget:
        if self._pinned is None:
            raise ValueError(f"worker {request.worker_id} has a CUDA cache, and this kv_store sees no CUDA device (its pool is not pinned)")
        return CudaTarget(request, shape_of(request), self.dtype, self.staging_min_bytes)

    def drop(self, worker_id: int) -> None:
        """Unmaps a worker's cache."""
        with self._lock:
            self._drop(worker_id)

    def _drop(self, worker_id: int) -> None:
        target = self.targets.pop(worker_id, None)
        if target is not None:
            target.close()

    def run(self, request: pb.RecallRequest) -> pb.RecallDone:
        started = time.perf_counter()
        try:
            with self._lock:
                self._copy(request)
        except ValueError as e:
            return pb.RecallDone(sequence=request.sequence, error=str(e))
        busy = time.perf_counter() - started
        self.recalls, self.busy_s = self.recalls + 1, self.busy_s + busy
        return pb.RecallDone(sequence=request.sequence, busy_s=busy)

    def _copy(self, request: pb.RecallRequest) -> None:
        target = self.targets.get(request.worker_id)
        if target is None:
            raise ValueError(f"worker {request.worker_id} has no recall target: open one first")
        host, device, heads = int64s(request.host_blocks), int64s(request.device_blocks), int64s(request.heads)
        shape = target.shape
        _check_range("host block", host, self.geometry.num_blocks)
        _check_range("device block", device, shape.slots // shape.block_size)
        if request.layer >= shape.num_layers:
            raise ValueError(f"layer {request.layer} out of range [0, {shape.num_layers})")
        if heads.numel():
            _check_range("kv head", heads, shape.kv_heads)
        if host.shape != device.shape or (heads.numel() and heads.shape != host.shape):
            raise ValueError(f"{host.numel()} host blocks for {device.numel()} device blocks and {heads.numel()} heads")
        rows = host * self.geometry.num_layers + request.layer
        units = self.pool.view(-1, 2, shape.kv_heads, shape.block_size, shape.head_dim)  # one row per (block, layer)
        target.copy(units, rows, request.layer, device, heads if heads.numel() else None)
        target.complete(request.sequence)

    def serve(self, context: zmq.Context, address: str, ready: threading.Event, stop: threading.Event) -> None:
        """The engine's thread: one request at a time, answered to the worker that sent it."""
        torch.set_num_threads(1)  # the engine's own core; the worker's compute keeps the others
        socket = context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        try:
            socket.bind(address)
            ready.set()
            while not stop.is_set():
                if not socket.poll(POLL_MS):
                    continue
                identity, raw = socket.recv_multipart()
                try:
                    done = self.run(pb.RecallRequest.FromString(raw))
                except DecodeError as e:
                    done = pb.RecallDone(error=f"bad recall request: {e}")
                socket.send_multipart([identity, done.SerializeToString()])
        finally:
            socket.close()

    def close(self) -> None:
        """Unmaps every target and lets go of the pool (whose mapping cannot close while viewed)."""
        with self._lock:
            for worker_id in list(self.targets):
                self._drop(worker_id)
            if self._pinned:
                unregister_host_ranges(self._pinned, self._cuda_host)
                self._pinned = None
            del self.pool


def _check_range(what: str, values: torch.Tensor, bound: int) -> None:
    if values.numel() and (int(values.min()) < 0 or int(values.max()) >= bound):
        raise ValueError(f"{what} out of range [0, {bound}): {values.tolist()[:8]}")
