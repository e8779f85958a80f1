"""The kv_store from a worker (or a probe): the control API (blocking ZMQ request/reply) and
recalls done by its I/O engine."""

from __future__ import annotations

import dataclasses
import os
import threading
from array import array
from typing import Protocol

import zmq

from pulseinfer.common.peer import PeerLoss, watch
from pulseinfer.kv_store.allocator import PoolExhausted
from pulseinfer.kv_store.layout import CacheShape, Completion  # no torch: the control API (probes) must not pay for it
from pulseinfer.proto.pulseinfer.v1 import kv_store_pb2 as pb


class KVStoreUnavailable(RuntimeError):
    pass


class HostPoolLost(RuntimeError):
    """The kv_store does not know this worker: it restarted, and the pool this worker mapped is gone."""


def io_address(control: str) -> str:
    """The I/O engine's address, next to the control address: `ipc://PATH` -> `ipc://PATH.io`,
    `tcp://HOST:PORT` -> `tcp://HOST:PORT+1` (one address to configure, on both sides)."""
    if control.startswith("ipc://"):
        return control + ".io"
    host, sep, port = control.rpartition(":")
    if not control.startswith("tcp://") or not sep or not port.isdigit():
        raise ValueError(f"kv_store address must be ipc://PATH or tcp://HOST:PORT, got {control!r}")
    return f"{host}:{int(port) + 1}"


def pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def recall_target(shape: CacheShape, worker_id: int, dtype: str, cuda: pb.CudaCache | None = None) -> pb.OpenRecallTarget:
    """The request that opens a cache of this shape and element type (a name: "bfloat16") (the
    worker's cache segment, or exported from a CUDA device) as worker `worker_id`'s recall target
    (kv_store/io_engine.py's shape_of reads it back)."""
    return pb.OpenRecallTarget(worker_id=worker_id, cuda=cuda, dtype=dtype, **dataclasses.asdict(shape))


class RecallCache(Protocol):
    """What a worker's shared KV cache (gpu_worker/kv_cache.py's PagedKVCache) offers the I/O engine."""

    @property
    def completion(self) -> Completion: ...  # how a recall by the engine is known to have landed

    def recall_target(self, worker_id: int) -> pb.OpenRecallTarget: ...


class KVStoreClient:
    def __init__(self, context: zmq.Context, address: str, timeout_s: float = 5.0):
        self.context = context
        self.address = address
        self.timeout_s = timeout_s
        self.worker_id: int | None = None  # set by register; allocations are charged to it
        self._socket = self._connect()
        self._watch, self._loss = watch(context, address)

    def _connect(self) -> zmq.Socket:
        socket = self.context.socket(zmq.REQ)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self.address)
        return socket

    def call(self, request: pb.KVStoreRequest) -> pb.KVStoreResponse:
        self._socket.send(request.SerializeToString())
        if not self._socket.poll(int(self.timeout_s * 1000)):
            self._socket.close()  # a REQ socket that lost its reply cannot send again
            self._socket = self._connect()
            raise KVStoreUnavailable(f"kv_store at {self.address} did not answer within {self.timeout_s:g} s")
        response = pb.KVStoreResponse.FromString(self._socket.recv())
        if response.code == pb.KV_STORE_RESOURCE_EXHAUSTED:
            raise PoolExhausted(response.error)
        if response.code == pb.KV_STORE_UNKNOWN_WORKER:
            raise HostPoolLost(f"kv_store at {self.address} restarted: {response.error}")
        if response.code != pb.KV_STORE_OK:
            raise ValueError(f"kv_store: {response.error}")
        return response

    def register(self, worker_id: int) -> pb.PoolLayout:
        message = pb.RegisterWorker(worker_id=worker_id, pid=os.getpid(), pid_namespace=pid_namespace())
        layout = self.call(pb.KVStoreRequest(register=message)).layout
        self.worker_id = worker_id
        return layout

    def allocate(self, owner: str, count: int) -> list[int]:
        if self.worker_id is None:
            raise RuntimeError("register with the kv_store before allocating")
        request = pb.Allocate(owner=owner, blocks=count, worker_id=self.worker_id)
        return list(self.call(pb.KVStoreRequest(allocate=request)).blocks)

    def release(self, owner: str) -> int:
        return self.call(pb.KVStoreRequest(release=pb.Release(owner=owner))).freed

    def acquire(self, owner: str, names: list[bytes], worker_id: int | None = None) -> list[int]:
        """Host blocks of the longest cached prefix of `names`, now also held by `owner` (charged to
        `worker_id`, default this client's registered worker)."""
        worker = self.worker_id if worker_id is None else worker_id
        request = pb.AcquirePrefix(owner=owner, worker_id=worker or 0, names=names)
        return list(self.call(pb.KVStoreRequest(acquire_prefix=request)).blocks)

    def match(self, names: list[bytes]) -> int:
        """Blocks of the longest cached prefix of `names` (nothing taken)."""
        return len(self.call(pb.KVStoreRequest(acquire_prefix=pb.AcquirePrefix(names=names, match_only=True))).blocks)

    def insert(self, names: list[bytes], blocks: list[int], owner: str = "") -> None:
        """Names written blocks; with `owner` (a demotion's reservation), its references to them are dropped."""
        self.call(pb.KVStoreRequest(name_blocks=pb.NameBlocks(names=names, blocks=blocks, owner=owner)))

    def reserve(self, owner: str, names: list[bytes]) -> list[int]:
        """A host block held by `owner` for each name the host tier does not have (-1: it has it, or no room)."""
        if self.worker_id is None:
            raise RuntimeError("register with the kv_store before reserving")
        request = pb.ReserveDemotion(owner=owner, worker_id=self.worker_id, names=names)
        return list(self.call(pb.KVStoreRequest(reserve_demotion=request)).reserved)

    def drop_prefix_cache(self) -> int:
        return self.call(pb.KVStoreRequest(drop_prefix_cache=pb.DropPrefixCache())).freed

    def open_recall(self, target: pb.OpenRecallTarget) -> None:
        self.call(pb.KVStoreRequest(open_recall=target))

    def open_recall_engine(self, cache: RecallCache) -> RemoteRecall:
        """Opens this worker's shared `cache` as the I/O engine's recall target; recalls then go through the result."""
        if self.worker_id is None:
            raise RuntimeError("register with the kv_store before opening a recall target")
        self.open_recall(cache.recall_target(self.worker_id))
        return RemoteRecall(self.context, self.address, self.worker_id, cache.completion, self.timeout_s)

    def stats(self) -> pb.KVStoreStats:
        return self.call(pb.KVStoreRequest(stats=pb.StatsQuery())).stats

    def lost(self) -> bool:
        """True if the kv_store process went away since the last call (its pool went with it)."""
        return self._loss.happened()

    def close(self) -> None:
        self._loss.close()
        self._watch.close()
        self._socket.close()


