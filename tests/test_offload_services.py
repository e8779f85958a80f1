"""Offloading in the real cluster (`pulseinfer serve` as OS processes): nothing leaks in either
tier after many random requests, aborts and disconnects; evicted device prefix blocks are demoted
to the host tier and promoted back; kill -9 of any process (kv_store, scheduler, worker, gateway)
while requests run, with blocks demoted and promoted before, tells their clients within 5 s, harms
no request that did not need the dead process, frees every block it held and leaves no
shared-memory segment behind; a recall deadline works through the kv_store's I/O engine."""

from __future__ import annotations

import concurrent.futures
import os
import pydoc_data.topics
import random
import signal
import time
from pathlib import Path

import openai
import pytest
from serving_cluster import ServingCluster

MODEL = "SmolLM2-135M-Instruct"
TEXT = " ".join(pydoc_data.topics.topics.values())
# a device pool of 2048 tokens; an offloaded request holds 1 sink + 4 window + 8 hot blocks of 16 tokens
# (layer-ahead recall forced on: its default on the CPU is off)
FLAGS = ("--workers", "1", "--device-kv-tokens", "2048", "--sink", "16", "--recent", "64", "--budget", "128", "--layer-ahead", "on")
UNIT_BYTES = 2 * 3 * 16 * 64 * 4  # one (block, layer) recall unit of the default model: K and V, 3 kv heads, fp32
KV_STORE_PIDS: set[int] = set()  # every kv_store this module's cluster ran: none may leave its segment behind
TOLD_WITHIN_S = 5.0  # a client learns that a process its request needed died within this


@pytest.fixture(scope="module")
def cluster():
    cluster = ServingCluster(*FLAGS, "--host-kv-tokens", "32768")  # the default 30 s kv_store timeout: a death must be known sooner
    KV_STORE_PIDS.add(cluster.children()["kv_store"])
    yield cluster
    assert cluster.stop() == 0
    left = [path.name for pid in KV_STORE_PIDS for path in Path("/dev/shm").glob(f"pulseinfer-kv-{pid}-*")]
    assert left == [], left
    assert not list(Path("/dev/shm").glob("pulseinfer-cache-*"))  # nor a worker its cache segment


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="none", max_retries=0)


def _one(client: openai.OpenAI, job: tuple[int, int, int, str]) -> str:
    start, chars, max_tokens, how = job
    prompt = TEXT[start : start + chars]
    if how == "complete":
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
        assert got.choices[0].finish_reason in ("stop", "length")
        return how
    if how == "disconnect":  # a client that gives up mid-request
        try:
            client.with_options(timeout=0.3).completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
        except openai.APITimeoutError:
            pass
        return how
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True)
    next(iter(stream), None)  # abort after the first event
    stream.close()
    return how


