"""The host KV pool across processes: a real kv_store process, two mapper processes, and its
I/O engine recalling into a worker's shared KV cache."""

from __future__ import annotations

import gc
import json
import mmap
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import zmq

from pulseinfer.common.model.meta import load_model_config
from pulseinfer.engine import Engine, EngineConfig
from pulseinfer.gpu_worker.config import WorkerConfig
from pulseinfer.gpu_worker.kv_cache import KVCacheSpec, PagedKVCache
from pulseinfer.gpu_worker.offload.config import HostTier, OffloadConfig
from pulseinfer.kernels.gather_scatter import recall_ref
from pulseinfer.kv_store.allocator import PoolExhausted
from pulseinfer.kv_store.client import KVStoreClient, KVStoreUnavailable, RemoteRecall, recall_target
from pulseinfer.kv_store.cuda_ipc import STAGING_BYTES, Staging, staged
from pulseinfer.kv_store.io_engine import RecallEngine
from pulseinfer.kv_store.layout import CacheShape, PoolGeometry, SegmentHeader, unit_bytes
from pulseinfer.kv_store.prefix_cache import CACHE_OWNER, HostBlocks, demotion_owner
from pulseinfer.kv_store.view import (
    CUDA_HOST,
    CUDA_REGISTER_CHUNK,
    HostRegistrar,
    PoolMismatch,
    PoolView,
    register_host_range,
    unregister_host_ranges,
)
from pulseinfer.launcher import Child, start_kv_store
from pulseinfer.proto.pulseinfer.v1 import kv_store_pb2 as pb

# SmolLM2-135M: 3 kv heads x 64 dims; the pool is for fp32, block 16
KV_HEADS, HEAD_DIM, BLOCK = 3, 64, 16
POOL_TOKENS = 64 * BLOCK
# its KV geometry (30 layers) as a config alone: the kv_store and a cache read no weights and no
# tokenizer, so these tests run where the model file is not installed (a GPU check's machine)
GEOMETRY = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
}

