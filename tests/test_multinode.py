"""Two nodes and a gateway as three hosts (tests/emulated_nodes.py: network, PID and mount
namespaces; mutual TLS between them), driven with the official openai client from the gateway's
namespace: prefix-aware routing, spreading, a node killed and a link cut (only that node's
requests fail, within 5 s; the others' texts do not change; new requests go elsewhere; the node
rejoins), and no shared-memory segment or ipc path shared by two nodes.

The nodes run --mode dense: routing, failures and isolation do not depend on the attention mode,
and dense starts fastest (no key-basis fit)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import openai
import pytest
from tls_certs import make_certs

from pulseinfer.bench.emulated_nodes import HTTP_PORT, NODE_PORT, EmulatedCluster, missing
from pulseinfer.common.tls import TlsConfig

NODES = 2
NODE_FLAGS = ["--mode", "dense", "--host-kv-tokens", "16384", "--startup-timeout-s", "240"]
STARTUP_S = 300.0
FAIL_WITHIN_S = 5.0
DECODE = dict(max_tokens=40, temperature=0.0, extra_body={"ignore_eos": True})

pytestmark = pytest.mark.skipif(missing() is not None, reason=f"the emulated cluster {missing()}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> EmulatedCluster:
    logs = tmp_path_factory.mktemp("emulated-nodes")
    certs = make_certs(logs / "tls", [EmulatedCluster.name(i) for i in range(NODES)])
    emulated = EmulatedCluster(NODES, logs, NODE_FLAGS, certs.flags())
    emulated.certs = certs
    try:
        emulated.build()
        for i in range(NODES):
            emulated.start_node(i)
        emulated.start_gateway("cache_aware")
        wait_all_up(emulated)
        emulated.model = emulated.run(lambda: client().models.list().data[0].id)
        yield emulated
    finally:
        emulated.close()


def wait_all_up(cluster: EmulatedCluster, timeout_s: float = STARTUP_S, port: int = HTTP_PORT) -> None:
    names = {cluster.name(i) for i in range(NODES)}
    cluster.wait_until(lambda: cluster.node_states(port) == dict.fromkeys(names, "up"), "every node up at the gateway", timeout_s)


def client(port: int = HTTP_PORT) -> openai.OpenAI:
    # a guard against hangs, not a timing: on a loaded 2-core CI machine one request here took over 60 s
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=150)


def complete(cluster: EmulatedCluster, prompt: str, port: int = HTTP_PORT, **kwargs) -> openai.types.Completion:
    return cluster.run(lambda: client(port).completions.create(model=cluster.model, prompt=prompt, **{**DECODE, **kwargs}))


def queries_per_node(cluster: EmulatedCluster) -> list[float]:
    """Prompt tokens each node has looked up in its prefix cache: where requests went."""
    return [cluster.node_metrics(i).get("pulseinfer:prefix_cache_queries_total", 0.0) for i in range(NODES)]


def delta(before: list[float], after: list[float]) -> list[float]:
    return [b - a for a, b in zip(before, after, strict=True)]


def story(topic: str) -> str:
    """A prompt of a few hundred tokens that starts with `topic` (distinct topics share no block)."""
    return f"{topic}. " + " ".join(f"Chapter {k} of the report on {topic} lists its findings in order." for k in range(12))


def test_a_shared_prefix_lands_on_the_node_that_caches_it(cluster):
    shared = story("Tidal energy in northern estuaries")
    first = complete(cluster, shared + " Summary 0:", max_tokens=2)
    before = queries_per_node(cluster)
    for k in range(1, 5):
        reply = complete(cluster, shared + f" Summary {k}:", max_tokens=2)
        assert reply.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 2 * 16, reply.usage
    went = delta(before, queries_per_node(cluster))
    assert sorted(went)[0] == 0 and sorted(went)[1] > 0, f"the follow-ups were split between nodes: {went}"


def test_distinct_prompts_spread_over_the_nodes(cluster):
    before = queries_per_node(cluster)
    for topic in ("Volcanic soils", "Medieval bridges", "Arctic shipping", "Paper mills", "Bee colonies", "Salt marshes"):
        complete(cluster, story(topic), max_tokens=2)
    went = delta(before, queries_per_node(cluster))
    assert all(tokens > 0 for tokens in went), f"one node took every distinct prompt: {went}"


HEALTH_CHECK = """
import sys, grpc
from pathlib import Path
from grpc_health.v1 import health_pb2, health_pb2_grpc
target, name, ca, key, cert = sys.argv[1:]
if ca == "-":
    channel = grpc.insecure_channel(target)