def test_random_requests_aborts_and_disconnects_free_every_block(cluster, client):
    rng = random.Random(4)
    kinds = ["complete"] * 6 + ["disconnect"] * 2 + ["abort"] * 2
    jobs = [(rng.randrange(len(TEXT) - 4000), rng.randrange(40, 3000), rng.randint(1, 12), rng.choice(kinds)) for _ in range(64)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        done = list(pool.map(lambda job: _one(client, job), jobs))
    assert len(done) == 64
    assert cluster.metric("offloaded_admissions_total", worker="0") > 0  # the small device pool forced offloading
    assert cluster.metric("recall_units_total", worker="0") > 0  # offloaded decode steps recalled blocks ...
    assert cluster.metric("recall_bytes_total", worker="0") == cluster.metric("recall_units_total", worker="0") * UNIT_BYTES
    assert cluster.metric("recall_prefetched_units_total", worker="0") > 0  # ... some of them a layer ahead
    assert cluster.metric("recall_io_busy_seconds_total", worker="0") > 0
    assert cluster.metric("kv_store_engine_recalls_total") > 0  # the kv_store's I/O engine did the copies
    assert cluster.metric("admission_link_bytes_per_second", worker="0") > 0  # the admission measured the link ...
    assert cluster.metric("admission_recall_bytes_per_offloaded_step", worker="0") > 0  # ... and the recall it predicts

    def drained() -> bool:
        return (
            cluster.metric("num_requests_running") == 0
            and cluster.metric("num_requests_waiting") == 0
            and cluster.metric("worker_device_kv_blocks_used", worker="0") == cluster.metric("prefix_cache_device_blocks", worker="0")
            and _host_idle(cluster)
        )

    cluster.wait_for(drained, 60, "both tiers to be free again")
    assert cluster.metric("host_kv_blocks_total") == 32768 // 16
    assert cluster.metric("kv_allocators_corrupt") == 0
    assert cluster.request("/health")[1]["status"] == "ok"


def _host_idle(cluster: ServingCluster) -> bool:
    """Only the host tier's prefix cache holds host blocks."""
    return cluster.metric("host_kv_blocks_used") == cluster.metric("prefix_cache_host_blocks")


def test_offloaded_requests_reuse_the_host_blocks_of_a_shared_prefix_and_a_reset_frees_them(cluster, client):
    """A prompt too long for the device pool is offloaded; sent again, it starts from the host blocks
    its first run left named (reported as cached) and gives the same greedy text; a request sharing
    only its prefix reuses those blocks too. Idle, only the cache holds host blocks, and a reset of
    the prefix cache frees them all."""
    prompt = TEXT[20000:30000]  # ~2.4k tokens

    def complete(text: str):
        return client.completions.create(model=MODEL, prompt=text, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})

    before = cluster.metric("offloaded_admissions_total", worker="0")
    cold, warm, sharer = complete(prompt), complete(prompt), complete(prompt + " And more.")
    assert cluster.metric("offloaded_admissions_total", worker="0") == before + 3
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    blocks = (cold.usage.prompt_tokens - 1) // 16
    assert warm.usage.prompt_tokens_details.cached_tokens == blocks * 16  # every full block but the last token's
    assert warm.choices[0].text == cold.choices[0].text
    assert sharer.usage.prompt_tokens_details.cached_tokens >= blocks * 16
    assert cluster.metric("prefix_cache_host_hits_total", worker="0") >= 2 * blocks * 16  # counted as the host tier's
    cluster.wait_for(lambda: cluster.metric("num_requests_running") == 0 and _host_idle(cluster), 30, "the host tier to be idle")
    assert cluster.metric("prefix_cache_host_blocks") >= blocks
    status, body = cluster.request("/reset_prefix_cache", {})
    assert status == 200 and body["freed_blocks"] >= blocks

    def empty() -> bool:
        return cluster.metric("host_kv_blocks_used") == 0 == cluster.metric("prefix_cache_host_blocks")

    cluster.wait_for(empty, 10, "an empty host tier")
    assert complete(prompt).usage.prompt_tokens_details.cached_tokens == 0


def _complete(client: openai.OpenAI, text: str):
    return client.completions.create(model=MODEL, prompt=text, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})


def _demoted_then_promoted(cluster: ServingCluster, client: openai.OpenAI, start: int) -> int:
    """A resident prompt of ~420 tokens, then four others of ~520 that fill the 2048-token device pool,
    so that its cached blocks are evicted and demoted to the host tier; sent again, it promotes them
    back: the same greedy text, every full block cached. Returns the blocks promoted."""
    prompt = TEXT[start : start + 2000]
    demoted = cluster.metric("prefix_cache_demoted_blocks_total", worker="0")
    promoted = cluster.metric("prefix_cache_promoted_blocks_total", worker="0")
    first = _complete(client, prompt)
    for i in range(4):
        assert not _complete(client, TEXT[start + 2000 + i * 2400 :][:2400]).usage.prompt_tokens_details.cached_tokens
    assert cluster.metric("prefix_cache_demoted_blocks_total", worker="0") > demoted
    assert cluster.metric("prefix_cache_host_demoted_blocks_total") > 0  # written by the host tier (it had none of them)
    again = _complete(client, prompt)
    assert again.choices[0].text == first.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens == (first.usage.prompt_tokens - 1) // 16 * 16
    now = cluster.metric("prefix_cache_promoted_blocks_total", worker="0")
    assert now > promoted
    return int(now - promoted)


def test_resident_requests_get_back_the_prefix_blocks_the_device_evicted_and_a_reset_empties_both_tiers(cluster, client):
    promoted = _demoted_then_promoted(cluster, client, 120000)
    block_bytes = cluster.metric("kv_store_block_bytes")
    assert block_bytes == 30 * UNIT_BYTES  # every layer of one block
    assert cluster.metric("prefix_cache_promoted_bytes_total", worker="0") >= promoted * block_bytes
    assert cluster.metric("prefix_cache_host_hits_total", worker="0") >= promoted * 16
    assert cluster.metric("prefix_cache_demoted_blocks_total", worker="0") >= cluster.metric("prefix_cache_host_demoted_blocks_total") > 0
    assert cluster.metric("tier_copy_seconds_total", worker="0") > 0
    cluster.wait_for(lambda: cluster.metric("num_requests_running") == 0 and _host_idle(cluster), 30, "both tiers to be idle")
    assert cluster.request("/reset_prefix_cache", {})[0] == 200

    def empty() -> bool:
        tiers = ("host_kv_blocks_used", "prefix_cache_host_blocks")
        return all(cluster.metric(name) == 0 for name in tiers) and cluster.metric("worker_device_kv_blocks_used", worker="0") == 0

    cluster.wait_for(empty, 10, "both tiers empty")
    assert cluster.metric("kv_allocators_corrupt") == 0