class RemoteRecall:
    """Recalls into this worker's KV cache (which the kv_store has opened as a recall target), done
    by the kv_store's I/O engine. One request at a time."""

    def __init__(self, context: zmq.Context, control: str, worker_id: int, completion: Completion, timeout_s: float):
        self.worker_id = worker_id
        self.completion = completion
        self.timeout_s = timeout_s
        self.sequence = completion.last()
        self._lock = threading.Lock()  # the I/O thread's prefetches and the compute thread's corrections share the socket
        self._socket = context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(io_address(control))
        self._loss = PeerLoss(self._socket)
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)
        self._poller.register(self._loss.monitor, zmq.POLLIN)

    def __call__(self, layer: int, host_blocks: list[int], device_blocks: list[int], heads: list[int] | None = None) -> float:
        """Copies host blocks (all kv heads, or kv head heads[i] of each) into device blocks of layer
        `layer`; returns when they have landed (on a CUDA worker: when its compute stream waits for
        them), with the engine's copy time."""
        with self._lock:
            self.sequence += 1
            request = pb.RecallRequest(
                worker_id=self.worker_id,
                sequence=self.sequence,
                layer=layer,
                host_blocks=_int64s(host_blocks),
                device_blocks=_int64s(device_blocks),
                heads=_int64s(heads or []),
            )
            self.completion.issue()
            self._socket.send(request.SerializeToString())
            done = self._wait(self.sequence)
            if done.error:
                raise ValueError(f"kv_store I/O engine: {done.error}")
            self.completion.landed(self.sequence)
        return done.busy_s

    def _wait(self, sequence: int) -> pb.RecallDone:
        """The answer to `sequence`; answers to earlier requests that timed out are dropped. A
        kv_store that dies fails the wait at once, not after the timeout."""
        while ready := dict(self._poller.poll(int(self.timeout_s * 1000))):
            if self._loss.monitor in ready and self._loss.happened():
                raise KVStoreUnavailable(f"the kv_store went away during recall {sequence} (its I/O engine's connection closed)")
            if self._socket in ready:
                done = pb.RecallDone.FromString(self._socket.recv())
                if done.sequence == sequence:
                    return done
        raise KVStoreUnavailable(f"kv_store I/O engine did not complete recall {sequence} within {self.timeout_s:g} s")

    def close(self) -> None:
        self._loss.close()
        self._socket.close()


def _int64s(values: list[int]) -> bytes:
    return array("q", values).tobytes()
