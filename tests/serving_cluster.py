"""Runs `pulseinfer serve` as a real process tree, for the service tests: the product's cluster
(pulseinfer.bench.cluster: start, ready wait, log, metric, stop) plus test-only helpers."""

from __future__ import annotations

import json
import time
from pathlib import Path

from pulseinfer.bench import cluster


def children_of(pid: int) -> dict[int, list[bytes]]:
    """The process's children: pid -> command line (its arguments), read from /proc."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found[int(entry.name)] = cmdline
    return found


class ServingCluster(cluster.ServingCluster):
    def children(self) -> dict[str, int]:
        """Service name -> pid of the launcher's children, read from /proc."""
        found = {}
        for child, cmdline in children_of(self.process.pid).items():
            if len(cmdline) > 2 and cmdline[1] == b"-m":
                name = cmdline[2].decode().removeprefix("pulseinfer.")
                if name == "gpu_worker":
                    name += cmdline[cmdline.index(b"--worker-id") + 1].decode()
                found[name] = child
        return found

    def request(self, path: str, body: bytes | dict | None = None, key: str | None = "default") -> tuple[int, dict | str]:
        """HTTP with urllib: returns (status, parsed JSON or text) for error statuses too."""
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        status, raw = self.http(path, data, {"Content-Type": "application/json"}, key)
        try:
            return status, json.loads(raw)
        except json.JSONDecodeError:
            return status, raw.decode()

    def wait_for(self, predicate, timeout_s: float = 60.0, what: str = "condition"):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if value := predicate():
                return value
            time.sleep(0.2)
        raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
