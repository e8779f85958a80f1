"""Runs `pulseinfer serve` as a real process tree, for the service tests and the serving benchmarks."""

from __future__ import annotations

import json
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

READY_LINE = "PulseInfer is serving"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServingCluster:
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

    def children(self) -> dict[str, int]:
        """Service name -> pid of the launcher's children, read from /proc."""
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == self.process.pid and len(cmdline) > 2 and cmdline[1] == b"-m":
                name = cmdline[2].decode().removeprefix("pulseinfer.")
                if name == "gpu_worker":
                    name += cmdline[cmdline.index(b"--worker-id") + 1].decode()
                found[name] = int(entry.name)
        return found

    def request(self, path: str, body: bytes | dict | None = None, key: str | None = "default") -> tuple[int, dict | str]:
        """HTTP with urllib: returns (status, parsed JSON or text) for error statuses too."""
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        headers = {"Content-Type": "application/json"}
        key = self.api_key if key == "default" else key
        if key:
            headers["Authorization"] = f"Bearer {key}"
        req = urllib.request.Request(self.base_url + path, data=data, headers=headers, method="POST" if data is not None else "GET")
        try:
            with urllib.request.urlopen(req, timeout=120) as response:
                status, raw = response.status, response.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        try:
            return status, json.loads(raw)
        except json.JSONDecodeError:
            return status, raw.decode()

    def metric(self, name: str, **labels: str) -> float | None:
        _, text = self.request("/metrics")
        want = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
        for line in text.splitlines():
            if line.startswith(f"pulseinfer:{name}{want} "):
                return float(line.rsplit(" ", 1)[1])
        return None

    def wait_for(self, predicate, timeout_s: float = 60.0, what: str = "condition"):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if value := predicate():
                return value
            time.sleep(0.2)
        raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout=timeout_s)
        finally:
            self.process.stdout.close()
            self.log.close()
