"""The kv_store control API from a worker (or a probe): blocking ZMQ request/reply."""

from __future__ import annotations

import os

import zmq

from kv_store.allocator import PoolExhausted
from proto.pulseinfer.v1 import kv_store_pb2 as pb


class KVStoreUnavailable(RuntimeError):
    pass


class HostPoolLost(RuntimeError):
    """The kv_store does not know this worker: it restarted, and the pool this worker mapped is gone."""


def pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


class KVStoreClient:
    def __init__(self, context: zmq.Context, address: str, timeout_s: float = 5.0):
        self.context = context
        self.address = address
        self.timeout_s = timeout_s
        self.worker_id: int | None = None  # set by register; allocations are charged to it
        self._socket = self._connect()

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

    def stats(self) -> pb.KVStoreStats:
        return self.call(pb.KVStoreRequest(stats=pb.StatsQuery())).stats

    def close(self) -> None:
        self._socket.close()
