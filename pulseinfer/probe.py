"""Readiness probes, used by `pulseinfer serve` and as docker-compose healthchecks:

    python -m pulseinfer.probe http http://127.0.0.1:8000/health
    python -m pulseinfer.probe grpc unix:///run/pulseinfer/scheduler.sock   # grpc.health.v1, overall status
    python -m pulseinfer.probe kv_store ipc:///run/pulseinfer/kv_store
    python -m pulseinfer.probe workers unix:///run/pulseinfer/scheduler.sock --min 1 [--worker-id 0]
    python -m pulseinfer.probe drain http://127.0.0.1:9400 [--timeout-s 120]   # a node: drain, wait for its requests

gRPC addresses are HOST:PORT or unix://PATH; kv_store addresses ipc://PATH or tcp://HOST:PORT.

Exit code 0 when ready (drain: when the node has no request left), 1 otherwise (with the reason on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request

import grpc
import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pulseinfer.kv_store.client import KVStoreClient, KVStoreUnavailable
from pulseinfer.proto.pulseinfer.v1 import generate_pb2, generate_pb2_grpc, kv_store_pb2


class NotReady(Exception):
    pass


def http(url: str, timeout_s: float = 2.0) -> None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            response.read()
    except urllib.error.HTTPError as e:
        raise NotReady(f"{url}: HTTP {e.code} {e.read().decode(errors='replace')}") from None
    except (urllib.error.URLError, OSError) as e:
        raise NotReady(f"{url}: {e}") from None


def grpc_health(address: str, timeout_s: float = 2.0) -> None:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError as e:
            raise NotReady(f"{address}: {e.code().name}") from None
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        raise NotReady(f"{address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")


def kv_store(address: str, timeout_s: float = 2.0) -> kv_store_pb2.KVStoreStats:
    client = KVStoreClient(zmq.Context.instance(), address, timeout_s)
    try:
        return client.stats()
    except KVStoreUnavailable as e:
        raise NotReady(str(e)) from None
    finally:
        client.close()


def workers(address: str, minimum: int, worker_id: int | None = None, timeout_s: float = 2.0) -> generate_pb2.SchedulerStats:
    with grpc.insecure_channel(address) as channel:
        try:
            stats = generate_pb2_grpc.SchedulerStub(channel).Stats(generate_pb2.SchedulerStatsRequest(), timeout=timeout_s)
        except grpc.RpcError as e:
            raise NotReady(f"scheduler at {address}: {e.code().name}") from None
    if stats.workers_alive < minimum:
        raise NotReady(f"{stats.workers_alive} of {minimum} workers alive")
    if worker_id is not None and worker_id not in {w.worker_id for w in stats.workers}:
        raise NotReady(f"worker {worker_id} is not registered with the scheduler")
    return stats


def drain(url: str, timeout_s: float) -> None:
    """Asks a node (its --metrics-listen URL) to take no new request, then waits until none runs."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(urllib.request.Request(f"{url}/drain", method="POST"), timeout=2.0) as response:
                running = json.load(response)["running"]
        except (urllib.error.URLError, OSError, ValueError, KeyError) as e:
            raise NotReady(f"{url}/drain: {e}") from None
        if running == 0:
            return
        if time.monotonic() > deadline:
            raise NotReady(f"{running} requests still running after {timeout_s:.0f} s")
        time.sleep(1.0)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pulseinfer.probe", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("kind", choices=("http", "grpc", "kv_store", "workers", "drain"))
    p.add_argument("address")
    p.add_argument("--min", type=int, default=1, help="workers: how many must be alive")
    p.add_argument("--worker-id", type=int, help="workers: this one must be alive")
    p.add_argument("--timeout-s", type=float, default=120.0, help="drain: how long to wait for running requests")
    return p


def main() -> int:
    args = parser().parse_args()
    probes = {
        "http": lambda: http(args.address),
        "grpc": lambda: grpc_health(args.address),
        "kv_store": lambda: kv_store(args.address),
        "workers": lambda: workers(args.address, args.min, args.worker_id),
        "drain": lambda: drain(args.address, args.timeout_s),
    }
    try:
        probes[args.kind]()
    except NotReady as e:
        print(f"not ready: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
