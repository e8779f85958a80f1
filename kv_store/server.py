"""kv_store process: owns the host KV pool, its block allocator and the I/O engine that recalls
into CPU workers' caches; ZMQ request/reply control.

KV bytes never pass through a socket: workers map the segment named in PoolLayout, and the
engine maps each CPU worker's cache segment.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch
import zmq
from google.protobuf.message import DecodeError

from pulseinfer.common.memory import check_fits
from pulseinfer.kv_store.allocator import AllocatorCorrupt, PoolExhausted
from pulseinfer.kv_store.client import io_address, pid_namespace
from pulseinfer.kv_store.cuda_ipc import STAGING_BYTES
from pulseinfer.kv_store.io_engine import RecallEngine
from pulseinfer.kv_store.layout import PoolGeometry
from pulseinfer.kv_store.pool import SharedPool, pid_alive
from pulseinfer.kv_store.prefix_cache import CACHE_OWNER, NAME_BYTES, HostBlocks
from pulseinfer.kv_store.segments import cache_name, sweep
from pulseinfer.kv_store.view import CUDA_HOST
from pulseinfer.proto.pulseinfer.v1 import kv_store_pb2 as pb

log = logging.getLogger("kv_store")
POLL_MS = 200  # how soon a shutdown signal is noticed
REAP_INTERVAL_S = 1.0  # how often registered workers' pids are checked


@dataclass(frozen=True)
class KVStoreConfig:
    model: str | None = None  # the pool's geometry follows the model's layers, KV heads and head size
    load_format: str = "auto"  # auto | dummy: seeded random weights of the model's geometry
    bind: str = "tcp://127.0.0.1:5560"
    block_size: int = 16
    host_kv_tokens: int = 65536  # pool capacity; the segment is sparse until written
    kv_dtype: str = "float32"  # float32 on CPU workers, bfloat16 on CUDA workers
    prefault: bool = True  # back every page at start-up
    # recalls into CUDA workers: whole units of this size and up go staged (host gather, one DMA,
    # scatter on the device); smaller fragments are read by the recall kernel through UVA
    staging_min_kib: int = STAGING_BYTES >> 10


@dataclass
class RegisteredWorker:
    pid: int
    watch_pid: bool  # same pid namespace as the store: a vanished pid means the worker died
    owners: set[str] = field(default_factory=set)


class KVStore:
    """The control logic, free of sockets: one request in, one response out."""

    def __init__(self, pool: SharedPool, engine: RecallEngine):
        self.pool = pool
        self.engine = engine
        self.host = HostBlocks(pool.geometry.num_blocks)
        self.allocator = self.host.allocator
        self.workers: dict[int, RegisteredWorker] = {}

    def handle(self, request: pb.KVStoreRequest) -> pb.KVStoreResponse:
        kind = request.WhichOneof("kind")
        owner = getattr(getattr(request, kind), "owner", "") if kind else ""
        if owner.startswith(CACHE_OWNER[0]):  # the prefix cache's own references: no client may take or drop them
            return pb.KVStoreResponse(code=pb.KV_STORE_INVALID_ARGUMENT, error="owners starting with NUL are reserved")
        if kind == "register":
            self._register(request.register)
            return pb.KVStoreResponse(layout=self.layout())
        if kind == "allocate":
            return self._allocate(request.allocate)
        if kind == "release":
            return pb.KVStoreResponse(freed=self._release(request.release.owner))
        if kind in ("ping", "stats"):
            return pb.KVStoreResponse(stats=self.stats())
        if kind == "open_recall":
            return self._open_recall(request.open_recall)
        if kind == "acquire_prefix":
            return self._acquire_prefix(request.acquire_prefix)
        if kind == "name_blocks":
            return self._name_blocks(request.name_blocks)
        if kind == "drop_prefix_cache":
            return pb.KVStoreResponse(freed=self.host.drop_prefix_cache())
        if kind == "reserve_demotion":
            return self._reserve_demotion(request.reserve_demotion)
        if kind == "prefix_events":
            events = self.host.journal.since(request.prefix_events.epoch, request.prefix_events.since, lambda: self.host.prefix.blocks)
            return pb.KVStoreResponse(prefix_events=pb.PrefixEvents(**vars(events)))
        return pb.KVStoreResponse(code=pb.KV_STORE_INVALID_ARGUMENT, error="empty request")

    def _register(self, request: pb.RegisterWorker) -> None:
        earlier = self.workers.get(request.worker_id)
        if earlier is not None and earlier.pid != request.pid:
            self._forget(request.worker_id, "restarted")
        if earlier is None or earlier.pid != request.pid:
            self.workers[request.worker_id] = RegisteredWorker(request.pid, request.pid_namespace == pid_namespace())

    def _allocate(self, request: pb.Allocate) -> pb.KVStoreResponse:
        if not request.owner:
            return pb.KVStoreResponse(code=pb.KV_STORE_INVALID_ARGUMENT, error="allocate needs an owner")
        worker = self.workers.get(request.worker_id)
        if worker is None:
            return pb.KVStoreResponse(code=pb.KV_STORE_UNKNOWN_WORKER, error=f"worker {request.worker_id} is not registered")
        try:
            blocks = self.host.allocate(request.owner, request.blocks)
        except PoolExhausted as e:
            return pb.KVStoreResponse(code=pb.KV_STORE_RESOURCE_EXHAUSTED, error=str(e))
        worker.owners.add(request.owner)
        return pb.KVStoreResponse(blocks=blocks)

    def _acquire_prefix(self, request: pb.AcquirePrefix) -> pb.KVStoreResponse:
        if bad := _bad_names(request.names):
            return bad
        if request.match_only:
            return pb.KVStoreResponse(blocks=self.host.prefix.match(list(request.names)))
        worker = self.workers.get(request.worker_id)
        if worker is None:
            return pb.KVStoreResponse(code=pb.KV_STORE_UNKNOWN_WORKER, error=f"worker {request.worker_id} is not registered")
        if not request.owner:
            return pb.KVStoreResponse(code=pb.KV_STORE_INVALID_ARGUMENT, error="acquire_prefix needs an owner")
        blocks = self.host.acquire(request.owner, list(request.names))
        if blocks:
            worker.owners.add(request.owner)
        return pb.KVStoreResponse(blocks=blocks)

    def _reserve_demotion(self, request: pb.ReserveDemotion) -> pb.KVStoreResponse:
        if bad := _bad_names(request.names):
            return bad
        worker = self.workers.get(request.worker_id)
        if worker is None:
            return pb.KVStoreResponse(code=pb.KV_STORE_UNKNOWN_WORKER, error=f"worker {request.worker_id} is not registered")
        if not request.owner:
            return pb.KVStoreResponse(code=pb.KV_STORE_INVALID_ARGUMENT, error="reserve_demotion needs an owner")
        worker.owners.add(request.owner)
        return pb.KVStoreResponse(reserved=self.host.reserve(request.owner, list(request.names)))

    def _name_blocks(self, request: pb.NameBlocks) -> pb.KVStoreResponse:
        if bad := _bad_names(request.names):
            return bad
        try:
            self.host.insert(list(request.names), list(request.blocks), request.owner)
        except ValueError as e:
            return pb.KVStoreResponse(code=pb.KV_STORE_INVALID_ARGUMENT, error=str(e))
        return pb.KVStoreResponse()

    def _open_recall(self, request: pb.OpenRecallTarget) -> pb.KVStoreResponse:
        if request.worker_id not in self.workers:
            return pb.KVStoreResponse(code=pb.KV_STORE_UNKNOWN_WORKER, error=f"worker {request.worker_id} is not registered")
        try:
            self.engine.open(request, cache_name(self.workers[request.worker_id].pid))
        except (ValueError, OSError) as e:
            return pb.KVStoreResponse(code=pb.KV_STORE_INVALID_ARGUMENT, error=str(e))
        return pb.KVStoreResponse()

    def _release(self, owner: str) -> int:
        for worker in self.workers.values():
            worker.owners.discard(owner)
        return self.allocator.release(owner)

    def _forget(self, worker_id: int, why: str) -> None:
        """Frees every block a dead (or restarted) worker's requests held."""
        worker = self.workers.pop(worker_id)
        freed = sum(self.allocator.release(owner) for owner in worker.owners)
        self.engine.drop(worker_id)
        sweep()  # a worker killed -9 leaves its cache segment behind
        log.warning("worker %d (pid %d) %s: freed %d host blocks of %d requests", worker_id, worker.pid, why, freed, len(worker.owners))

    def reap_dead_workers(self) -> None:
        for worker_id, worker in list(self.workers.items()):
            if worker.watch_pid and not pid_alive(worker.pid):
                self._forget(worker_id, "exited")

    def layout(self) -> pb.PoolLayout:
        g = self.pool.geometry
        return pb.PoolLayout(
            shm_name=self.pool.name, num_blocks=g.num_blocks, unit_bytes=g.unit_bytes, num_layers=g.num_layers, dtype=g.dtype
        )

    def stats(self) -> pb.KVStoreStats:
        a = self.allocator
        try:
            a.check()
            integrity = ""
        except AllocatorCorrupt as e:
            integrity = str(e)
        return pb.KVStoreStats(
            blocks_total=a.num_blocks,
            blocks_free=a.num_free,
            owners=a.num_owners,
            workers=len(self.workers),
            integrity_error=integrity,
            engine_recalls=self.engine.recalls,
            engine_busy_s=self.engine.busy_s,
            prefix_cached_blocks=len(self.host.prefix),
            prefix_evicted_blocks=self.host.prefix.stats.evicted_blocks,
            prefix_demoted_blocks=self.host.prefix.stats.demoted_blocks,
            block_bytes=self.pool.geometry.unit_bytes * self.pool.geometry.num_layers,
        )


