"""The gateway's /metrics (gateway/metrics.py, on prometheus_client): the families dashboards read keep
their names, types and labels (tests/data/metric_names.txt), the nodes' stats are read at scrape time,
each gateway counts in its own registry, and the endpoint names the exposition's content type."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from types import SimpleNamespace

import grpc
from prometheus_client.parser import text_string_to_metric_families
from starlette.requests import Request

from pulseinfer.gateway.core import GatewayCore
from pulseinfer.gateway.http_api import HttpApi
from pulseinfer.gateway.metrics import CONTENT_TYPE_LATEST, ClusterMetrics, GatewayMetrics
from pulseinfer.gateway.nodes import Nodes
from pulseinfer.gateway.router import RouterConfig
from pulseinfer.proto.pulseinfer.v1 import generate_pb2

PINNED = Path(__file__).parent / "data" / "metric_names.txt"


def stats(workers: int = 2) -> generate_pb2.SchedulerStats:
    listed = [
        generate_pb2.WorkerStats(
            worker_id=i, node_name="n1:50052" if i else "", running=2, steps=10 + i, prefix_queried_tokens=8, prefix_hit_tokens=2
        )
        for i in range(workers)
    ]
    return generate_pb2.SchedulerStats(
        running=3, workers_alive=workers, workers=listed, device_blocks_total=200, device_blocks_free=50, host_block_bytes=4096
    )


def every_metric_used() -> GatewayMetrics:
    m = GatewayMetrics()
    m.set_cluster(stats())
    for histogram in (m.ttft, m.itl, m.e2e):
        histogram.observe(0.03)
    for counter in (m.prompt_tokens, m.prompt_tokens_scored, m.generation_tokens):
        counter.inc(5)
    m.finished.inc(finished_reason="stop")
    m.errors.inc(code="400")
    m.grammar_checks.inc(result="ok")
    m.routed.inc(node="a:1", reason="cache_hit")
    m.node_up.set(1, node="a:1")
    m.index_blocks.set(5, node="a:1")
    m.block_events.inc(3, node="a:1")
    return m


def families(text: str) -> dict[str, tuple[str, str]]:
    """NAME -> (TYPE, its samples' label names but le, comma-joined or -), from the text exposition."""
    found: dict[str, list] = {}
    name = None
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            found[name] = [kind, set()]
        elif line and not line.startswith("#"):
            labels = re.findall(r'(\w+)="', line.rsplit(" ", 1)[0].partition("{")[2])
            found[name][1].update(label for label in labels if label != "le")
    return {name: (kind, ",".join(sorted(labels)) or "-") for name, (kind, labels) in found.items()}


def test_the_exported_families_keep_their_names_types_and_labels():
    pinned = {}
    for line in PINNED.read_text().splitlines():
        if line and not line.startswith("#"):
            name, kind, labels = line.split(" ")
            pinned[name] = (kind, labels)
    text = every_metric_used().render()
    assert families(text) == pinned
    assert "_created" not in text  # prometheus_client's creation-time samples are not exported
    parsed = {f.name: f.type for f in text_string_to_metric_families(text)}  # prometheus_client reads it back
    assert parsed["pulseinfer:steps"] == "counter" and parsed["pulseinfer:time_to_first_token_seconds"] == "histogram"
    node_metrics = ClusterMetrics()  # a node's own /metrics: the scheduler's families only
    node_metrics.set_cluster(stats())
    node = families(node_metrics.render())
    assert node == {name: (kind, labels) for name, (kind, labels) in pinned.items() if name in node} and len(node) == 63


def test_scheduler_stats_are_read_at_scrape_time():
    m = GatewayMetrics()
    assert "\npulseinfer:num_requests_running " not in m.render()  # no snapshot yet: HELP and TYPE only
    m.set_cluster(stats(workers=2))
    assert m.value("pulseinfer:num_requests_running") == 3 and m.value("pulseinfer:gpu_cache_usage_perc") == 0.75
    assert m.value("pulseinfer:steps_total", worker="n1:50052/1") == 11
    assert m.value("pulseinfer:prefix_cache_hit_rate", worker="0") == 0.25
    m.set_cluster(stats(workers=1))  # a worker gone: its series with it
    assert m.value("pulseinfer:steps_total", worker="0") == 10 and m.value("pulseinfer:steps_total", worker="n1:50052/1") is None


def test_each_gateway_counts_in_its_own_registry():
    first, second = GatewayMetrics(), GatewayMetrics()
    first.generation_tokens.inc(7)
    first.routed.inc(node="a:1", reason="room")
    first.ttft.observe(0.5)
    assert first.value("pulseinfer:generation_tokens_total") == 7 and second.value("pulseinfer:generation_tokens_total") == 0
    assert first.value("pulseinfer:router_requests_total", node="a:1", reason="room") == 1
    assert second.value("pulseinfer:router_requests_total", node="a:1", reason="room") is None
    assert second.value("pulseinfer:time_to_first_token_seconds_count") == 0


def test_the_metrics_endpoint_serves_the_exposition_with_its_content_type():
    async def main() -> None:
        metrics = GatewayMetrics()
        nodes = Nodes("127.0.0.1:1", RouterConfig(), lambda address, server_name: grpc.aio.insecure_channel(address), metrics)
        meta = SimpleNamespace(tokenizer=None, config=SimpleNamespace(max_position=64, vocab_size=26))
        api = HttpApi(GatewayCore(meta, "fake", nodes, metrics), None, 16)
        try:
            metrics.generation_tokens.inc(2)
            response = await api.metrics(Request({"type": "http", "method": "GET", "path": "/metrics", "headers": [], "query_string": b""}))
            assert response.headers["content-type"] == CONTENT_TYPE_LATEST
            assert "\npulseinfer:generation_tokens_total 2.0\n" in response.body.decode()
        finally:
            await nodes.close()

    asyncio.run(main())