def _long_stream(client: openai.OpenAI, start: int, max_tokens: int):
    # ~2.4k tokens: more than the device pool holds with the output, so it is offloaded
    return client.completions.create(
        model=MODEL, prompt=TEXT[start : start + 10000], max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True}, stream=True
    )


def _fails_soon(events) -> Exception:
    """Reads a stream that must fail, and fail within TOLD_WITHIN_S; returns the error."""
    started = time.monotonic()
    try:
        for _ in events:
            pass
    except Exception as e:  # openai.APIError, or the HTTP library's own error for a connection closed mid-body
        assert time.monotonic() - started < TOLD_WITHIN_S, f"told after {time.monotonic() - started:.1f} s: {e}"
        return e
    raise AssertionError("the stream ended without an error")


def _resident_stream(client: openai.OpenAI, max_tokens: int):
    return client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=max_tokens, temperature=0, stream=True)


def _text(events) -> tuple[str, str | None]:
    chunks = list(events)
    return "".join(c.choices[0].text for c in chunks if c.choices), next(
        (c.choices[0].finish_reason for c in reversed(chunks) if c.choices), None
    )


def test_kill_9_of_the_kv_store_fails_its_requests_clearly_and_it_comes_back(cluster, client):
    _demoted_then_promoted(cluster, client, 140000)
    alone = _text(_resident_stream(client, 48))
    before = cluster.metric("offloaded_admissions_total", worker="0")
    events = iter(_long_stream(client, 1000, 400))
    next(events)
    assert cluster.metric("worker_requests_offloaded", worker="0") == 1
    resident = iter(_resident_stream(client, 48))  # needs no kv_store: the death must not harm it
    first = next(resident)
    victim = cluster.children()["kv_store"]
    os.kill(victim, signal.SIGKILL)
    assert "kv_store" in str(_fails_soon(events))
    rest, reason = _text(resident)
    assert (first.choices[0].text + rest, reason) == alone
    worker = cluster.children()["gpu_worker0"]
    cluster.wait_for(
        lambda: f"pulseinfer-kv-{victim}-" not in Path(f"/proc/{worker}/maps").read_text(), 5, "the worker to unmap the dead pool"
    )
    restarted = cluster.wait_for(lambda: cluster.children().get("kv_store") not in (None, victim) and cluster.children()["kv_store"], 60)
    KV_STORE_PIDS.add(restarted)
    cluster.wait_for(lambda: cluster.request("/health")[1].get("status") == "ok", 60, "the kv_store to answer again")
    assert not Path(f"/dev/shm/pulseinfer-kv-{victim}").exists()  # the new kv_store removed the dead one's segment
    text = "".join(e.choices[0].text for e in _long_stream(client, 50000, 8))
    assert text
    assert cluster.metric("offloaded_admissions_total", worker="0") == before + 2
    cluster.wait_for(lambda: _host_idle(cluster), 30, "the new pool to be free")
    _demoted_then_promoted(cluster, client, 145000)  # the worker demotes to and promotes from the new pool


def _kill_9_beside_an_offloaded_stream(cluster: ServingCluster, client: openai.OpenAI, start: int, child: str):
    """Blocks demoted and promoted first; then starts an offloaded stream and kills `child` with -9:
    the stream's events and the victim's pid."""
    _demoted_then_promoted(cluster, client, 150000 + start)
    events = iter(_long_stream(client, start, 400))
    next(events)
    assert cluster.metric("host_kv_blocks_used") > 0
    victim = cluster.children()[child]
    os.kill(victim, signal.SIGKILL)
    return events, victim


def test_kill_9_of_a_worker_frees_its_host_blocks_and_the_cluster_recovers(cluster, client):
    events, victim = _kill_9_beside_an_offloaded_stream(cluster, client, 30000, "gpu_worker0")
    _fails_soon(events)
    cluster.wait_for(lambda: _host_idle(cluster), 30, "the dead worker's host blocks to be freed")
    cluster.wait_for(lambda: cluster.request("/health")[1].get("workers_alive") == 1, 120, "the restarted worker")
    assert not Path(f"/dev/shm/pulseinfer-cache-{victim}").exists()  # swept by the kv_store, then by the new worker
    assert "".join(e.choices[0].text for e in _long_stream(client, 60000, 8))
    cluster.wait_for(lambda: _host_idle(cluster), 30, "the host pool to be free")