def _bad_names(names) -> pb.KVStoreResponse | None:
    if any(len(name) != NAME_BYTES for name in names):
        return pb.KVStoreResponse(code=pb.KV_STORE_INVALID_ARGUMENT, error=f"prefix-cache names are {NAME_BYTES} bytes each")
    return None


def serve(config: KVStoreConfig, geometry: PoolGeometry, stop: threading.Event) -> None:
    sweep()
    what = f"the host KV pool of {config.host_kv_tokens} tokens (--host-kv-tokens)"
    check_fits(geometry.total_bytes, torch.device("cpu"), what, shared=True)
    pool = SharedPool(geometry, populate=config.prefault)
    try:  # with a CUDA device the pool is pinned now, before the store binds (reports ready)
        engine = RecallEngine(pool.map, geometry, config.staging_min_kib << 10, CUDA_HOST if torch.cuda.is_available() else None)
    except BaseException:
        pool.close()
        raise
    context = zmq.Context()
    socket = context.socket(zmq.REP)
    socket.setsockopt(zmq.LINGER, 0)
    engine_address = io_address(config.bind)
    engine_ready, engine_stop = threading.Event(), threading.Event()
    io = threading.Thread(target=engine.serve, args=(context, engine_address, engine_ready, engine_stop), name="io-engine")
    try:
        socket.bind(config.bind)
        io.start()
        if not engine_ready.wait(10):
            raise RuntimeError(f"the I/O engine could not bind {engine_address}")
        store = KVStore(pool, engine)
        log.info(
            "host KV pool %s: %d blocks, %.2f GiB; control on %s, I/O engine on %s",
            pool.name,
            geometry.num_blocks,
            geometry.total_bytes / 2**30,
            config.bind,
            engine_address,
        )
        reaped_at = time.monotonic()
        while not stop.is_set():
            if time.monotonic() - reaped_at > REAP_INTERVAL_S:
                store.reap_dead_workers()
                reaped_at = time.monotonic()
            if not socket.poll(POLL_MS):
                continue
            raw = socket.recv()
            try:
                response = store.handle(pb.KVStoreRequest.FromString(raw))
            except DecodeError as e:  # a malformed message must not take the store down
                response = pb.KVStoreResponse(code=pb.KV_STORE_INVALID_ARGUMENT, error=f"bad request: {e}")
            socket.send(response.SerializeToString())
    finally:
        engine_stop.set()
        if io.is_alive():
            io.join()
        engine.close()
        socket.close()
        context.term()
        pool.close()
