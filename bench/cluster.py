"""`pulseinfer serve` as a real child process tree on free ports: what the serving benches start,
and the base of the service tests' cluster (tests/serving_cluster.py adds the test-only helpers).

The API key, when there is one, goes to the child in the environment only (never in argv, where
`ps` shows it); an inherited one is stripped, so a cluster without a key has none. The child's
stderr goes to a log file under $TMPDIR named by the HTTP port; its tail is in the error when the
cluster does not become ready.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from pulseinfer.common.api_key import API_KEY_ENV

READY_LINE = "PulseInfer is serving"  # the launcher prints it on stdout once every service answers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServingCluster:
    """Starts `pulseinfer serve *flags` and returns once it prints READY_LINE; stop() ends it."""

    def __init__(self, *flags: str, api_key: str | None = None, startup_timeout_s: float = 240.0):
        self.http_port, self.grpc_port = free_port(), free_port()
        self.api_key = api_key
        argv = [
            sys.executable,
            "-m",
            "pulseinfer.cli",
            "serve",
            "--http-port",
            str(self.http_port),
            "--grpc-port",
            str(self.grpc_port),
            *flags,
        ]
        env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}  # the key in the environment, not in argv (`ps`)
        if api_key:
            env[API_KEY_ENV] = api_key
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"pulseinfer-serve-{self.http_port}.log"
        self.log = self.log_path.open("w+")
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        self._wait_ready(startup_timeout_s)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if READY_LINE in line:
                return
            if not line and self.process.poll() is not None:
                break
        self.stop()
        raise RuntimeError(f"pulseinfer serve did not become ready; its log:\n{self.log_path.read_text()[-4000:]}")

    def http(
        self, path: str, data: bytes | None = None, headers: dict[str, str] | None = None, key: str | None = "default"
    ) -> tuple[int, bytes]:
        """One HTTP request with urllib (POST when there is data): (status, body), for error statuses too.
        It carries the cluster's API key unless `key` names another one, or None for none."""
        headers = dict(headers or {})
        key = self.api_key if key == "default" else key
        if key:
            headers["Authorization"] = f"Bearer {key}"
        req = urllib.request.Request(self.base_url + path, data=data, headers=headers, method="POST" if data is not None else "GET")
        try:
            with urllib.request.urlopen(req, timeout=120) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def metric(self, name: str, **labels: str) -> float | None:
        """The value of the sample `pulseinfer:<name>{labels}` on /metrics, or None without one."""
        _, raw = self.http("/metrics")
        want = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
        for line in raw.decode().splitlines():
            if line.startswith(f"pulseinfer:{name}{want} "):
                return float(line.rsplit(" ", 1)[1])
        return None

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout=timeout_s)
        finally:
            self.process.stdout.close()
            self.log.close()
