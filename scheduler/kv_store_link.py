"""The scheduler's two uses of its node's kv_store: the host tier's prefix cache as placements ask
it (KVStorePrefix), and the store's stats and block events, polled (KVStoreMonitor)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import zmq
import zmq.asyncio

from pulseinfer.kv_store.client import HostPoolLost, KVStoreClient, KVStoreUnavailable
from pulseinfer.kv_store.prefix_cache import HostPrefix
from pulseinfer.proto.pulseinfer.v1 import generate_pb2, kv_store_pb2
from pulseinfer.scheduler.node_blocks import NodeBlocks

log = logging.getLogger("scheduler")
T = TypeVar("T")
KV_STORE_POLL_S = 1.0
KV_STORE_LOST_AFTER = 3  # polls missed in a row: the host tier's blocks are taken as gone (a snapshot restores them)
KV_STORE_PREFIX_TIMEOUT_S = 0.5  # the loop waits on a placement's prefix lookup: a store that does not answer is skipped
KV_STORE_PREFIX_BACKOFF_S = 5.0


class KVStorePrefix:
    """The host tier's prefix cache in the kv_store, as placements ask it: a blocking round trip per
    offloaded placement (and one estimate per request waiting under pressure). A store that does not
    answer, or restarted and does not know the worker yet, has nothing cached; one that timed out is
    not asked again for a while."""

    def __init__(self, client: KVStoreClient):
        self.client = client
        self._quiet_until = 0.0

    def of_worker(self, worker_id: int) -> HostPrefix:
        return WorkerHostPrefix(self, worker_id)

    def match(self, names: list[bytes]) -> int:
        return self._ask(lambda: self.client.match(names), 0)

    def acquire(self, owner: str, names: list[bytes], worker_id: int) -> list[int]:
        return self._ask(lambda: self.client.acquire(owner, names, worker_id), [])

    def release(self, owner: str) -> int:
        return self._ask(lambda: self.client.release(owner), 0)

    def drop_prefix_cache(self) -> int:
        return self._ask(self.client.drop_prefix_cache, 0)

    def _ask(self, call: Callable[[], T], nothing: T) -> T:
        if time.monotonic() < self._quiet_until:
            return nothing
        try:
            return call()
        except KVStoreUnavailable as e:
            log.warning("host prefix cache skipped for %.0f s: %s", KV_STORE_PREFIX_BACKOFF_S, e)
            self._quiet_until = time.monotonic() + KV_STORE_PREFIX_BACKOFF_S
        except (HostPoolLost, ValueError) as e:
            log.info("host prefix cache: %s", e)
        return nothing

    def close(self) -> None:
        self.client.close()


@dataclass(frozen=True)
class WorkerHostPrefix:
    """The host tier's prefix cache as one worker's batcher asks it: blocks taken are charged to the
    worker (freed by the kv_store if it dies)."""

    store: KVStorePrefix
    worker_id: int

    def match(self, names: list[bytes]) -> int:
        return self.store.match(names)

    def acquire(self, owner: str, names: list[bytes]) -> list[int]:
        return self.store.acquire(owner, names, self.worker_id)

    def release(self, owner: str) -> int:
        return self.store.release(owner)


class KVStoreMonitor:
    """Polls the kv_store: its stats (host KV usage for /metrics, its liveness for /health) and the
    host tier's block events (NodeBlocks, for the gateways' routers)."""

    def __init__(self, context: zmq.asyncio.Context, address: str, blocks: NodeBlocks):
        self.context = context
        self.address = address
        self.blocks = blocks
        self.last: kv_store_pb2.KVStoreStats | None = None
        self.missed = 0

    def stats(self) -> generate_pb2.SchedulerStats:
        if self.last is None:
            return generate_pb2.SchedulerStats(kv_store_alive=False)
        return generate_pb2.SchedulerStats(
            kv_store_alive=True,
            host_blocks_total=self.last.blocks_total,
            host_blocks_free=self.last.blocks_free,
            host_integrity_error=self.last.integrity_error,
            kv_store_engine_recalls=self.last.engine_recalls,
            kv_store_engine_busy_s=self.last.engine_busy_s,
            host_prefix_cached_blocks=self.last.prefix_cached_blocks,
            host_prefix_evicted_blocks=self.last.prefix_evicted_blocks,
            host_prefix_demoted_blocks=self.last.prefix_demoted_blocks,
            host_block_bytes=self.last.block_bytes,
        )

    async def run(self) -> None:
        while True:
            self.last = await self._poll()
            self.missed = 0 if self.last is not None else self.missed + 1
            if self.missed == KV_STORE_LOST_AFTER:
                self.blocks.host_lost()
            await asyncio.sleep(KV_STORE_POLL_S)

    async def _poll(self) -> kv_store_pb2.KVStoreStats | None:
        socket = self.context.socket(zmq.REQ)  # a fresh socket per poll: a lost reply cannot wedge REQ
        socket.setsockopt(zmq.LINGER, 0)
        try:
            socket.connect(self.address)
            stats = await self._ask(socket, kv_store_pb2.KVStoreRequest(stats=kv_store_pb2.StatsQuery()))
            query = kv_store_pb2.PrefixEventsQuery(epoch=self.blocks.host_epoch, since=self.blocks.host_next)
            events = stats and await self._ask(socket, kv_store_pb2.KVStoreRequest(prefix_events=query))
            if events:
                self.blocks.host_events(events.prefix_events)
            return stats.stats if stats else None
        finally:
            socket.close()

    @staticmethod
    async def _ask(socket: zmq.asyncio.Socket, request: kv_store_pb2.KVStoreRequest) -> kv_store_pb2.KVStoreResponse | None:
        await socket.send(request.SerializeToString())
        if not await socket.poll(int(KV_STORE_POLL_S * 1000)):
            return None
        return kv_store_pb2.KVStoreResponse.FromString(await socket.recv())
