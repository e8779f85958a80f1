"""kv_store process: owns the host KV pool and its block allocator; ZMQ request/reply control.

KV bytes never pass through the socket: workers map the segment named in PoolLayout.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

import zmq
from google.protobuf.message import DecodeError

from kv_store.allocator import BlockAllocator, PoolExhausted
from kv_store.pool import PoolGeometry, SharedPool
from proto.pulseinfer.v1 import kv_store_pb2 as pb

log = logging.getLogger("kv_store")
POLL_MS = 200  # how soon a shutdown signal is noticed


@dataclass(frozen=True)
class KVStoreConfig:
    model: str | None = None  # the pool's geometry follows the model's layers, KV heads and head size
    bind: str = "tcp://127.0.0.1:5560"
    block_size: int = 16
    host_kv_tokens: int = 65536  # pool capacity; the segment is sparse until written
    kv_dtype: str = "float32"  # float32 on CPU workers, bfloat16 on CUDA workers
    prefault: bool = True  # back every page at start-up


class KVStore:
    """The control logic, free of sockets: one request in, one response out."""

    def __init__(self, pool: SharedPool):
        self.pool = pool
        self.allocator = BlockAllocator(pool.geometry.num_blocks)
        self.workers: dict[int, int] = {}  # worker id -> pid

    def handle(self, request: pb.KVStoreRequest) -> pb.KVStoreResponse:
        kind = request.WhichOneof("kind")
        if kind == "register":
            self.workers[request.register.worker_id] = request.register.pid
            return pb.KVStoreResponse(layout=self.layout())
        if kind == "allocate":
            return self._allocate(request.allocate)
        if kind == "release":
            return pb.KVStoreResponse(freed=self.allocator.release(request.release.owner))
        if kind in ("ping", "stats"):
            return pb.KVStoreResponse(stats=self.stats())
        return pb.KVStoreResponse(code=pb.KV_STORE_INVALID_ARGUMENT, error="empty request")

    def _allocate(self, request: pb.Allocate) -> pb.KVStoreResponse:
        if not request.owner:
            return pb.KVStoreResponse(code=pb.KV_STORE_INVALID_ARGUMENT, error="allocate needs an owner")
        try:
            return pb.KVStoreResponse(blocks=self.allocator.allocate(request.owner, request.blocks))
        except PoolExhausted as e:
            return pb.KVStoreResponse(code=pb.KV_STORE_RESOURCE_EXHAUSTED, error=str(e))

    def layout(self) -> pb.PoolLayout:
        g = self.pool.geometry
        return pb.PoolLayout(shm_name=self.pool.name, num_blocks=g.num_blocks, unit_bytes=g.unit_bytes, num_layers=g.num_layers)

    def stats(self) -> pb.KVStoreStats:
        a = self.allocator
        return pb.KVStoreStats(blocks_total=a.num_blocks, blocks_free=a.num_free, owners=a.num_owners, workers=len(self.workers))


def serve(config: KVStoreConfig, geometry: PoolGeometry, stop: threading.Event) -> None:
    pool = SharedPool(f"pulseinfer-kv-{os.getpid()}", geometry, populate=config.prefault)
    context = zmq.Context()
    socket = context.socket(zmq.REP)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.bind(config.bind)
        store = KVStore(pool)
        log.info(
            "host KV pool %s: %d blocks, %.2f GiB; control on %s", pool.name, geometry.num_blocks, geometry.total_bytes / 2**30, config.bind
        )
        while not stop.is_set():
            if not socket.poll(POLL_MS):
                continue
            raw = socket.recv()
            try:
                response = store.handle(pb.KVStoreRequest.FromString(raw))
            except DecodeError as e:  # a malformed message must not take the store down
                response = pb.KVStoreResponse(code=pb.KV_STORE_INVALID_ARGUMENT, error=f"bad request: {e}")
            socket.send(response.SerializeToString())
    finally:
        socket.close()
        context.term()
        pool.close()