# One mapper process: registers, maps the pool, then writes or checks seeded blocks.
MAPPER = textwrap.dedent(
    """
    import sys, torch, zmq
    from pulseinfer.kv_store.client import KVStoreClient
    from pulseinfer.kv_store.view import PoolView
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


def stop_kv_store(child: Child) -> None:
    child.stop()
    assert child.process.wait(timeout=30) == 0  # SIGTERM is a clean shutdown


@pytest.fixture(scope="module")
def geometry(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("geometry")
    (path / "config.json").write_text(json.dumps(GEOMETRY))
    return path


def model_flags(geometry: Path) -> tuple[str, ...]:
    return ("--model", str(geometry), "--load-format", "dummy")


@pytest.fixture(scope="module")
def kv_store(tmp_path_factory, geometry):
    address = f"ipc://{tmp_path_factory.mktemp('kv')}/kv_store"
    child = start_kv_store(address, POOL_TOKENS, *model_flags(geometry), timeout_s=60)
    yield address
    stop_kv_store(child)


@pytest.fixture(scope="module")
def staging_kv_store(tmp_path_factory, geometry):
    """A kv_store whose engine stages every whole-unit recall into a CUDA cache (the default maps 24 KiB units)."""
    address = f"ipc://{tmp_path_factory.mktemp('kv')}/kv_store"
    child = start_kv_store(address, POOL_TOKENS, "--staging-min-kib", "1", *model_flags(geometry), timeout_s=60)
    yield address
    stop_kv_store(child)


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


def test_the_host_prefix_cache_names_shares_and_drops_blocks_across_workers(kv_store):
    """Blocks one worker's request named outlive it; another worker's request takes its longest
    cached prefix; bad names and free blocks are refused; a drop frees what no request holds."""
    writer, reader = (KVStoreClient(zmq.Context.instance(), kv_store) for _ in range(2))
    try:
        writer.register(worker_id=5)
        reader.register(worker_id=6)

        def used() -> int:
            stats = writer.stats()
            return stats.blocks_total - stats.blocks_free

        before = used()
        names = [bytes([i]) * 16 for i in range(3)]
        blocks = writer.allocate("computed", 3)
        writer.insert(names, blocks)
        assert writer.release("computed") == 0 and writer.stats().prefix_cached_blocks == 3  # the cache holds them
        assert reader.match([*names[:2], b"x" * 16]) == 2 and used() == before + 3  # a match takes nothing
        assert reader.acquire("sharer", [*names[:2], b"x" * 16]) == blocks[:2]
        with pytest.raises(ValueError, match="16 bytes"):
            reader.insert([b"short"], blocks[:1])
        with pytest.raises(ValueError, match="not in use"):
            reader.insert([b"y" * 16], [writer.stats().blocks_total - 1])
        with pytest.raises(ValueError, match="reserved"):
            writer.release(CACHE_OWNER)  # the cache's own references
        assert writer.drop_prefix_cache() == 1  # the third; the sharer's two stay its own
        assert reader.release("sharer") == 2 and used() == before and writer.stats().prefix_cached_blocks == 0
    finally:
        writer.close()
        reader.close()


def test_demotions_reserve_blocks_only_for_names_the_host_tier_lacks_and_a_dead_workers_reservation_is_freed(kv_store):
    """A worker reserves host blocks for evicted device blocks (names cached already get -1), writes
    and names them under its demotion owner, which then holds nothing; a reservation a worker held
    when it went away (deregistered by a restart under a new pid) is freed."""
    worker = KVStoreClient(zmq.Context.instance(), kv_store)
    try:
        worker.register(worker_id=7)
        before = worker.stats()
        names = [bytes([40 + i]) * 16 for i in range(3)]
        (cached,) = worker.allocate("computed", 1)
        worker.insert(names[:1], [cached])
        worker.release("computed")
        reserved = worker.reserve(demotion_owner(7), names)
        assert reserved[0] == -1 and min(reserved[1:]) >= 0
        worker.insert(names[1:], reserved[1:], demotion_owner(7))
        stats = worker.stats()
        assert stats.prefix_demoted_blocks == before.prefix_demoted_blocks + 2
        assert stats.prefix_cached_blocks == before.prefix_cached_blocks + 3
        assert stats.block_bytes == GEOMETRY["num_hidden_layers"] * unit_bytes(KV_HEADS, BLOCK, HEAD_DIM, 4)  # what a demotion moves
        assert worker.release(demotion_owner(7)) == 0  # naming let go of the reservation
        assert worker.match(names) == 3
        held = worker.reserve(demotion_owner(7), [bytes([50]) * 16])
        assert held[0] >= 0 and worker.stats().blocks_free == stats.blocks_free - 1
        worker.call(pb.KVStoreRequest(register=pb.RegisterWorker(worker_id=7, pid=os.getpid() + 1)))  # a restart forgets the old one
        assert worker.stats().blocks_free == stats.blocks_free
        assert worker.drop_prefix_cache() == 3
    finally:
        worker.close()


def test_a_worker_with_another_geometry_is_refused(kv_store):
    client = KVStoreClient(zmq.Context.instance(), kv_store)
    try:
        with pytest.raises(PoolMismatch, match="--kv-dtype"):
            PoolView.attach(client.register(worker_id=4), KV_HEADS, BLOCK, HEAD_DIM, torch.bfloat16)
    finally:
        client.close()


def test_the_segment_is_gone_after_shutdown(tmp_path, geometry):
    address = f"ipc://{tmp_path}/kv"
    flags = ["--bind", address, "--host-kv-tokens", str(POOL_TOKENS), *model_flags(geometry)]
    process = subprocess.Popen([sys.executable, "-m", "pulseinfer.kv_store", *flags])
    deadline = time.monotonic() + 60
    while not (segments := list(Path("/dev/shm").glob(f"pulseinfer-kv-{process.pid}-*"))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(segments) == 1
    process.terminate()
    process.wait(timeout=30)
    assert not segments[0].exists()


class FakeCuda:
    """cudaHostRegister and cudaHostUnregister as the driver answers them: a range that overlaps a
    registered one is error 712 (cudaErrorHostMemoryAlreadyRegistered); unregistering what is not
    registered, error 1."""

    def __init__(self):
        self.registered: dict[int, int] = {}
        self.calls: list[tuple[int, int]] = []
        self.host = HostRegistrar(self.register, self.unregister)

    def register(self, address: int, size: int) -> int:
        self.calls.append((address, size))
        if any(start < address + size and address < start + length for start, length in self.registered.items()):
            return 712
        self.registered[address] = size
        return 0

    def unregister(self, address: int) -> int:
        return 0 if self.registered.pop(address, None) is not None else 1


def test_cuda_registration_goes_in_64_gib_chunks_and_is_let_go_chunk_by_chunk():
    cuda = FakeCuda()
    registered = register_host_range(1000, 2 * CUDA_REGISTER_CHUNK + 5, cuda.host)
    assert cuda.calls == [
        (1000, CUDA_REGISTER_CHUNK),
        (1000 + CUDA_REGISTER_CHUNK, CUDA_REGISTER_CHUNK),
        (1000 + 2 * CUDA_REGISTER_CHUNK, 5),
    ]
    assert registered == cuda.calls
    unregister_host_ranges(registered, cuda.host)
    assert cuda.registered == {}
    with pytest.raises(RuntimeError, match="cudaHostUnregister .* failed"):
        unregister_host_ranges(registered, cuda.host)  # twice: the driver's error is raised, not dropped


def test_an_already_registered_range_is_a_stale_registration_and_fails_clearly():
    """A range just mapped that CUDA reports registered (712) holds an earlier mapping's freed pages:
    never accepted; the chunks registered before it are let go."""
    cuda = FakeCuda()
    cuda.registered[1000 + CUDA_REGISTER_CHUNK + 64] = 4096  # left by a mapping unmapped without being unregistered
    with pytest.raises(RuntimeError, match="CUDA error 712 .*stale registration"):
        register_host_range(1000, 2 * CUDA_REGISTER_CHUNK, cuda.host)
    assert cuda.registered == {1000 + CUDA_REGISTER_CHUNK + 64: 4096}  # the first chunk let go; the stale one is not ours
    with pytest.raises(RuntimeError, match="CUDA error 2 .*memlock"):
        register_host_range(0, 10, HostRegistrar(lambda address, size: 2, cuda.unregister))


def test_a_pinned_view_is_unpinned_when_closed_and_a_stale_registration_at_its_address_refused():
    cuda = FakeCuda()
    view = PoolView.private(4, 2, KV_HEADS, BLOCK, HEAD_DIM, torch.float32)
    with pytest.raises(ValueError, match="pin"):
        view.mapped()  # CUDA reaches the pool through its registration only
    view.pin(cuda.host)
    address, size = view.units.data_ptr(), view.units.numel() * 4
    assert cuda.registered == {address: size}
    assert view.mapped().address == address and view.mapped().dtype == torch.float32
    view.close()
    view.close()  # once is enough; twice harms nothing
    assert cuda.registered == {}
    # The next view of this process, mapped at an address an unclosed view registered: refused, not accepted silently.
    fresh = PoolView.private(4, 2, KV_HEADS, BLOCK, HEAD_DIM, torch.float32)
    cuda.registered[fresh.units.data_ptr()] = size
    with pytest.raises(RuntimeError, match="stale registration"):
        fresh.pin(cuda.host)
    with pytest.raises(ValueError, match="pin"):
        fresh.mapped()
    stale = {fresh.units.data_ptr(): size}
    fresh.close()
    assert cuda.registered == stale  # not this view's to let go


def test_a_pinned_view_dropped_unclosed_unpins_when_collected():
    """An error path or a reference cycle that drops a view without close() leaves no stale registration."""
    cuda = FakeCuda()
    view = PoolView.private(4, 2, KV_HEADS, BLOCK, HEAD_DIM, torch.float32)
    view.pin(cuda.host)
    view.cycle = view  # only the cycle collector frees it
    assert cuda.registered
    del view
    gc.collect()
    assert cuda.registered == {}


def test_the_engine_pins_the_pool_at_start_up_and_refuses_a_cache_of_the_other_half_precision():
    """fp16 and bf16 units have the same size: the dtype's name tells them apart."""
    geometry = PoolGeometry(num_blocks=4, num_layers=2, unit_bytes=unit_bytes(KV_HEADS, BLOCK, HEAD_DIM, 2), dtype="float16")
    pool, cuda = mmap.mmap(-1, geometry.total_bytes), FakeCuda()
    engine = RecallEngine(pool, geometry, STAGING_BYTES, cuda.host)
    assert cuda.registered == {engine.pool.data_ptr(): geometry.total_bytes}  # before any worker opens a target
    try:
        request = recall_target(CacheShape(2, 4 * BLOCK, KV_HEADS, HEAD_DIM, BLOCK), 1, "bfloat16")
        with pytest.raises(ValueError, match="cache is bfloat16, the pool's units are float16"):
            engine.open(request, "unused")
    finally:
        engine.close()
    assert cuda.registered == {}
    pool.close()


def test_an_engine_lets_go_of_the_host_pool_it_made_and_of_no_other(model):
    """Engine.close unpins and unmaps its own pool (on CUDA the next Engine of the process may map one
    at the same address); a host tier passed in stays its owner's."""
    worker = WorkerConfig(offload=OffloadConfig(scorer="quest"))  # quest: no calibration pass
    with Engine(EngineConfig(worker=worker, host_kv_tokens=1024), loaded=model) as engine:
        own = engine.host.view
        assert not own.closed
    assert own.closed
    tier = HostTier(PoolView.private(64, model.config.kv_layers, KV_HEADS, BLOCK, HEAD_DIM, torch.float32), HostBlocks(64))
    Engine(EngineConfig(worker=worker), loaded=model, host=tier).close()
    assert not tier.view.closed
    tier.view.close()


def test_a_worker_is_refused_a_pool_of_the_other_half_precision():
    layout = pb.PoolLayout(
        shm_name="unused", num_blocks=4, unit_bytes=unit_bytes(KV_HEADS, BLOCK, HEAD_DIM, 2), num_layers=30, dtype="bfloat16"
    )
    with pytest.raises(PoolMismatch, match="units are bfloat16, this worker's KV is float16"):
        PoolView.attach(layout, KV_HEADS, BLOCK, HEAD_DIM, torch.float16)


@pytest.mark.gpu
def test_a_stale_cuda_registration_fails_clearly_and_leaves_no_cuda_error_behind():
    """cudaHostRegister's failure is also the thread's last CUDA error, which torch's check after its
    next kernel launch would raise as that kernel's own: it is cleared."""
    view = PoolView.private(4, 2, KV_HEADS, BLOCK, HEAD_DIM, torch.float32)
    view.pin()
    try:
        with pytest.raises(RuntimeError, match="CUDA error 712"):
            register_host_range(view.units.data_ptr(), view.units.numel() * 4, CUDA_HOST)
        assert torch.equal(torch.ones(4, device="cuda").add_(1).cpu(), torch.full((4,), 2.0))  # a kernel launch, checked
    finally:
        view.close()


# A worker that opens its shared cache as a recall target, then waits to be killed.
TARGET_HOLDER = textwrap.dedent(
    """
    import sys, time, torch, zmq
    from pulseinfer.gpu_worker.kv_cache import KVCacheSpec, PagedKVCache
    from pulseinfer.common.model.meta import load_model_config
    from pulseinfer.kv_store.client import KVStoreClient
    client = KVStoreClient(zmq.Context.instance(), sys.argv[1])
    client.register(worker_id=9)
    config = load_model_config(sys.argv[2], "dummy")
    cache = PagedKVCache(config, KVCacheSpec(4, 16), torch.float32, torch.device("cpu"), shared=True)
    client.open_recall(cache.recall_target(9))
    print(cache.segment.name, flush=True)
    time.sleep(600)
    """
)


def check_recalls(address: str, device: str, geometry: Path) -> None:
    """A worker's cache on `device`, opened by the kv_store at `address` as a recall target: the
    engine's recalls land bit-exact where asked and nowhere else; bad requests are refused."""
    context = zmq.Context.instance()
    client = KVStoreClient(context, address)
    view = PoolView.attach(client.register(worker_id=7), KV_HEADS, BLOCK, HEAD_DIM, torch.float32)
    config = load_model_config(geometry, "dummy")
    cache = PagedKVCache(config, KVCacheSpec(8, BLOCK), torch.float32, torch.device(device), shared=True)
    remote = None

    def cached() -> tuple[torch.Tensor, torch.Tensor]:  # [layer, block, token, head, dim]; on CUDA read on the stream that waited
        return tuple(c.cpu().view(c.shape[0], -1, BLOCK, KV_HEADS, HEAD_DIM) for c in (cache.k, cache.v))

    try:
        host = client.allocate("request-io", 6)
        for block in host:
            view.blocks[block].normal_()
        client.open_recall(cache.recall_target(7))
        remote = RemoteRecall(context, address, 7, cache.completion, timeout_s=30)

        remote(3, [host[5], host[1], host[3]], [2, 0, 5])  # score order, not block order
        k, v = cached()
        for source, dst in ((host[5], 2), (host[1], 0), (host[3], 5)):
            assert torch.equal(k[3, dst], view.blocks[source, 3, 0].transpose(0, 1))
            assert torch.equal(v[3, dst], view.blocks[source, 3, 1].transpose(0, 1))
        assert not k[3, [1, 3, 4, 6, 7]].any() and not k[2].any()  # nothing else written

        remote(1, [host[0], host[2]], [4, 4], heads=[2, 0])  # head-wise: one kv head of each
        k, _ = cached()
        assert torch.equal(k[1, 4, :, 2], view.blocks[host[0], 1, 0, 2]) and torch.equal(k[1, 4, :, 0], view.blocks[host[2], 1, 0, 0])
        assert not k[1, 4, :, 1].any()

        with pytest.raises(ValueError, match="host block out of range"):
            remote(0, [view.blocks.shape[0]], [0])
        with pytest.raises(ValueError, match="device block out of range"):
            remote(0, [host[0]], [8])
        with pytest.raises(ValueError, match="layer 99 out of range"):
            remote(99, [host[0]], [0])
        remote(0, [host[4]], [7])  # a refused request harms nothing: the engine goes on
        assert torch.equal(cached()[1][0, 7], view.blocks[host[4], 0, 1].transpose(0, 1))
    finally:
        if remote is not None:
            remote.close()
        cache.close()
        client.release("request-io")
        view.close()
        client.close()
    assert cache.segment is None or not cache.segment.path.exists()


def test_the_io_engine_recalls_into_the_worker_cache_bit_exact(kv_store, geometry):
    check_recalls(kv_store, "cpu", geometry)


@pytest.mark.gpu
def test_the_io_engine_recalls_into_a_cuda_cache_over_cuda_ipc_bit_exact(kv_store, staging_kv_store, geometry):
    check_recalls(kv_store, "cuda", geometry)  # whole 24 KiB units and head-wise runs read by the kernel through UVA
    check_recalls(staging_kv_store, "cuda", geometry)  # whole units staged: host gather, one DMA, scatter


def test_a_cuda_cache_is_refused_clearly_where_it_cannot_be_opened(kv_store):
    """A kv_store without CUDA (or with handles that do not open) refuses the target and goes on serving."""
    client = KVStoreClient(zmq.Context.instance(), kv_store)
    try:
        client.register(worker_id=8)
        cuda = pb.CudaCache(device=0, memory_handle=b"not a handle", storage_bytes=1 << 30, ready_event=b"x", landed_event=b"y")
        target = recall_target(CacheShape(30, 64, KV_HEADS, HEAD_DIM, BLOCK), 8, "float32", cuda=cuda)
        expected = "CUDA IPC handles did not open" if torch.cuda.is_available() else "sees no CUDA device"
        with pytest.raises(ValueError, match=expected):
            client.open_recall(target)
        assert client.stats().workers >= 1
    finally:
        client.close()


def test_staging_gathers_whole_units_for_one_copy_and_the_scatter_equals_the_direct_recall():
    units = torch.randn(40, 2, KV_HEADS, BLOCK, HEAD_DIM)
    staging = Staging(torch.device("cpu"), torch.float32)
    for rows in (torch.tensor([7, 3, 31]), torch.arange(39, 0, -3), torch.tensor([5])):  # grows, then reuses its buffer
        k, v = torch.zeros(2, 16 * BLOCK, KV_HEADS, HEAD_DIM)
        expected_k, expected_v = torch.zeros_like(k), torch.zeros_like(v)
        dst = torch.randperm(16)[: rows.numel()]
        recall_ref(units, rows, expected_k, expected_v, dst)
        recall_ref(staging.stage(units, rows), torch.arange(rows.numel()), k, v, dst)
        assert torch.equal(k, expected_k) and torch.equal(v, expected_v)


def test_whole_units_from_the_size_threshold_go_staged_head_wise_fragments_never():
    assert not staged(24 << 10, None, STAGING_BYTES) and staged(64 << 10, None, STAGING_BYTES)
    assert not staged(64 << 10, torch.tensor([0]), STAGING_BYTES)  # one kv head of a unit: read in place


def test_a_recall_target_of_a_dead_worker_is_unmapped_and_its_segment_removed(kv_store, geometry):
    process = subprocess.Popen([sys.executable, "-c", TARGET_HOLDER, kv_store, str(geometry)], stdout=subprocess.PIPE, text=True)
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
    header = SegmentHeader(torch.zeros(1, dtype=torch.int64))
    remote = RemoteRecall(zmq.Context.instance(), f"ipc://{tmp_path}/nobody", 1, header, timeout_s=0.2)
    try:
        with pytest.raises(KVStoreUnavailable, match="did not complete recall 1"):
            remote(0, [0], [0])
    finally:
        remote.close()


def test_a_recall_fails_at_once_when_the_kv_store_dies_not_after_its_timeout(tmp_path):
    control = f"ipc://{tmp_path}/kv"  # a stand-in I/O engine that takes recalls and never answers
    silent = f"import time, zmq; s = zmq.Context().socket(zmq.ROUTER); s.bind('{control}.io'); time.sleep(600)"
    engine = subprocess.Popen([sys.executable, "-c", silent])
    remote = RemoteRecall(zmq.Context.instance(), control, 1, SegmentHeader(torch.zeros(1, dtype=torch.int64)), timeout_s=60)
    try:
        time.sleep(1.0)  # connected
        threading.Timer(0.5, engine.kill).start()
        started = time.monotonic()
        with pytest.raises(KVStoreUnavailable, match="went away during recall 1"):
            remote(0, [0], [0])
        assert time.monotonic() - started < 5  # the 60 s timeout did not run out
    finally:
        engine.kill()
        engine.wait()
        remote.close()
