"""A node's status over plain HTTP (`pulseinfer node --metrics-listen`), read-only but for drain:

    GET  /metrics  Prometheus text: queue, running, KV usage of both tiers, prefix-cache counters
    GET  /health   200 while workers are alive, the kv_store answers and the node is not draining; else 503
    POST /drain    (from this host only) new requests are refused from now on; answers how many still run (Kubernetes preStop:
                   `python -m pulseinfer.probe drain http://127.0.0.1:9400` waits for 0)

It asks the node's scheduler over its unix socket, so it works whatever TLS the node's --listen uses."""

from __future__ import annotations

import ipaddress
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc

from pulseinfer.gateway.metrics import CONTENT_TYPE_LATEST, ClusterMetrics
from pulseinfer.messages.wire import health_problems
from pulseinfer.proto.pulseinfer.v1 import generate_pb2, generate_pb2_grpc

log = logging.getLogger("launcher")
ASK_TIMEOUT_S = 1.0
JSON = "application/json"


class NodeStatus:
    def __init__(self, address: str, scheduler: str):
        host, port = address.rsplit(":", 1)
        self.channel = grpc.insecure_channel(scheduler)
        self.scheduler = generate_pb2_grpc.SchedulerStub(self.channel)
        self.server = ThreadingHTTPServer((host.strip("[]"), int(port)), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="node-status", daemon=True)

    def start(self) -> None:
        self.thread.start()
        log.info("node status on http://%s:%d (/metrics, /health, /drain)", *self.server.server_address[:2])

    def stop(self) -> None:
        if self.thread.is_alive():  # shutdown() waits for a serve_forever that a failed startup never began
            self.server.shutdown()
        self.server.server_close()
        self.channel.close()

    def stats(self) -> generate_pb2.SchedulerStats | None:
        try:
            return self.scheduler.Stats(generate_pb2.SchedulerStatsRequest(), timeout=ASK_TIMEOUT_S)
        except grpc.RpcError:
            return None

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        status = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path == "/metrics":
                    metrics = ClusterMetrics()
                    if (stats := status.stats()) is not None:
                        metrics.set_cluster(stats)
                    self._send(200, metrics.render(), CONTENT_TYPE_LATEST)
                elif self.path == "/health":
                    problems = health_problems(stats := status.stats())
                    body = (
                        {"status": "unavailable", "problems": problems}
                        if problems
                        else {"status": "ok", "workers_alive": stats.workers_alive}
                    )
                    self._send(503 if problems else 200, json.dumps(body), JSON)
                else:
                    self._send(404, json.dumps({"error": "no such path; this serves /metrics, /health and POST /drain"}), JSON)

            def do_POST(self) -> None:  # noqa: N802
                if not ipaddress.ip_address(self.client_address[0]).is_loopback:  # /metrics is for Prometheus; drain is local
                    self._send(403, json.dumps({"error": "POST /drain is accepted from this host only"}), JSON)
                    return
                if self.path != "/drain":
                    self._send(404, json.dumps({"error": "POST serves /drain only"}), JSON)
                    return
                try:
                    reply = status.scheduler.Drain(generate_pb2.DrainRequest(), timeout=ASK_TIMEOUT_S)
                except grpc.RpcError as e:
                    self._send(503, json.dumps({"error": f"the scheduler is not answering: {e.code().name}"}), JSON)
                    return
                self._send(200, json.dumps({"draining": True, "running": reply.running}), JSON)

            def _send(self, code: int, body: str, content_type: str) -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args) -> None:  # noqa: A002 - quiet: probes call every few seconds
                pass

        return Handler
