"""The host KV pool across processes: a real kv_store process, two mapper processes, and its
I/O engine recalling into a worker's shared KV cache."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import zmq

from gpu_worker.kv_cache import KVCacheSpec, PagedKVCache
from gpu_worker.model.loader import load_model_meta
from kv_store.allocator import PoolExhausted
from kv_store.client import KVStoreClient, KVStoreUnavailable, RemoteRecall
from kv_store.view import CUDA_REGISTER_CHUNK, PoolMismatch, PoolView, register_host_range
from pulseinfer import probe

# SmolLM2-135M: 3 kv heads x 64 dims; the pool is for fp32, block 16
KV_HEADS, HEAD_DIM, BLOCK = 3, 64, 16
POOL_TOKENS = 64 * BLOCK

# One mapper process: registers, maps the pool, then writes or checks seeded blocks.
MAPPER = textwrap.dedent(
    """
    import sys, torch, zmq
    from kv_store.client import KVStoreClient
    from kv_store.view import PoolView
    action, address, owner, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    client = KVStoreClient(zmq.Context.instance(), address)
    view = PoolView.attach(client.register(worker_id=1 if action == "write" else 2), 3, 16, 64, torch.float32)
    generator = torch.Generator().manual_seed(1234)
    if action == "write":
        blocks = client.allocate(owner, count)
        for layer in range(view.blocks.shape[1]):
            k, v = (torch.randn(count, 16, 3, 64, generator=generator) for _ in range(2))
            view.write(torch.tensor(blocks), layer, k, v)
        print(" ".join(map(str, blocks)))
    else:
        blocks = torch.tensor([int(b) for b in sys.argv[5].split()])
        for layer in range(view.blocks.shape[1]):
            k, v = (torch.randn(count, 16, 3, 64, generator=generator) for _ in range(2))
            units = view.read(blocks, layer)
            assert torch.equal(units[:, 0], k.transpose(1, 2)) and torch.equal(units[:, 1], v.transpose(1, 2)), layer
        print("ok")
    view.close()
    """
)


@pytest.fixture(scope="module")
def kv_store(tmp_path_factory):
    address = f"ipc://{tmp_path_factory.mktemp('kv')}/kv_store"
    process = subprocess.Popen([sys.executable, "-m", "kv_store", "--bind", address, "--host-kv-tokens", str(POOL_TOKENS)])
    deadline = time.monotonic() + 60
    while True:
        try:
            probe.kv_store(address)
            break
        except probe.NotReady:
            if time.monotonic() > deadline or process.poll() is not None:
                process.kill()
                raise
            time.sleep(0.2)
    yield address
    process.terminate()
    assert process.wait(timeout=30) == 0  # SIGTERM is a clean shutdown


def _mapper(*args: str) -> str:
    result = subprocess.run([sys.executable, "-c", MAPPER, *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_blocks_written_by_one_process_read_back_bit_exact_by_another(kv_store):
    blocks = _mapper("write", kv_store, "request-a", "5")
    assert len(blocks.split()) == 5
    assert _mapper("check", kv_store, "request-a", "5", blocks) == "ok"


def test_exhaustion_is_a_clear_error_and_harms_nothing_stored(kv_store):
    client = KVStoreClient(zmq.Context.instance(), kv_store)
    layout = client.register(worker_id=3)
    view = PoolView.attach(layout, KV_HEADS, BLOCK, HEAD_DIM, torch.float32)
    try:
        mine = client.allocate("request-b", 4)
        for block in mine:
            view.blocks[block].normal_()
        before = view.blocks.clone()
        free = client.stats().blocks_free
        with pytest.raises(PoolExhausted, match="need"):
            client.allocate("request-c", free + 1)
        assert client.stats().blocks_free == free  # all or nothing
        assert torch.equal(view.blocks, before)
        assert client.release("request-b") == 4 and client.release("request-b") == 0
    finally:
        view.close()
        client.close()


def test_a_worker_with_another_geometry_is_refused(kv_store):
    client = KVStoreClient(zmq.Context.instance(), kv_store)
    try:
        with pytest.raises(PoolMismatch, match="--kv-dtype"):
            PoolView.attach(client.register(worker_id=4), KV_HEADS, BLOCK, HEAD_DIM, torch.bfloat16)
    finally:
        client.close()


def test_the_segment_is_gone_after_shutdown(tmp_path):
    address = f"ipc://{tmp_path}/kv"
    process = subprocess.Popen([sys.executable, "-m", "kv_store", "--bind", address, "--host-kv-tokens", str(POOL_TOKENS)])
    segment = Path(f"/dev/shm/pulseinfer-kv-{process.pid}")
    deadline = time.monotonic() + 60
    while not segment.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert segment.exists()
    process.terminate()
    process.wait(timeout=30)
    assert not segment.exists()


def test_cuda_registration_goes_in_64_gib_chunks_and_accepts_an_already_registered_range():
    calls = []

    def register(address: int, size: int) -> int:
        calls.append((address, size))
        return 712 if len(calls) == 2 else 0  # cudaErrorHostMemoryAlreadyRegistered

    registered = register_host_range(1000, 2 * CUDA_REGISTER_CHUNK + 5, register)
    assert calls == [(1000, CUDA_REGISTER_CHUNK), (1000 + CUDA_REGISTER_CHUNK, CUDA_REGISTER_CHUNK), (1000 + 2 * CUDA_REGISTER_CHUNK, 5)]
    assert registered == [calls[0], calls[2]]  # closing the view unregisters only what it registered
    with pytest.raises(RuntimeError, match="CUDA error 2"):
        register_host_range(0, 10, lambda address, size: 2)


# A worker that opens its shared cache as a recall target, then waits to be killed.
TARGET_HOLDER = textwrap.dedent(
    """
    import os, sys, time, torch, zmq
    from gpu_worker.kv_cache import KVCacheSpec, PagedKVCache
    from gpu_worker.model.loader import load_model_meta
    from kv_store.client import KVStoreClient
    sys.path.insert(0, sys.argv[2])
    from test_kv_store import open_target
    client = KVStoreClient(zmq.Context.instance(), sys.argv[1])
    client.register(worker_id=9)
    config, segment = load_model_meta(None).config, f"pulseinfer-cache-{os.getpid()}"
    cache = PagedKVCache(config, KVCacheSpec(4, 16), torch.float32, torch.device("cpu"), segment)
    open_target(client, 9, cache)
    print(cache.segment, flush=True)
    time.sleep(600)
    """
)


def open_target(client: KVStoreClient, worker_id: int, cache: PagedKVCache) -> None:
    client.open_recall(cache.shape.target(worker_id, cache.segment))


def test_the_io_engine_recalls_into_the_worker_cache_bit_exact(kv_store):
    context = zmq.Context.instance()
    client = KVStoreClient(context, kv_store)
    view = PoolView.attach(client.register(worker_id=7), KV_HEADS, BLOCK, HEAD_DIM, torch.float32)
    cache = PagedKVCache(load_model_meta(None).config, KVCacheSpec(8, BLOCK), torch.float32, torch.device("cpu"), "pulseinfer-cache-test")
    remote = None
    try:
        host = client.allocate("request-io", 6)
        for block in host:
            view.blocks[block].normal_()
        open_target(client, 7, cache)
        remote = RemoteRecall(context, kv_store, 7, cache.header, timeout_s=30)
        k, v = (c.view(c.shape[0], -1, BLOCK, KV_HEADS, HEAD_DIM) for c in (cache.k, cache.v))  # [layer, block, token, head, dim]

        remote(3, [host[5], host[1], host[3]], [2, 0, 5])  # score order, not block order
        for source, dst in ((host[5], 2), (host[1], 0), (host[3], 5)):
            assert torch.equal(k[3, dst], view.blocks[source, 3, 0].transpose(0, 1))
            assert torch.equal(v[3, dst], view.blocks[source, 3, 1].transpose(0, 1))
        assert not k[3, [1, 3, 4, 6, 7]].any() and not k[2].any()  # nothing else written
        assert int(cache.header[0]) == remote.sequence

        remote(1, [host[0], host[2]], [4, 4], heads=[2, 0])  # head-wise: one kv head of each
        assert torch.equal(k[1, 4, :, 2], view.blocks[host[0], 1, 0, 2]) and torch.equal(k[1, 4, :, 0], view.blocks[host[2], 1, 0, 0])
        assert not k[1, 4, :, 1].any()

        with pytest.raises(ValueError, match="host block out of range"):
            remote(0, [view.blocks.shape[0]], [0])
        with pytest.raises(ValueError, match="device block out of range"):
            remote(0, [host[0]], [8])
        with pytest.raises(ValueError, match="layer 99 out of range"):
            remote(99, [host[0]], [0])
        remote(0, [host[4]], [7])  # a refused request harms nothing: the engine goes on
        assert torch.equal(v[0, 7], view.blocks[host[4], 0, 1].transpose(0, 1))
    finally:
        if remote is not None:
            remote.close()
        cache.close()
        client.release("request-io")
        view.close()
        client.close()
    assert not Path("/dev/shm/pulseinfer-cache-test").exists()


def test_a_recall_target_of_a_dead_worker_is_unmapped_and_its_segment_removed(kv_store):
    process = subprocess.Popen(
        [sys.executable, "-c", TARGET_HOLDER, kv_store, str(Path(__file__).parent)], stdout=subprocess.PIPE, text=True
    )
    try:
        segment = Path("/dev/shm") / process.stdout.readline().strip()
        assert segment.name.startswith("pulseinfer-cache-") and segment.exists()
    finally:
        process.kill()
        process.wait()
    deadline = time.monotonic() + 10
    while segment.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not segment.exists()


def test_a_recall_without_an_answer_is_a_clear_error(tmp_path):
    cache_header = torch.zeros(1, dtype=torch.int64)
    remote = RemoteRecall(zmq.Context.instance(), f"ipc://{tmp_path}/nobody", 1, cache_header, timeout_s=0.2)
    try:
        with pytest.raises(KVStoreUnavailable, match="did not complete recall 1"):
            remote(0, [0], [0])
    finally:
        remote.close()
