"""The gateway's router and its view of the nodes (gateway/router.py, gateway/nodes.py), and mutual TLS
between hosts (pulseinfer/common/tls.py): the policies over fake nodes, the node state machine driven
by poll answers without a network, summed stats, and a real grpc.aio server with real certificates."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from starlette.requests import Request
from tls_certs import Certs, make_certs

from pulseinfer.common import grpc_common
from pulseinfer.common.tls import TlsConfig, is_local
from pulseinfer.gateway.core import GatewayCore
from pulseinfer.gateway.http_api import HttpApi
from pulseinfer.gateway.metrics import GatewayMetrics
from pulseinfer.gateway.nodes import DEFAULT_INDEX_BLOCKS, DOWN_AFTER, POLL_S, POLL_TIMEOUT_S, Node, Nodes, summed
from pulseinfer.gateway.router import BlockIndex, Router, RouterConfig
from pulseinfer.gateway.server import GatewayConfig
from pulseinfer.kv_store.prefix_cache import ROOT, chain_hashes
from pulseinfer.proto.pulseinfer.v1 import generate_pb2, generate_pb2_grpc

BLOCK = 16
CALL_TIMEOUT_S = 3.0
TEST_TIMEOUT_S = 20.0  # a test that hangs fails


def run(main: Callable[[], Awaitable[None]]) -> None:
    async def bounded() -> None:
        await asyncio.wait_for(main(), TEST_TIMEOUT_S)

    asyncio.run(bounded())


def names(*labels: str) -> list[bytes]:
    return [label.encode() for label in labels]


def prompt(seed: int, length: int = 2 * BLOCK) -> list[int]:
    """A prompt no other seed shares a first token with."""
    return [seed * 1000 + i for i in range(length)]


def full_names(ids: list[int], block_size: int = BLOCK) -> tuple[bytes, ...]:
    full = len(ids) // block_size
    return tuple(chain_hashes(ids[: full * block_size], block_size, 0, full, ROOT))


# --- BlockIndex ---------------------------------------------------------------------------------


def test_block_index_prefix_stops_at_the_first_missing_name():
    index = BlockIndex(10)
    index.add(names("a", "c", "d"))
    assert index.prefix(names("a", "b", "c", "d")) == 1  # c and d held, but b breaks the chain
    assert index.prefix(names("a", "c", "d")) == 3
    assert index.prefix(names("b", "a")) == 0
    assert index.prefix([]) == 0
    assert len(index) == 3 and b"c" in index and b"b" not in index


def test_block_index_is_bounded_and_forgets_the_least_recently_used():
    index = BlockIndex(3)
    index.add(names("a", "b", "c"))
    index.add(names("d"))
    assert len(index) == 3 and b"a" not in index
    index.add(names("b"))  # re-added: now the most recent
    index.add(names("e"))
    assert b"c" not in index  # the least recently used went, not b
    assert all(name in index for name in names("b", "d", "e"))
    index.add(names("1", "2", "3", "4", "5"))  # more than it holds in one go: the last ones stay
    assert len(index) == 3 and all(name in index for name in names("3", "4", "5"))


def test_block_index_remove_and_clear():
    index = BlockIndex(10)
    index.add(names("a", "b", "c"))
    index.remove(names("b", "never-added"))
    assert len(index) == 2 and b"b" not in index
    assert index.prefix(names("a", "b", "c")) == 1
    index.clear()
    assert len(index) == 0 and index.prefix(names("a")) == 0


# --- Router policies over fake nodes ------------------------------------------------------------


@dataclass
class FakeNode:
    address: str
    in_flight: int = 0
    index: BlockIndex = field(default_factory=lambda: BlockIndex(1 << 20))


def fake_nodes(count: int) -> list[FakeNode]:
    return [FakeNode(f"node{i}") for i in range(count)]


def test_cache_aware_names_the_prompts_full_blocks_only():
    router = Router(RouterConfig())
    nodes = fake_nodes(2)
    ids = prompt(1, 2 * BLOCK + 5)
    choice = router.choose(nodes, ids, BLOCK)
    assert choice.names == tuple(chain_hashes(ids[: 2 * BLOCK], BLOCK, 0, 2, ROOT))
    assert len(choice.names) == 2  # the partial third block is not named
    # the partial block's tokens do not change the names; a full block's do
    assert router.choose(nodes, ids[: 2 * BLOCK] + [7] * 9, BLOCK).names == choice.names
    changed = ids.copy()
    changed[BLOCK] += 1
    other = router.choose(nodes, changed, BLOCK).names
    assert other[0] == choice.names[0] and other[1] != choice.names[1]
    assert router.choose(nodes, ids[: BLOCK - 1], BLOCK).names == ()  # not one full block


def test_cache_aware_sends_a_held_prefix_to_its_node_despite_a_little_more_load():
    router = Router(RouterConfig())
    a, b, c = fake_nodes(3)
    ids = prompt(1, 4 * BLOCK)
    b.index.add(full_names(ids))
    b.in_flight, a.in_flight, c.in_flight = 5, 1, 0
    for _ in range(6):  # whatever the rotation's turn
        choice = router.choose([a, b, c], ids, BLOCK)
        assert (choice.node, choice.reason) == (b, "cache_hit")
    # a longer prompt with the same head: still a hit while more than cache_threshold of it is held
    longer = ids + prompt(2, 2 * BLOCK)
    assert router.choose([a, b, c], longer, BLOCK).node is b  # 4 of 6 blocks held


def test_cache_aware_needs_more_than_the_threshold_held():
    router = Router(RouterConfig(cache_threshold=0.5))
    a, b = fake_nodes(2)
    ids = prompt(1, 4 * BLOCK)
    a.index.add(full_names(ids)[:2])  # exactly half: not more than the threshold
    b.index.add(names("x"))  # b has the bigger index, so "room" would pick a too: make room pick b
    a.index.add(names("y", "z"))
    choice = router.choose([a, b], ids, BLOCK)
    assert (choice.node, choice.reason) == (b, "room")
    a.index.add(full_names(ids)[:3])  # three of four
    choice = router.choose([a, b], ids, BLOCK)
    assert (choice.node, choice.reason) == (a, "cache_hit")


def test_cache_aware_balances_when_load_is_imbalanced_by_both_thresholds():
    config = RouterConfig(balance_abs_threshold=32, balance_rel_threshold=1.5)
    router = Router(config)
    holder, idle = fake_nodes(2)
    ids = prompt(1, 4 * BLOCK)
    holder.index.add(full_names(ids))
    holder.in_flight, idle.in_flight = 40, 0  # 40 more, and more than 1.5 times
    for _ in range(4):
        choice = router.choose([holder, idle], ids, BLOCK)
        assert (choice.node, choice.reason) == (idle, "balance")
        assert choice.names == full_names(ids)
    holder.in_flight, idle.in_flight = 110, 75  # 35 more, but not 1.5 times: balanced enough
    choice = router.choose([holder, idle], ids, BLOCK)
    assert (choice.node, choice.reason) == (holder, "cache_hit")
    holder.in_flight, idle.in_flight = 20, 0  # 1.5 times, but only 20 more
    choice = router.choose([holder, idle], ids, BLOCK)
    assert (choice.node, choice.reason) == (holder, "cache_hit")


def test_cache_aware_places_an_unknown_prompt_for_room():
    router = Router(RouterConfig())
    a, b, c = fake_nodes(3)
    a.index.add(names("1", "2", "3", "4", "5"))
    b.index.add(names("6"))
    c.index.add(names("7", "8"))
    for _ in range(6):
        choice = router.choose([a, b, c], prompt(9), BLOCK)
        assert (choice.node, choice.reason) == (b, "room")


def test_unknown_block_size_falls_back_to_least_load():
    router = Router(RouterConfig())
    a, b = fake_nodes(2)
    ids = prompt(1, 4 * BLOCK)
    a.index.add(full_names(ids))
    a.in_flight, b.in_flight = 3, 1
    choice = router.choose([a, b], ids, 0)
    assert (choice.node, choice.reason, choice.names) == (b, "least_load", ())


@pytest.mark.parametrize("count", [2, 3])
def test_cache_aware_spreads_distinct_prompts(count: int):
    router = Router(RouterConfig())
    nodes = fake_nodes(count)
    placed: dict[int, FakeNode] = {}
    for seed in range(12 * count):
        choice = router.choose(nodes, prompt(seed), BLOCK)  # as Nodes.place does
        choice.node.index.add(choice.names)
        choice.node.in_flight += 1
        placed[seed] = choice.node
    counts = [sum(1 for node in placed.values() if node is n) for n in nodes]
    assert all(counts), counts
    assert max(counts) - min(counts) <= 1, counts
    for seed, node in placed.items():  # each prompt again: to the node that holds it
        choice = router.choose(nodes, prompt(seed), BLOCK)
        assert (choice.node, choice.reason) == (node, "cache_hit")


def test_round_robin_cycles():
    router = Router(RouterConfig(route="round_robin"))
    nodes = fake_nodes(3)
    nodes[0].in_flight = 100  # ignored
    chosen = [router.choose(nodes, prompt(i), BLOCK) for i in range(7)]
    assert [c.node.address for c in chosen] == ["node0", "node1", "node2"] * 2 + ["node0"]
    assert {c.reason for c in chosen} == {"round_robin"} and all(c.names == () for c in chosen)


def test_least_load_picks_the_least_loaded_and_rotates_ties():
    router = Router(RouterConfig(route="least_load"))
    a, b, c = fake_nodes(3)
    a.in_flight, b.in_flight, c.in_flight = 2, 5, 1
    choice = router.choose([a, b, c], prompt(1), BLOCK)
    assert (choice.node, choice.reason, choice.names) == (c, "least_load", ())
    a.in_flight, b.in_flight, c.in_flight = 3, 0, 0
    chosen = [router.choose([a, b, c], prompt(i), BLOCK).node.address for i in range(6)]
    assert set(chosen) == {"node1", "node2"}, chosen


@pytest.mark.parametrize(
    "fields",
    [
        {"route": "random"},
        {"cache_threshold": -0.1},
        {"cache_threshold": 1.01},
        {"balance_rel_threshold": 0.99},
        {"balance_abs_threshold": -1},
        {"index_blocks": 0},
    ],
)
def test_router_config_rejects(fields: dict):
    with pytest.raises(ValueError):
        RouterConfig(**fields)


def test_router_config_accepts_its_bounds():
    RouterConfig(route="least_load", cache_threshold=0.0, balance_rel_threshold=1.0, balance_abs_threshold=0, index_blocks=1)
    RouterConfig(route="round_robin", cache_threshold=1.0)


# --- Nodes and their state, driven by poll answers ------------------------------------------------


def answer(**fields) -> generate_pb2.SchedulerStats:
    values = {"workers_alive": 1, "kv_store_alive": True, "block_size": BLOCK, "device_blocks_total": 100, "host_blocks_total": 400}
    return generate_pb2.SchedulerStats(**{**values, **fields})


def make_nodes(router: RouterConfig | None = None, targets: str = "127.0.0.1:1,127.0.0.1:2") -> Nodes:
    """Two nodes nothing listens for: they are driven by `polled`, never polled."""
    return Nodes(targets, router or RouterConfig(), lambda address, server_name: grpc.aio.insecure_channel(address), GatewayMetrics())


def submit(node: Node, request_id: str):
    return node.session.submit(generate_pb2.ScheduleRequest(request_id=request_id, prompt_ids=[1, 2, 3]))


def test_a_node_misses_polls_goes_down_and_rejoins():
    async def main() -> None:
        nodes = make_nodes()
        node = nodes.nodes["127.0.0.1:1"]
        try:
            assert node.state == "joining" and not node.routable
            node.polled(answer())
            assert node.state == "up" and node.routable and node.problems == []
            node.index.add(names("a", "b"))
            # no await from here to the last miss: the request's own stream cannot fail it first
            submitted = submit(node, "r1")
            node.polled(None)
            assert node.state == "unreachable" and not node.routable and node.stats is None
            assert submitted.inbox.empty()  # one miss: its requests may still be running
            assert len(node.index) == 2
            for _ in range(DOWN_AFTER - 1):
                assert node.state == "unreachable"
                node.polled(None)
            assert node.state == "down" and not node.routable
            assert len(node.index) == 0
            lost = await asyncio.wait_for(submitted.first(), CALL_TIMEOUT_S)
            assert lost.finish_reason == generate_pb2.FINISH_REASON_ERROR
            assert "lost node 127.0.0.1:1" in lost.error
            assert node.session.lost_at is not None
            node.polled(None)  # still down
            assert node.state == "down"
            node.polled(answer())
            assert node.state == "up" and node.routable and node.missed == 0
            assert len(node.index) == 0  # rejoined cold
        finally:
            await nodes.close()

    run(main)


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"draining": True}, "draining"),
        ({"workers_alive": 0}, "no worker is alive"),
        ({"kv_store_alive": False}, "the kv_store is not answering"),
        ({"host_integrity_error": "block 3 freed twice"}, "block 3 freed twice"),
    ],
)
def test_a_node_that_answers_but_cannot_serve_is_unhealthy(fields: dict, problem: str):
    async def main() -> None:
        nodes = make_nodes()
        node = nodes.nodes["127.0.0.1:1"]
        try:
            node.polled(answer(**fields))
            assert node.state == "unhealthy" and not node.routable
            assert problem in node.problems
            node.polled(answer())
            assert node.state == "up" and node.routable
        finally:
            await nodes.close()

    run(main)


def test_the_index_capacity_follows_the_nodes_blocks():
    async def main() -> None:
        nodes = make_nodes()
        bounded = make_nodes(RouterConfig(index_blocks=50))
        try:
            node = nodes.nodes["127.0.0.1:1"]
            assert node.index.capacity == DEFAULT_INDEX_BLOCKS
            node.polled(answer(device_blocks_total=100, host_blocks_total=400))
            assert node.index.capacity == 500
            node.index.add([i.to_bytes(4, "little") for i in range(600)])
            assert len(node.index) == 500
            node.polled(answer(device_blocks_total=0, host_blocks_total=0))  # no capacity given: kept
            assert node.index.capacity == 500
            small = bounded.nodes["127.0.0.1:1"]
            assert small.index.capacity == 50
            small.polled(answer(device_blocks_total=100, host_blocks_total=400))
            assert small.index.capacity == 50  # RouterConfig.index_blocks bounds it
        finally:
            await nodes.close()
            await bounded.close()

    run(main)


def test_place_avoids_nodes_that_are_not_routable():
    async def main() -> None:
        for route in ("cache_aware", "least_load", "round_robin"):
            nodes = make_nodes(RouterConfig(route=route))
            first, second = nodes.nodes["127.0.0.1:1"], nodes.nodes["127.0.0.1:2"]
            try:
                first.polled(answer())
                second.polled(answer(draining=True))
                for i in range(8):
                    assert nodes.place(f"r{i}", prompt(i)) is first, route
                assert (first.in_flight, second.in_flight) == (8, 0)
                second.polled(answer())
                first.polled(None)  # unreachable
                for i in range(8, 12):
                    assert nodes.place(f"r{i}", prompt(i)) is second, route
                for i in range(12):
                    nodes.release(f"r{i}")
                assert (first.in_flight, second.in_flight) == (0, 0)
                nodes.release("r0")  # released twice, or never placed: nothing happens
                nodes.release("unknown")
                assert (first.in_flight, second.in_flight) == (0, 0)
            finally:
                await nodes.close()

    run(main)


def test_place_tries_every_node_when_none_is_routable():
    async def main() -> None:
        nodes = make_nodes()
        first, second = nodes.nodes["127.0.0.1:1"], nodes.nodes["127.0.0.1:2"]
        try:
            assert not first.routable and not second.routable  # joining
            chosen = {nodes.place(f"j{i}", prompt(i)).address for i in range(4)}
            assert chosen == {first.address, second.address}
            for node in (first, second):
                for _ in range(DOWN_AFTER):
                    node.polled(None)
                assert node.state == "down"
            chosen = {nodes.place(f"d{i}", prompt(i)).address for i in range(4)}
            assert chosen == {first.address, second.address}
            assert first.in_flight + second.in_flight == 8
        finally:
            await nodes.close()

    run(main)


def test_a_node_whose_session_broke_since_its_last_answer_is_not_routable():
    async def main() -> None:
        nodes = make_nodes()
        first, second = nodes.nodes["127.0.0.1:1"], nodes.nodes["127.0.0.1:2"]
        try:
            first.polled(answer())
            second.polled(answer())
            submitted = submit(first, "r1")
            first.session.fail("the scheduler was killed")  # what a broken stream does, at once
            assert (await asyncio.wait_for(submitted.first(), CALL_TIMEOUT_S)).finish_reason == generate_pb2.FINISH_REASON_ERROR
            assert first.state == "up" and not first.routable  # up until the next poll, but not routed to
            for i in range(4):
                assert nodes.place(f"r{i}", prompt(i)) is second
            first.polled(answer())  # answered since: routable again
            assert first.routable
            assert {nodes.place(f"s{i}", prompt(100 + i)).address for i in range(6)} == {first.address, second.address}
        finally:
            await nodes.close()

    run(main)


class StallingScheduler(generate_pb2_grpc.SchedulerServicer):
    """A node's scheduler that answers Stats at once, or while stalled (`resume` clear) when the stall
    ends; it holds Session streams open answering nothing, and has no block events."""

    def __init__(self):
        self.resume = asyncio.Event()
        self.resume.set()
        self.stalled_calls: list[float] = []  # when each Stats call that waited for the stall arrived

    async def Stats(self, request, context):  # noqa: N802 - the service's names
        if not self.resume.is_set():
            self.stalled_calls.append(time.monotonic())
            await self.resume.wait()
        return answer()

    async def Session(self, request_iterator, context):  # noqa: N802
        async for _ in request_iterator:
            pass

    async def BlockEvents(self, request, context):  # noqa: N802
        pass


def test_a_client_polling_health_fast_does_not_mark_a_stalled_node_down():
    """/health polls the nodes on demand, and only the periodic poll moves a node's state: a node that
    stalls longer than a poll's timeout, but too briefly for DOWN_AFTER periodic polls in a row to miss
    it, is not marked down (its requests failed) by a client asking /health 50 times a second."""
    stall_s = POLL_TIMEOUT_S + POLL_S  # periodic polls miss at most one; on-demand polls, a second's worth

    async def main() -> None:
        scheduler = StallingScheduler()
        server = grpc.aio.server()
        generate_pb2_grpc.add_SchedulerServicer_to_server(scheduler, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        nodes = make_nodes(targets=f"127.0.0.1:{port}")
        node = nodes.nodes[f"127.0.0.1:{port}"]
        meta = SimpleNamespace(tokenizer=None, config=SimpleNamespace(max_position=64, vocab_size=26))
        api = HttpApi(GatewayCore(meta, "fake", nodes, nodes.metrics), None, 16)
        request = Request({"type": "http", "method": "GET", "path": "/health", "headers": [], "query_string": b""})
        states: list[str] = []

        async def health() -> None:
            reply = json.loads((await api.health(request)).body)
            states.append(reply["nodes"][node.address]["state"])

        async def clients(seconds: float) -> None:  # 50 a second, each without waiting for the ones before
            loop = asyncio.get_running_loop()
            end, asked = loop.time() + seconds, []
            while loop.time() < end:
                asked.append(asyncio.create_task(health()))
                states.append(node.state)
                await asyncio.sleep(0.02)
            await asyncio.gather(*asked)

        try:
            await nodes.start()
            assert node.state == "up"
            submitted = submit(node, "r1")
            await clients(0.2)
            scheduler.resume.clear()
            await clients(stall_s)
            resumed = time.monotonic()
            scheduler.resume.set()
            await clients(POLL_S + POLL_TIMEOUT_S)  # the periodic poll sees it answer again
            missed = [t for t in scheduler.stalled_calls if t < resumed - POLL_TIMEOUT_S]
            assert len(missed) > 2 * DOWN_AFTER  # the stall made on-demand polls miss, many in a row
            assert "down" not in states
            assert node.state == "up" and node.routable
            assert submitted.inbox.empty() and node.session.lost_at is None  # its request was not failed
        finally:
            await nodes.close()
            await server.stop(None)

    run(main)


def test_place_routes_a_repeated_prompt_to_the_node_that_holds_it():
    async def main() -> None:
        nodes = make_nodes()
        try:
            for node in nodes.nodes.values():
                node.polled(answer())
            assert nodes.block_size() == BLOCK
            ids = prompt(1, 3 * BLOCK + 2)
            home = nodes.place("a", ids)
            assert len(home.index) == 3
            nodes.release("a")
            for i in range(4):
                assert nodes.place(f"again{i}", ids) is home
            routed = "pulseinfer:router_requests_total"
            assert nodes.metrics.value(routed, node=home.address, reason="room") == 1
            assert nodes.metrics.value(routed, node=home.address, reason="cache_hit") == 4
            other = next(n for n in nodes.nodes.values() if n is not home)
            assert nodes.place("new", prompt(2)) is other  # the emptier index takes a new prompt
        finally:
            await nodes.close()

    run(main)


@pytest.mark.parametrize(
    "targets",
    ["", "127.0.0.1:1,,127.0.0.1:2", "127.0.0.1:1, ", "dns:pulseinfer-node", "dns:pulseinfer-node:http", "dns::50052"],
)
def test_nodes_rejects_bad_targets(targets: str):
    async def main() -> None:
        with pytest.raises(ValueError, match="--nodes"):
            make_nodes(targets=targets)

    run(main)


def test_nodes_parses_named_and_dns_targets():
    async def main() -> None:
        nodes = make_nodes(targets=" 127.0.0.1:1 , dns:pulseinfer-node:50052,unix:///tmp/x.sock")
        try:
            assert list(nodes.nodes) == ["127.0.0.1:1", "unix:///tmp/x.sock"]
            assert nodes.names == [("pulseinfer-node", 50052)]
        finally:
            await nodes.close()

    run(main)


# --- summed -------------------------------------------------------------------------------------


def test_summed_adds_counts_lists_workers_and_keeps_the_block_size():
    a = answer(
        running=1, waiting=2, device_blocks_total=100, device_blocks_free=10, cpu_s=0.5, kv_store_alive=False, node_name="a",
        workers=[generate_pb2.WorkerStats(worker_id=0, running=1, node_name="a")],
    )  # fmt: skip
    b = answer(
        running=3, waiting=0, device_blocks_total=50, device_blocks_free=5, cpu_s=0.25, draining=True, node_name="b",
        host_integrity_error="bad block",
        workers=[generate_pb2.WorkerStats(worker_id=0, running=2, node_name="b"), generate_pb2.WorkerStats(worker_id=1, node_name="b")],
    )  # fmt: skip
    total = summed([a, b])
    assert (total.running, total.waiting, total.workers_alive) == (4, 2, 2)
    assert (total.device_blocks_total, total.device_blocks_free, total.host_blocks_total) == (150, 15, 800)
    assert total.cpu_s == pytest.approx(0.75)
    assert [(w.node_name, w.worker_id, w.running) for w in total.workers] == [("a", 0, 1), ("b", 0, 2), ("b", 1, 0)]
    assert total.kv_store_alive and total.draining and not total.overlap
    assert total.block_size == BLOCK
    assert total.node_name == "a; b" and total.host_integrity_error == "bad block"
    one = answer(running=7)
    assert summed([one]) is one


# --- mutual TLS ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> tuple[Certs, Certs]:
    """The cluster's certificates, and another CA's."""
    root = tmp_path_factory.mktemp("tls")
    return make_certs(root / "cluster", ["node1"], ["127.0.0.1"]), make_certs(root / "stranger", ["node1"], ["127.0.0.1"])


def tls(c: Certs, ca: Path | None = None) -> TlsConfig:
    return TlsConfig(str(c.cert), str(c.key), str(ca or c.ca))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def check(channel: grpc.aio.Channel) -> int:
    async with channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=CALL_TIMEOUT_S)
        return reply.status


async def refused(channel: grpc.aio.Channel) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await check(channel)
    return e.value.code()


def test_mutual_tls(certs: tuple[Certs, Certs]):
    cluster, stranger = certs

    async def main() -> None:
        address = f"127.0.0.1:{free_port()}"
        server = grpc_common.server()
        health = grpc_common.add_health_and_reflection(server, [])
        tls(cluster).add_port(server, address)
        await server.start()
        try:
            await grpc_common.set_serving(health, [], True)
            serving = health_pb2.HealthCheckResponse.SERVING
            assert await check(tls(cluster).channel(address)) == serving
            assert await check(tls(cluster).channel(address, server_name="node1")) == serving  # the name, at an IP
            by_name = address.replace("127.0.0.1", "localhost")  # a name the certificate does not carry
            assert await check(tls(cluster).channel(by_name, server_name="node1")) == serving
            failures = await asyncio.gather(
                refused(grpc.aio.insecure_channel(address)),  # plaintext
                refused(grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=cluster.ca.read_bytes()))),
                refused(tls(stranger, ca=cluster.ca).channel(address)),  # trusts the server; the server does not trust it
                refused(tls(stranger).channel(address)),  # trusts neither way
                refused(tls(cluster).channel(address, server_name="other")),  # the certificate does not name "other"
                refused(tls(cluster).channel(by_name)),
            )
            assert all(code == grpc.StatusCode.UNAVAILABLE for code in failures), failures
        finally:
            await server.stop(None)

    run(main)


def test_plaintext_listen_is_refused_off_loopback():
    async def main() -> None:
        server = grpc_common.server()
        try:
            with pytest.raises(ValueError, match="--listen"):
                TlsConfig().add_port(server, "0.0.0.0:0")
            TlsConfig(insecure=True).add_port(server, f"127.0.0.1:{free_port()}")
        finally:
            await server.stop(None)

    run(main)


@pytest.mark.parametrize(
    "fields",
    [
        {"tls_cert": "c.pem"},
        {"tls_cert": "c.pem", "tls_key": "k.pem"},
        {"tls_key": "k.pem", "tls_ca": "ca.pem"},
        {"tls_cert": "c.pem", "tls_key": "k.pem", "tls_ca": "ca.pem", "insecure": True},
    ],
)
def test_tls_config_rejects(fields: dict):
    with pytest.raises(ValueError):
        TlsConfig(**fields)


def test_check_plaintext():
    plain = TlsConfig()
    assert not plain.enabled
    for address in ("10.0.0.5:50052", "dns-name:1", "0.0.0.0:1", "[2001:db8::1]:1", "localhost.example.com:1"):
        with pytest.raises(ValueError, match="--nodes"):
            plain.check_plaintext(address, "--nodes")
        TlsConfig(insecure=True).check_plaintext(address, "--nodes")
        TlsConfig("c.pem", "k.pem", "ca.pem").check_plaintext(address, "--nodes")
    for address in ("127.0.0.1:1", "127.3.2.1:1", "localhost:1", "[::1]:1", "unix:///x", "unix:relative.sock"):
        assert is_local(address)
        plain.check_plaintext(address, "--nodes")


def test_gateway_refuses_plaintext_to_remote_nodes():
    files = {"tls_cert": "c.pem", "tls_key": "k.pem", "tls_ca": "ca.pem"}
    for nodes in ("10.0.0.5:50052", "127.0.0.1:50052,10.0.0.5:50052", "dns:pulseinfer-node:50052"):
        with pytest.raises(ValueError, match="--nodes"):
            GatewayConfig(nodes=nodes)
        GatewayConfig(nodes=nodes, tls=TlsConfig(**files))
        GatewayConfig(nodes=nodes, tls=TlsConfig(insecure=True))
    GatewayConfig(nodes="127.0.0.1:50052,dns:localhost:50052,unix:///tmp/s")
