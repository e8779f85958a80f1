"""The nodes a gateway serves from (docs/deployment.md, several nodes): one `Scheduler.Session` per node, each node
polled for its stats (its load, block size, health), a node found by DNS (a Kubernetes headless
Service) or named, and the router's view of what each holds.

A node that stops answering (its processes killed, its link down) is marked down within
DOWN_AFTER periodic polls (the polls /health and /metrics make on demand refresh stats only), and its
in-flight requests fail then, if gRPC keepalive has not failed them
already; new requests go to the others; a node that answers again rejoins with an empty index
(its cache is cold or unknown). The gateway keeps no state a restart would lose but that index,
so gateways are replicas."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable, Sequence

import grpc

from pulseinfer.gateway.metrics import GatewayMetrics
from pulseinfer.gateway.router import BlockIndex, Router, RouterConfig
from pulseinfer.gateway.session import SchedulerSession
from pulseinfer.messages.wire import health_problems
from pulseinfer.proto.pulseinfer.v1 import generate_pb2, generate_pb2_grpc, kv_store_pb2

log = logging.getLogger("gateway")
POLL_S = 1.0
POLL_TIMEOUT_S = 1.0
DOWN_AFTER = 2  # periodic polls missed in a row: down, its requests failed (within POLL_S * DOWN_AFTER + POLL_TIMEOUT_S)
DNS_PREFIX = "dns:"
DNS_REFRESH_S = 5.0
DEFAULT_INDEX_BLOCKS = 1 << 16  # until a node's stats give its capacity


class Node:
    def __init__(self, address: str, channel: grpc.aio.Channel, index_blocks: int):
        self.address = address
        self.channel = channel
        self.scheduler = generate_pb2_grpc.SchedulerStub(channel)
        self.session = SchedulerSession(self.scheduler)
        self.index = BlockIndex(min(index_blocks, DEFAULT_INDEX_BLOCKS))
        self.index_blocks = index_blocks
        self.in_flight = 0
        self.state = "joining"  # joining | up | unhealthy (answers, cannot serve) | unreachable (a poll missed) | down
        self.problems: list[str] = ["not polled yet"]
        self.stats: generate_pb2.SchedulerStats | None = None
        self.missed = 0
        self.answered_at = 0.0
        self.retired = False  # gone from DNS: takes no new request, closed once its requests end
        self.events: asyncio.Task | None = None  # follow_events, once the gateway has started
        self.resubscribe = False  # the index was cleared: follow_events starts again from a snapshot

    @property
    def routable(self) -> bool:
        """Up, and answered a poll since its session last broke (a scheduler killed: at once, not at the next poll)."""
        lost = self.session.lost_at
        return self.state == "up" and not self.retired and (lost is None or self.answered_at > lost)

    async def close(self) -> None:
        if self.events is not None:
            self.events.cancel()
        await self.channel.close()

    @property
    def answering(self) -> bool:
        """The periodic poll's last answer came (the node may be unhealthy)."""
        return self.state in ("up", "unhealthy")

    def refreshed(self, stats: generate_pb2.SchedulerStats) -> None:
        """An on-demand poll's answer: newer stats, the state left to the periodic poll (`polled`)."""
        self.stats = stats
        self._fit_index(stats)

    def polled(self, stats: generate_pb2.SchedulerStats | None) -> None:
        """The periodic poll's answer, None for none in time: the node's state."""
        if stats is None:
            self.missed += 1
            if self.missed >= DOWN_AFTER and self.state != "down":
                self._down()
            elif self.state != "down":  # not routed to meanwhile; its requests may still be running
                self.state, self.problems, self.stats = "unreachable", ["the scheduler is not answering"], None
            return
        if self.state == "down":
            log.info("node %s answers again: rejoined, cache unknown", self.address)
        self.missed, self.stats, self.answered_at = 0, stats, time.monotonic()
        self.problems = health_problems(stats)
        self.state = "unhealthy" if self.problems else "up"
        self._fit_index(stats)

    def _fit_index(self, stats: generate_pb2.SchedulerStats) -> None:
        capacity = stats.device_blocks_total + stats.host_blocks_total
        if capacity:
            self.index.capacity = min(self.index_blocks, capacity)

    def _down(self) -> None:
        log.warning("node %s missed %d polls: down; its in-flight requests fail", self.address, self.missed)
        self.state, self.problems, self.stats = "down", [f"unreachable for {self.missed} polls"], None
        self.session.fail(f"lost node {self.address}: unreachable")
        self.index.clear()
        self.resubscribe = True

    async def follow_events(self, metrics: GatewayMetrics) -> None:
        """Keeps the index equal to what the node says it holds (its block events), resuming where it
        left off; the names the router adds as it sends requests stand until the node's events say otherwise."""
        epoch = since = 0
        while True:
            if self.resubscribe:  # its index was cleared: start again from a snapshot
                epoch = since = 0
                self.resubscribe = False
            if self.state in ("up", "unhealthy"):
                try:
                    async for batch in self.scheduler.BlockEvents(kv_store_pb2.PrefixEventsQuery(epoch=epoch, since=since)):
                        if batch.snapshot or batch.epoch != epoch:
                            self.index.clear()
                        self.index.add(batch.stored)
                        self.index.remove(batch.removed)
                        epoch, since = batch.epoch, batch.next
                        metrics.block_events.inc(len(batch.stored) + len(batch.removed), node=self.address)
                except grpc.aio.AioRpcError as e:
                    log.info("node %s: block events ended (%s); the index stands on what was sent", self.address, e.code().name)
            await asyncio.sleep(POLL_S)

    def report(self) -> dict:
        return {"state": self.state, "problems": self.problems, "in_flight": self.in_flight}


