"""The kv_store control API from a worker (or a probe): blocking ZMQ request/reply."""

from __future__ import annotations

import os

import zmq

from kv_store.allocator import PoolExhausted
from proto.pulseinfer.v1 import kv_store_pb2 as pb


class KVStoreUnavailable(RuntimeError):
    pass


class KVStoreClient:
    def __init__(self, context: zmq.Context, address: str, timeout_s: float = 5.0):
        self.context = context
        self.address = address
        self.timeout_s = timeout_s
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
        if response.code != pb.KV_STORE_OK:
            raise ValueError(f"kv_store: {response.error}")
        return response

    def register(self, worker_id: int) -> pb.PoolLayout:
        return self.call(pb.KVStoreRequest(register=pb.RegisterWorker(worker_id=worker_id, pid=os.getpid()))).layout

    def allocate(self, owner: str, blocks: int) -> list[int]:
        return list(self.call(pb.KVStoreRequest(allocate=pb.Allocate(owner=owner, blocks=blocks))).blocks)

    def release(self, owner: str) -> int:
        return self.call(pb.KVStoreRequest(release=pb.Release(owner=owner))).freed

    def stats(self) -> pb.KVStoreStats:
        return self.call(pb.KVStoreRequest(stats=pb.StatsQuery())).stats

    def close(self) -> None:
        self._socket.close()