else:
    read = lambda p: Path(p).read_bytes() if p != "-" else None
    credentials = grpc.ssl_channel_credentials(read(ca), read(key), read(cert))
    channel = grpc.secure_channel(target, credentials, options=(("grpc.ssl_target_name_override", name),))
try:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    print(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
except grpc.RpcError as e:
    print(e.code().name)
"""


def test_a_second_gateway_routes_by_the_block_events_of_the_nodes(cluster):
    """Replicas share nothing but what the nodes publish: a prefix one gateway placed is found by
    another, which never saw it, in the node's stored-block events."""
    second = HTTP_PORT + 10
    cluster.start_gateway("cache_aware", port=second)
    try:
        wait_all_up(cluster, port=second)
        for topic in ("Glacier retreat", "Printing presses", "Coral spawning"):
            shared = story(topic)
            complete(cluster, shared + " Note 0:", max_tokens=2)  # through the first gateway
            time.sleep(1.0)  # the node's events reach the second gateway
            before = queries_per_node(cluster)
            reply = complete(cluster, shared + " Note 1:", port=second, max_tokens=2)
            went = delta(before, queries_per_node(cluster))
            assert reply.usage.prompt_tokens_details.cached_tokens > 0 and min(went) == 0, (topic, went, reply.usage)
        _, metrics = cluster.http(f"http://127.0.0.1:{second}/metrics")
        hits = [line for line in str(metrics).splitlines() if line.startswith("pulseinfer:router_requests_total") and "cache_hit" in line]
        assert sum(float(line.rsplit(" ", 1)[1]) for line in hits) == 3, hits
    finally:
        cluster.stop_gateway(second)


def test_mutual_tls_refuses_clients_without_the_clusters_certificate(cluster, tmp_path):
    stranger = make_certs(tmp_path / "stranger", [cluster.name(0)])
    target, name, ca = f"{cluster.address(0)}:{NODE_PORT}", cluster.name(0), str(cluster.certs.ca)

    def check(*files: object) -> str:
        return cluster.python(HEALTH_CHECK, target, name, *map(str, files))

    assert check(ca, cluster.certs.key, cluster.certs.cert) == "SERVING"
    assert check("-", "-", "-") == "UNAVAILABLE"  # plaintext
    assert check(ca, "-", "-") == "UNAVAILABLE"  # TLS without a client certificate
    assert check(ca, stranger.key, stranger.cert) == "UNAVAILABLE"  # a certificate the cluster's CA did not sign
    with pytest.raises(ValueError, match="not a loopback address"):
        TlsConfig().check_plaintext(target, "--nodes")


def test_no_shared_memory_segment_or_ipc_path_crosses_nodes(cluster):
    host_shm = {p.name for p in Path("/dev/shm").iterdir()}
    seen: list[tuple[set[str], set[str]]] = []
    for i in range(NODES):
        root = Path(f"/proc/{cluster.node_pid(i)}/root")  # the node's own view of its files
        segments = {p.name for p in (root / "dev/shm").iterdir() if p.name.startswith("pulseinfer-")}
        tmpdir = cluster.tmpdir(i)
        run_dirs = {p.name for p in (root / tmpdir.relative_to("/")).iterdir() if p.name.startswith("pulseinfer-run-")}
        assert segments and run_dirs, f"{cluster.name(i)} shows no segment or run directory: {segments}, {run_dirs}"
        assert not segments & host_shm, "a node's shared-memory segment is visible on the host"
        assert not list(tmpdir.iterdir()), "a node's run directory is visible on the host"
        for other_segments, other_dirs in seen:
            assert not segments & other_segments and not run_dirs & other_dirs
        seen.append((segments, run_dirs))


def references(cluster: EmulatedCluster, prompts: list[str]) -> list[str]:
    """Each prompt's text on a healthy cluster (greedy), all at once as the failure run sends them."""

    def one(prompt: str) -> str:
        return client().completions.create(model=cluster.model, prompt=prompt, **DECODE).choices[0].text

    return list(cluster.client.map(one, prompts))


def stream_all(cluster: EmulatedCluster, prompts: list[str], started: threading.Barrier) -> list:
    """Streams every prompt at once; each outcome: (text, finish_reason or the error, when it ended)."""

    def one(prompt: str):
        text, reason = "", None
        try:
            stream = client().completions.create(model=cluster.model, prompt=prompt, stream=True, **DECODE)
            for chunk in stream:
                if not text and chunk.choices and chunk.choices[0].text:
                    started.wait(timeout=60)
                text += chunk.choices[0].text if chunk.choices else ""
                reason = (chunk.choices[0].finish_reason if chunk.choices else None) or reason
        except (openai.APIError, threading.BrokenBarrierError) as e:
            reason = f"error: {e}"
        return text, reason, time.monotonic()

    return list(cluster.client.map(one, prompts))


def index_blocks(cluster: EmulatedCluster, i: int) -> float:
    """The block names the gateway believes node i holds."""
    _, text = cluster.http(f"http://127.0.0.1:{HTTP_PORT}/metrics")
    wanted = f'pulseinfer:router_index_blocks{{node="{cluster.name(i)}:{NODE_PORT}"}}'
    return next((float(line.rsplit(" ", 1)[1]) for line in str(text).splitlines() if line.startswith(wanted)), 0.0)


def in_flight(cluster: EmulatedCluster) -> dict[str, int]:
    _, body = cluster.http(f"http://127.0.0.1:{HTTP_PORT}/health")
    return {address.split(":")[0]: node["in_flight"] for address, node in body["nodes"].items()}


@pytest.mark.parametrize("failure", ["kill -9", "link down"])
def test_a_lost_node_fails_only_its_requests_and_rejoins(cluster, failure):
    topics = [f"{failure} case {k}: the {word} ledger" for k, word in enumerate(("copper", "linen", "amber", "cedar"))]
    prompts = [story(t) for t in topics]
    expected = references(cluster, prompts)
    started = threading.Barrier(len(prompts) + 1)
    outcome: dict = {}
    runner = threading.Thread(target=lambda: outcome.setdefault("streams", stream_all(cluster, prompts, started)))
    runner.start()
    started.wait(timeout=120)  # every stream has its first token
    spread = in_flight(cluster)
    victim = max(range(NODES), key=lambda i: spread[cluster.name(i)])
    lost = spread[cluster.name(victim)]
    assert lost and lost < len(prompts), f"the requests did not spread over the nodes: {spread}"
    cut_at = time.monotonic()
    if failure == "kill -9":
        cluster.kill_node(victim)
    else:
        cluster.link(victim, up=False)
    runner.join(timeout=180)
    streams = outcome["streams"]
    failed = [
        (text, reason, ended) for text, reason, ended in streams if str(reason).startswith("error") or reason not in ("length", "stop")
    ]
    assert len(failed) == lost, f"{lost} requests ran on {cluster.name(victim)}, {len(failed)} failed: {streams}"
    assert all(ended - cut_at < FAIL_WITHIN_S for _, _, ended in failed), [ended - cut_at for _, _, ended in failed]
    for (text, reason, _), reference in zip(streams, expected, strict=True):
        if (text, reason, _) not in failed:
            assert text == reference, "a request on the surviving node changed its text"

    # new requests go to the other node meanwhile
    survivor = 1 - victim
    before = cluster.node_metrics(survivor).get("pulseinfer:prefix_cache_queries_total", 0.0)
    assert complete(cluster, story(f"after the {failure}"), max_tokens=2).choices[0].finish_reason == "length"
    assert cluster.node_metrics(survivor).get("pulseinfer:prefix_cache_queries_total", 0.0) > before

    if failure == "kill -9":
        cluster.start_node(victim)
    else:
        cluster.link(victim, up=True)
    wait_all_up(cluster)
    if failure == "link down":  # the node kept its caches: the gateway learns them again from a snapshot of its events
        cluster.wait_until(lambda: index_blocks(cluster, victim) > 0, "the rejoined node's index restored", 10)
    before = queries_per_node(cluster)
    for k in range(4):
        complete(cluster, story(f"rejoined {failure} {k}"), max_tokens=2)
    assert delta(before, queries_per_node(cluster))[victim] > 0, "the node that came back gets no requests"
