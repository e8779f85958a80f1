"""`pulseinfer serve` process lifecycle: startup errors, no child outliving the launcher, and
the API key kept off every command line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from serving_cluster import ServingCluster

from pulseinfer import cli
from pulseinfer.common.api_key import API_KEY_ENV, resolve_api_key
from pulseinfer.common.flags import parse_config
from pulseinfer.gateway.server import GatewayConfig
from pulseinfer.launcher import Cluster, ServeConfig


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


def test_api_key_comes_from_the_file_else_the_environment(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("  file-key\n")
    assert resolve_api_key(str(key_file), {API_KEY_ENV: "env-key"}) == "file-key"  # the file first, stripped
    assert resolve_api_key(None, {API_KEY_ENV: "env-key"}) == "env-key"
    assert resolve_api_key(None, {API_KEY_ENV: ""}) is None and resolve_api_key(None, {}) is None  # no key needed
    (tmp_path / "blank").write_text(" \n")
    for path, message in (
        (tmp_path / "missing", "cannot read --api-key-file"),
        (tmp_path / "blank", "is empty"),
        (tmp_path, "cannot read"),
    ):
        with pytest.raises(ValueError, match=message):
            resolve_api_key(str(path), {API_KEY_ENV: "env-key"})


def test_gateway_reads_its_key_from_a_file_and_has_no_key_flag(tmp_path, monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "env-key")
    key_file = tmp_path / "key"
    key_file.write_text("file-key\n")
    assert parse_config(GatewayConfig, "gateway", "", ["--api-key-file", str(key_file)]).resolved_api_key() == "file-key"
    assert parse_config(GatewayConfig, "gateway", "", []).resolved_api_key() == "env-key"
    with pytest.raises(SystemExit):
        parse_config(GatewayConfig, "gateway", "", ["--api-key", "k"])
    with pytest.raises(SystemExit):
        cli.main(["bench", "serve", "--api-key", "k"])


def test_the_launcher_passes_the_key_to_the_gateway_alone_in_its_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "launcher-env-key")
    cluster = Cluster(ServeConfig(workers=2), tmp_path, api_key="s3cret-key")
    for child in cluster.children:
        assert not [arg for arg in child.argv if "s3cret" in arg or "launcher-env-key" in arg], child.name
        assert child.environment().get(API_KEY_ENV) == ("s3cret-key" if child is cluster.gateway else None), child.name
    assert API_KEY_ENV not in Cluster(ServeConfig(), tmp_path).gateway.environment()  # no key: none inherited either


def test_serve_rejects_a_key_flag_and_a_bad_key_file_before_starting_anything(tmp_path, capsys):
    with pytest.raises(SystemExit):  # not taken as an abbreviation of --api-key-file, and not echoed
        cli.main(["serve", "--api-key", "s3cret-key"])
    err = capsys.readouterr().err
    assert "--api-key is not accepted" in err and "s3cret" not in err
    assert cli.main(["serve", "--api-key-file", str(tmp_path / "missing")]) == 1
    assert "pulseinfer: error: cannot read --api-key-file" in capsys.readouterr().err