def test_kill_9_of_the_scheduler_tells_clients_at_once_and_its_requests_host_blocks_are_freed(cluster, client):
    events, _ = _kill_9_beside_an_offloaded_stream(cluster, client, 5000, "scheduler")
    assert "scheduler" in str(_fails_soon(events))
    cluster.wait_for(lambda: cluster.request("/health")[1].get("status") == "ok", 60, "the restarted scheduler and its worker")
    # the worker freed what the dead scheduler's requests held: nobody else would have
    cluster.wait_for(lambda: _host_idle(cluster), 10, "the dead scheduler's requests' host blocks to be freed")
    assert "".join(e.choices[0].text for e in _long_stream(client, 70000, 8))
    cluster.wait_for(lambda: _host_idle(cluster), 30, "the host pool to be free")


def test_kill_9_of_the_gateway_ends_its_streams_and_the_cluster_frees_their_requests(cluster, client):
    events, victim = _kill_9_beside_an_offloaded_stream(cluster, client, 9000, "gateway")
    _fails_soon(events)  # a dead process writes nothing more: the connection closes mid-body, which the client reports
    cluster.wait_for(lambda: cluster.children().get("gateway") not in (None, victim), 30, "the gateway restart")
    cluster.wait_for(lambda: _answers(cluster), 120, "the restarted gateway")

    def freed() -> bool:
        return cluster.metric("num_requests_running") == 0 and _host_idle(cluster)

    cluster.wait_for(freed, 10, "the scheduler to free the requests of the dead gateway")
    assert "".join(e.choices[0].text for e in _long_stream(client, 80000, 8))


def _answers(cluster: ServingCluster) -> bool:
    try:
        return cluster.request("/health")[1].get("status") == "ok"
    except OSError:
        return False


def test_deadline_truncates_through_the_kv_store_engine_and_frees_both_tiers():
    """The worker's recalls go to the kv_store's I/O engine in parts; attention runs over what
    landed, the rest is counted on /metrics; both tiers are free again afterwards."""
    cluster = ServingCluster(*FLAGS, "--recall-deadline-ms", "0", "--host-kv-tokens", "16384")
    KV_STORE_PIDS.add(cluster.children()["kv_store"])  # the module's fixture checks it left no segment
    try:
        client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="none", max_retries=0)

        def complete(start: int) -> str:
            got = client.completions.create(model=MODEL, prompt=TEXT[start : start + 3000], max_tokens=8, temperature=0)
            return got.choices[0].finish_reason

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            reasons = list(pool.map(complete, range(0, 40000, 5000)))
        assert reasons == ["length"] * 8
        assert cluster.metric("offloaded_admissions_total", worker="0") > 0
        assert cluster.metric("kv_store_engine_recalls_total") > 0
        # a 0 ms deadline: attention went on without blocks still in flight, and said so
        assert 0 < cluster.metric("recall_truncated_units_total", worker="0") <= cluster.metric("recall_units_total", worker="0")

        def drained() -> bool:
            used = cluster.metric("worker_device_kv_blocks_used", worker="0")
            cached = cluster.metric("prefix_cache_device_blocks", worker="0")
            return used == cached and _host_idle(cluster)

        cluster.wait_for(drained, 60, "both tiers to be free again")
        assert cluster.metric("kv_allocators_corrupt") == 0
    finally:
        assert cluster.stop() == 0


def test_a_dense_server_demotes_and_promotes_through_the_kv_store_and_through_a_restarted_one(client):
    """Dense mode has the host tier as its prefix cache's second level too: the worker maps the
    kv_store's pool itself; after a kill -9 of the kv_store it maps the new one and goes on."""
    cluster = ServingCluster(
        "--workers", "1", "--mode", "dense", "--offload", "never", "--device-kv-tokens", "2048", "--host-kv-tokens", "16384"
    )
    KV_STORE_PIDS.add(cluster.children()["kv_store"])
    try:
        dense = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="none", max_retries=0)
        promoted = _demoted_then_promoted(cluster, dense, 200000)
        assert promoted > 0 and cluster.metric("offloaded_admissions_total", worker="0") == 0
        victim = cluster.children()["kv_store"]
        os.kill(victim, signal.SIGKILL)
        restarted = cluster.wait_for(
            lambda: cluster.children().get("kv_store") not in (None, victim) and cluster.children()["kv_store"], 60
        )
        KV_STORE_PIDS.add(restarted)
        cluster.wait_for(lambda: cluster.request("/health")[1].get("status") == "ok", 60, "the kv_store to answer again")
        _demoted_then_promoted(cluster, dense, 220000)  # through the new pool: the worker mapped it anew
        cluster.wait_for(lambda: cluster.metric("num_requests_running") == 0 and _host_idle(cluster), 30, "the host tier to be idle")
        assert cluster.metric("kv_allocators_corrupt") == 0
    finally:
        assert cluster.stop() == 0
