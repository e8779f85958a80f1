"""`pulseinfer serve` process lifecycle: startup errors, and no child outliving the launcher."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pulseinfer.serving_cluster import ServingCluster


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status  # a zombie has exited; only its parent's wait is missing


def _kv_segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("pulseinfer-kv-*")}


def test_children_die_with_a_launcher_killed_by_sigkill():
    before = _kv_segments()
    cluster = ServingCluster("--workers", "1", "--host-kv-tokens", "16384")
    children = cluster.children()
    assert set(children) == {"kv_store", "scheduler", "gpu_worker0", "gateway"}
    assert _kv_segments() - before, "the kv_store holds no shared-memory pool"
    cluster.stop(signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(p) for p in children.values()):
        time.sleep(0.2)
    assert not [name for name, pid in children.items() if _alive(pid)]
    assert _kv_segments() == before, "the kv_store left its shared-memory segment behind"


def test_startup_error_is_one_clear_line_and_leaves_nothing_running(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "pulseinfer.cli", "serve", "--model", str(tmp_path / "missing.gguf"), "--http-port", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert "model not found" in result.stderr and "pulseinfer: error: kv_store exited with code 2 during startup" in result.stderr
    leftovers = subprocess.run(["pgrep", "-P", str(os.getpid()), "-f", "missing.gguf"], capture_output=True, text=True).stdout
    assert not leftovers.strip()
