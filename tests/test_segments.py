"""Shared-memory segments: names made by the cluster only, nothing a socket sends names a file,
and a segment whose creator died (kill -9 included) is removed by the next sweep, never one in use."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import zmq

from pulseinfer.kv_store.client import KVStoreClient
from pulseinfer.kv_store.segments import SHM_DIR, Segment, cache_name, open_segment, pool_name, sweep
from pulseinfer.launcher import _new_run_dir, start_kv_store
from pulseinfer.proto.pulseinfer.v1 import kv_store_pb2 as pb

# Creates a segment, says its name, and waits to be killed.
CREATOR = textwrap.dedent(
    """
    import sys, time
    from pulseinfer.kv_store.segments import Segment, pool_name
    segment = Segment(pool_name(), 4096)
    print(segment.name, flush=True)
    time.sleep(600)
    """
)


def creator() -> tuple[subprocess.Popen, Path]:
    process = subprocess.Popen([sys.executable, "-c", CREATOR], stdout=subprocess.PIPE, text=True)
    return process, SHM_DIR / process.stdout.readline().strip()


def test_a_segment_of_a_process_killed_9_is_swept_and_a_live_ones_is_not():
    dead, dead_path = creator()
    live, live_path = creator()
    try:
        dead.kill()
        dead.wait()
        assert dead_path.exists() and live_path.exists()
        removed = sweep()
        assert dead_path.name in removed and not dead_path.exists()
        assert live_path.name not in removed and live_path.exists()
    finally:
        live.kill()
        live.wait()
    assert live_path.name in sweep()


def test_a_segment_is_removed_by_its_creator_and_names_are_the_clusters_own():
    segment = Segment(pool_name(), 8192)
    assert segment.path.exists() and len(segment.map) == 8192
    assert open_segment(segment.name, 8192)  # another process's view: the name and size check out
    with pytest.raises(ValueError, match="expected 4096"):
        open_segment(segment.name, 4096)
    segment.close()
    assert not segment.path.exists()


@pytest.mark.parametrize("name", ["../../etc/passwd", "pulseinfer-kv-1-abcdefgh/../../x", "pulseinfer-cache-12 ", "", "a" * 5000, "x/y"])
def test_a_name_that_is_not_a_segment_name_opens_nothing(name):
    with pytest.raises(ValueError, match="not the name of a PulseInfer shared-memory segment"):
        open_segment(name, 4096)


def test_a_link_named_like_a_segment_is_not_followed(tmp_path):
    target = tmp_path / "file"
    target.write_bytes(b"x" * 4096)
    link = SHM_DIR / cache_name(999_999_999)
    link.symlink_to(target)
    try:
        with pytest.raises(OSError):
            open_segment(link.name, 4096)
        sweep()
        assert target.exists()  # a sweep never follows a link either
    finally:
        link.unlink(missing_ok=True)


def test_the_kv_store_opens_only_the_cache_it_derives_and_unlinks_nothing_live(kv_store_address):
    """The recall target names no file: the kv_store derives it from the registered pid. A worker id
    re-registered with another pid (the audit's attack) drops the earlier registration but unlinks
    no segment whose creator lives."""
    live = Segment(cache_name(os.getpid()), 4096)
    client = KVStoreClient(zmq.Context.instance(), kv_store_address)
    try:
        client.call(pb.KVStoreRequest(register=pb.RegisterWorker(worker_id=3, pid=os.getpid())))
        client.call(pb.KVStoreRequest(register=pb.RegisterWorker(worker_id=3, pid=1)))
        assert live.path.exists()
        target = pb.OpenRecallTarget(worker_id=3, num_layers=30, slots=16, kv_heads=3, head_dim=64, block_size=16, dtype="float32")
        with pytest.raises(ValueError, match="pulseinfer-cache-1:|No such file"):
            client.open_recall(target)  # pid 1 has no cache segment: nothing else is tried
    finally:
        client.close()
        live.close()


@pytest.fixture
def kv_store_address(tmp_path):
    address = f"ipc://{tmp_path}/kv"
    child = start_kv_store(address, 1024)
    yield address
    child.process.send_signal(signal.SIGTERM)
    child.process.wait(timeout=30)


# Makes a run directory the launcher's way, says its path, and waits to be killed.
RUN_DIR_HOLDER = "from pulseinfer.launcher import _new_run_dir; import time; print(_new_run_dir()[0], flush=True); time.sleep(600)"


def test_a_new_launcher_removes_the_run_directory_of_one_killed_9_and_keeps_a_live_ones():
    dead = subprocess.Popen([sys.executable, "-c", RUN_DIR_HOLDER], stdout=subprocess.PIPE, text=True)
    live = subprocess.Popen([sys.executable, "-c", RUN_DIR_HOLDER], stdout=subprocess.PIPE, text=True)
    dead_dir, live_dir = Path(dead.stdout.readline().strip()), Path(live.stdout.readline().strip())
    try:
        dead.kill()
        dead.wait()
        assert dead_dir.is_dir() and live_dir.is_dir()
        mine, held = _new_run_dir()
        os.close(held)
        mine.rmdir()
        assert not dead_dir.exists() and live_dir.is_dir()
    finally:
        live.kill()
        live.wait()