class Nodes:
    """`targets`: comma-separated HOST:PORT or unix://PATH, and/or dns:NAME:PORT resolved every DNS_REFRESH_S."""

    def __init__(
        self,
        targets: str,
        router: RouterConfig,
        connect: Callable[[str, str | None], grpc.aio.Channel],
        metrics: GatewayMetrics,
    ):
        """`connect(address, server_name)`: a channel to a node; server_name, for one found by DNS, is the
        name its TLS certificate carries."""
        self.router = Router(router)
        self.config = router
        self.connect = connect
        self.metrics = metrics
        self.nodes: dict[str, Node] = {}
        self._started = False
        self.names: list[tuple[str, int]] = []
        for target in (t.strip() for t in targets.split(",")):
            if not target:
                raise ValueError(f"--nodes has an empty entry: {targets!r}")
            if target.startswith(DNS_PREFIX):
                name, _, port = target.removeprefix(DNS_PREFIX).rpartition(":")
                if not name or not port.isdigit():
                    raise ValueError(f"--nodes {target!r}: expected dns:NAME:PORT")
                self.names.append((name, int(port)))
            else:
                self._add(target, None)
        self.placed: dict[str, Node] = {}
        self._tasks: list[asyncio.Task] = []

    def _add(self, address: str, server_name: str | None) -> None:
        node = self.nodes[address] = Node(address, self.connect(address, server_name), self.config.index_blocks)
        self.metrics.node_up.set(0, node=address)
        if self._started:
            node.events = asyncio.create_task(node.follow_events(self.metrics))

    async def start(self) -> None:
        self._started = True
        if self.names:
            await self._resolve()
        for node in self.nodes.values():
            node.events = node.events or asyncio.create_task(node.follow_events(self.metrics))
        await self.check()
        self._tasks = [asyncio.create_task(self._every(POLL_S, self.check))]
        if self.names:
            self._tasks.append(asyncio.create_task(self._every(DNS_REFRESH_S, self._resolve)))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for node in self.nodes.values():
            await node.close()

    @staticmethod
    async def _every(period_s: float, work: Callable) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                await work()
            except Exception:  # a bad round must not end the loop: the next one may succeed
                log.exception("node upkeep failed")

    async def poll(self) -> None:
        """On demand (/health, /metrics): the stats of the nodes the periodic poll finds answering, for
        those that answer now; it moves no node's state, and an answer missed here counts for nothing:
        a client polling fast must not fail a slow node's requests sooner than DOWN_AFTER periodic polls."""
        nodes = [n for n in self.nodes.values() if n.answering]
        for node, stats in zip(nodes, await asyncio.gather(*(self._stats(n) for n in nodes)), strict=True):
            if stats is not None and node.answering:  # the periodic poll may have moved it meanwhile
                node.refreshed(stats)
        for node in self.nodes.values():
            self.metrics.index_blocks.set(len(node.index), node=node.address)

    async def check(self) -> None:
        """Periodic (every POLL_S): each node's stats and its state from them, the only poll that moves
        states (up, unhealthy, unreachable, down: its requests failed); retired nodes without requests closed."""
        nodes = list(self.nodes.values())
        for node, stats in zip(nodes, await asyncio.gather(*(self._stats(n) for n in nodes)), strict=True):
            node.polled(stats)
            self.metrics.node_up.set(float(node.state == "up"), node=node.address)
            self.metrics.index_blocks.set(len(node.index), node=node.address)
        for node in [n for n in nodes if n.retired and n.in_flight == 0]:
            del self.nodes[node.address]
            self.metrics.node_up.set(0, node=node.address)
            await node.close()

    @staticmethod
    async def _stats(node: Node) -> generate_pb2.SchedulerStats | None:
        try:
            return await node.scheduler.Stats(generate_pb2.SchedulerStatsRequest(), timeout=POLL_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            return None

    async def _resolve(self) -> None:
        """The DNS names' addresses now: new ones join, vanished ones retire (their requests finish)."""
        found: dict[str, str] = {}
        loop = asyncio.get_running_loop()
        for name, port in self.names:
            try:
                infos = await loop.getaddrinfo(name, port, type=socket.SOCK_STREAM)
            except OSError as e:  # no answer this round: keep what we have
                log.warning("resolving %s failed: %s", name, e)
                return
            for family, _, _, _, sockaddr in infos:
                host = f"[{sockaddr[0]}]" if family == socket.AF_INET6 else sockaddr[0]
                found[f"{host}:{port}"] = name
        for address, name in found.items():
            if address not in self.nodes:
                log.info("node %s found (%s)", address, name)
                self._add(address, name)
            self.nodes[address].retired = False
        for address, node in self.nodes.items():
            if address not in found and not node.retired:
                log.info("node %s is gone from DNS: it takes no new requests", address)
                node.retired = True

    def place(self, request_id: str, prompt_ids: Sequence[int]) -> Node:
        """The node for a new request; counted in flight until `release`."""
        candidates = [n for n in self.nodes.values() if n.routable]
        if not candidates:  # none known to be up (joining, or all down): try them all rather than refuse
            candidates = [n for n in self.nodes.values() if not n.retired] or list(self.nodes.values())
        if not candidates:
            raise LookupError("no node is known: DNS found none yet")
        choice = self.router.choose(candidates, prompt_ids, self.block_size())
        node = choice.node
        node.index.add(choice.names)
        node.in_flight += 1
        self.placed[request_id] = node
        self.metrics.routed.inc(node=node.address, reason=choice.reason)
        return node

    def release(self, request_id: str) -> None:
        if (node := self.placed.pop(request_id, None)) is not None:
            node.in_flight -= 1

    def block_size(self) -> int:
        return next((n.stats.block_size for n in self.nodes.values() if n.stats and n.stats.block_size), 0)

    def health(self) -> dict[str, dict]:
        return {address: node.report() for address, node in self.nodes.items()}


def summed(stats: Sequence[generate_pb2.SchedulerStats]) -> generate_pb2.SchedulerStats:
    """Several nodes' stats as one cluster's: counts and times summed, workers listed (each labelled
    with its node), flags any, texts joined; block_size is the nodes' own (they serve one model)."""
    if len(stats) == 1:
        return stats[0]
    total = generate_pb2.SchedulerStats()
    for field in total.DESCRIPTOR.fields:
        values = [getattr(s, field.name) for s in stats]
        if field.is_repeated:
            getattr(total, field.name).extend(w for v in values for w in v)
        elif field.type == field.TYPE_BOOL:
            setattr(total, field.name, any(values))
        elif field.type == field.TYPE_STRING:
            setattr(total, field.name, "; ".join(v for v in values if v))
        elif field.name == "block_size":
            total.block_size = max(values)
        else:
            setattr(total, field.name, sum(values))
    return total
