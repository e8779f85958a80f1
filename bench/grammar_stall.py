"""What a large structured output costs the streams beside it: a greedy stream's largest gap between
two events while a request under a JSON schema of ~500 KB runs, against the same stream alone; and
the gateway's event loop meanwhile, as the slowest of GET /v1/models sent every 20 ms.

    pulseinfer bench grammar-stall [--rounds 3] [--schema-kb 500] [--stream-tokens 200] [--json OUT]

Each round streams alone, then beside a request under a schema new to the server (the gateway
checks it in a helper process, the worker compiles it on its grammar thread), then beside a request
under that schema again (checked again; the worker copies the matcher it compiled). The schema
request is sent once the stream has its 10th event. Starts a `pulseinfer serve --workers 1` of its
own on free ports (no API key) and stops it at the end. docs/structured_outputs.md has a run's table.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from pulseinfer.bench.cluster import ServingCluster
from pulseinfer.bench.timing import report

STREAM = {"prompt": "The history of the printing press", "temperature": 0, "ignore_eos": True, "stream": True}
STEADY_EVENTS = 10  # the schema request is sent once the stream has this many events
PROBE_S = 0.02  # between two probes of the gateway's event loop: back to back, they would load a 2-core host


@dataclass(frozen=True)
class GrammarStallBenchConfig:
    rounds: int = 3
    schema_kb: int = 500
    stream_tokens: int = 200


def large_schema(kilobytes: int, prefix: str) -> dict:
    """An object schema of as many small object properties (named `prefix`_i) as make `kilobytes` of
    JSON (2,600 for 500 KB: llguidance refuses ~4,000 of this shape, past its grammar's 65k symbols)."""
    field = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "count": {"type": "integer", "minimum": 0},
            "kind": {"enum": ["a", "b"]},
        },
        "required": ["name"],
    }
    count = kilobytes * 1000 // (len(json.dumps(field)) + len(prefix) + 10)
    return {"type": "object", "properties": {f"{prefix}_{i}": field for i in range(count)}, "required": [f"{prefix}_0"]}


def post(cluster: ServingCluster, body: dict) -> http.client.HTTPResponse:
    connection = http.client.HTTPConnection("127.0.0.1", cluster.http_port, timeout=600)
    connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return connection.getresponse()


def stream_gap(cluster: ServingCluster, tokens: int, steady: threading.Event | None = None) -> float:
    """The largest gap in seconds between two events of a greedy stream (sets `steady` at its
    STEADY_EVENTS-th event)."""
    arrivals = []
    for line in post(cluster, STREAM | {"max_tokens": tokens}):
        if line.startswith(b"data: {"):
            arrivals.append(time.perf_counter())
            if steady is not None and len(arrivals) == STEADY_EVENTS:
                steady.set()
    return max(b - a for a, b in zip(arrivals, arrivals[1:]))


def slowest_models(cluster: ServingCluster, done: threading.Event) -> float:
    """The slowest GET /v1/models, one every PROBE_S until `done`, in seconds: the gateway's event loop."""
    slowest = 0.0
    connection = http.client.HTTPConnection("127.0.0.1", cluster.http_port, timeout=600)
    while not done.wait(PROBE_S):
        started = time.perf_counter()
        connection.request("GET", "/v1/models")
        connection.getresponse().read()
        slowest = max(slowest, time.perf_counter() - started)
    connection.close()
    return slowest


def beside_schema(cluster: ServingCluster, tokens: int, schema: dict) -> tuple[float, float, float]:
    """The stream's largest gap with the schema request sent into it, that request's time, and the
    slowest /v1/models while it ran."""
    steady, done = threading.Event(), threading.Event()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        gap = pool.submit(stream_gap, cluster, tokens, steady)
        steady.wait(120)
        models = pool.submit(slowest_models, cluster, done)
        started = time.perf_counter()
        response = post(cluster, {"prompt": "A record:", "max_tokens": 4, "structured_outputs": {"json": schema}})
        body = response.read()
        took = time.perf_counter() - started
        done.set()
        if response.status != 200:
            raise RuntimeError(f"the schema request got {response.status}: {body[:300]!r}")
        return gap.result(), took, models.result()


def main(args: GrammarStallBenchConfig, json_path: Path | None = None) -> int:
    cluster = ServingCluster("--workers", "1")
    try:
        stream_gap(cluster, 16)  # warm: the first requests pay for compiles and caches
        alone, fresh, repeated = [], [], []
        for round_ in range(args.rounds):
            schema = large_schema(args.schema_kb, f"round{round_}")
            alone.append(stream_gap(cluster, args.stream_tokens))
            fresh.append(beside_schema(cluster, args.stream_tokens, schema))
            repeated.append(beside_schema(cluster, args.stream_tokens, schema))
    finally:
        cluster.stop()
    results = {"schema_bytes": len(json.dumps(schema)), "alone_max_gap_ms_median": statistics.median(alone) * 1e3}
    for name, runs in (("fresh", fresh), ("repeated", repeated)):
        gaps, request_s, models = zip(*runs)
        results |= {
            f"{name}_max_gap_ms_median": statistics.median(gaps) * 1e3,
            f"{name}_request_s_median": statistics.median(request_s),
            f"{name}_models_slowest_ms": max(models) * 1e3,
        }
    report(args, results, json_path, 32)
    return 0
