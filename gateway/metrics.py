"""Prometheus metrics through prometheus_client, one registry per metrics object (a process may run
several gateways: the tests do). What the nodes' schedulers report (SchedulerStats, polled) is read
at scrape time by a collector from the latest snapshot; what the gateway sees itself (its requests)
is counted by prometheus_client's Counter, Gauge and Histogram."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pulseinfer.proto.pulseinfer.v1 import generate_pb2

__all__ = ["CONTENT_TYPE_LATEST", "LATENCY_BUCKETS", "PREFIX", "RECALL_HELP", "ClusterMetrics", "GatewayMetrics"]

# RecallStats' fields (pulseinfer/messages/plan.py), in order: WorkerStats carries each as recall_<field>,
# /metrics as pulseinfer:recall_<field>_total (seconds spelled out)
RECALL_HELP = {
    "units": "Units recalled from the host pool: (block, layer), or (block, layer, head) head-wise.",
    "transfers": "Contiguous host ranges read by recalls.",
    "bytes": "Bytes recalled from the host pool.",
    "wait_s": "Time the worker's compute was blocked on recalls.",
    "prefetched_units": "Units recalled a layer ahead from a predicted query.",
    "corrected_units": "Units the true query added to a layer-ahead selection.",
    "io_busy_s": "Time the recall copies took (the link busy).",
    "truncated_units": "Selected units attention ran without: their recall missed the layer's deadline.",
    "suspended_rows": "Decode rows suspended at a layer for their recalls while the other rows attended.",
    "resumed_layers": "Layers run apart by decode rows resuming after a suspension (layer cursors): each reads its weights again.",
}
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
PREFIX = "pulseinfer:"

Stats = generate_pb2.SchedulerStats
Worker = generate_pb2.WorkerStats


@dataclass(frozen=True)
class Stat:
    """One metric read from a SchedulerStats: the cluster's (`value(stats)`), or one sample per worker
    labelled worker="[node/]id" (`value(worker, stats)`). Counter names end in _total, as exported."""

    kind: str  # gauge | counter
    name: str
    help: str
    value: Callable[..., float]
    per_worker: bool = False


def _cluster(kind: str, name: str, help_text: str, value: Callable[[Stats], float]) -> Stat:
    return Stat(kind, PREFIX + name, help_text, value)


def _worker(kind: str, name: str, help_text: str, value: Callable[[Worker, Stats], float]) -> Stat:
    return Stat(kind, PREFIX + name, help_text, value, per_worker=True)


def _field(kind: str, name: str, help_text: str, field: str) -> Stat:
    """A WorkerStats field copied as it is."""
    return _worker(kind, name, help_text, lambda w, _: getattr(w, field))


def _seconds(name: str) -> str:
    """A field's name in Prometheus' units: wait_s -> wait_seconds."""
    return name.removesuffix("_s") + "_seconds" if name.endswith("_s") else name


def _used(total: int, free: int) -> float:
    return (total - free) / total if total else 0.0


# What a node's scheduler reports (SchedulerStats), vLLM-style names under the pulseinfer: prefix
SCHEDULER_STATS: tuple[Stat, ...] = (
    _cluster("gauge", "num_requests_running", "Requests in a worker's running batch.", lambda s: s.running),
    _cluster("gauge", "num_requests_waiting", "Requests queued for a worker.", lambda s: s.waiting),
    _cluster(
        "gauge",
        "gpu_cache_usage_perc",
        "Share of the workers' device KV blocks in use (0-1).",
        lambda s: _used(s.device_blocks_total, s.device_blocks_free),
    ),
    _cluster(
        "gauge",
        "cpu_cache_usage_perc",
        "Share of the kv_store host KV blocks in use (0-1).",
        lambda s: _used(s.host_blocks_total, s.host_blocks_free),
    ),
    _cluster("gauge", "workers_alive", "Workers with a recent heartbeat.", lambda s: s.workers_alive),
    _worker("gauge", "worker_requests_running", "Requests in the worker's running batch.", lambda w, _: w.running),
    _worker("gauge", "decode_batch_size", "Sequences in the worker's last decode step.", lambda w, _: w.last_decode_batch),
    _worker("gauge", "decode_batch_size_max", "Largest decode batch the worker has run.", lambda w, _: w.max_decode_batch),
    _field("counter", "steps_total", "Steps (prefill and/or decode) the worker has run.", "steps"),
    _field("counter", "decode_steps_total", "Decode steps the worker has run.", "decode_steps"),
    _field("counter", "decode_tokens_total", "Sequence-steps decoded by the worker (sum of decode batch sizes).", "decode_tokens"),
    _field(
        "counter",
        "step_overhead_seconds_total",
        "Step round trip, from when the worker could start it, not in the forward.",
        "step_overhead_s",
    ),
    _field("counter", "num_preemptions_total", "Sequences preempted for lack of device KV blocks.", "preemptions"),
    _field("gauge", "worker_requests_offloaded", "Running requests whose KV lives mostly in the host pool.", "offloaded"),
    _field("counter", "offloaded_admissions_total", "Requests admitted as offloaded.", "offloaded_admissions"),
    _worker(
        "gauge",
        "worker_device_kv_blocks_used",
        "Device KV blocks in use on the worker (its capped pool).",
        lambda w, _: w.device_blocks_total - w.device_blocks_free,
    ),
    _field("gauge", "worker_device_kv_blocks_total", "Device KV blocks of the worker's capped pool.", "device_blocks_total"),
    _cluster("gauge", "host_kv_blocks_used", "kv_store host KV blocks in use.", lambda s: s.host_blocks_total - s.host_blocks_free),
    _cluster("gauge", "host_kv_blocks_total", "kv_store host KV blocks.", lambda s: s.host_blocks_total),
    _cluster(
        "counter",
        "kv_store_engine_recalls_total",
        "Layer recalls the kv_store's I/O engine completed.",
        lambda s: s.kv_store_engine_recalls,
    ),
    _cluster(
        "counter",
        "kv_store_engine_busy_seconds_total",
        "Time the kv_store's I/O engine spent copying recalls.",
        lambda s: s.kv_store_engine_busy_s,
    ),
    _cluster("gauge", "prefix_cache_host_blocks", "Host KV blocks the prefix cache names now.", lambda s: s.host_prefix_cached_blocks),
    _cluster(
        "counter",
        "prefix_cache_host_demoted_blocks_total",
        "Evicted device KV blocks the host tier wrote and named (it had the rest).",
        lambda s: s.host_prefix_demoted_blocks,
    ),
    _cluster(
        "counter",
        "prefix_cache_host_demoted_bytes_total",
        "Bytes of those blocks.",
        lambda s: s.host_prefix_demoted_blocks * s.host_block_bytes,
    ),
    _worker(
        "counter",
        "prefix_cache_promoted_bytes_total",
        "Bytes of the host KV blocks promoted to the device.",
        lambda w, s: w.prefix_promoted_blocks * s.host_block_bytes,
    ),
    _cluster(
        "gauge",
        "kv_store_block_bytes",
        "One KV block, every layer: what a demotion or promotion of a block moves.",
        lambda s: s.host_block_bytes,
    ),
    _cluster(
        "counter",
        "prefix_cache_host_evicted_blocks_total",
        "Host KV blocks the prefix cache dropped (for room or by a reset).",
        lambda s: s.host_prefix_evicted_blocks,
    ),
    _worker(
        "gauge",
        "prefix_cache_hit_rate",
        "Share of prompt tokens found in the prefix cache (0-1).",
        lambda w, _: w.prefix_hit_tokens / w.prefix_queried_tokens if w.prefix_queried_tokens else 0.0,
    ),
    _cluster(
        "gauge",
        "kv_allocators_corrupt",
        "Block allocators failing their self-check (0: healthy).",
        lambda s: sum(1 for w in s.workers if w.integrity_error) + bool(s.host_integrity_error),
    ),
    _cluster("counter", "scheduler_cpu_seconds_total", "CPU time of the scheduler process since it started.", lambda s: s.cpu_s),
    _cluster(
        "gauge",
        "overlap",
        "Overlapped scheduling: 1 when each worker's next plan is queued while it runs a step.",
        lambda s: float(s.overlap),
    ),
    # WorkerStats fields copied as they are: recalls (recall_<RecallStats field>), and the offloading admission's inputs
    *(_field("counter", f"recall_{_seconds(name)}_total", text, f"recall_{name}") for name, text in RECALL_HELP.items()),
    _field("gauge", "admission_link_bytes_per_second", "Bandwidth the recalls achieved while copying (EMA).", "link_bytes_per_s"),
    _field(
        "gauge",
        "admission_recall_bytes_per_offloaded_step",
        "Recall bytes one offloaded request adds per decode step (EMA).",
        "recall_bytes_per_offloaded_step",
    ),
    _field("gauge", "admission_decode_compute_seconds", "Predicted compute time of a decode step now.", "decode_compute_s"),
    _field(
        "gauge", "worker_max_running", "Requests the worker runs at once: its sliding-window rings (0: no cap of its own).", "max_running"
    ),
    _field(
        "counter",
        "admission_held_for_link_total",
        "Requests that waited because their recall would not hide behind compute.",
        "held_for_link",
    ),
    # the prefix cache of the device tier: hit rate = hits / queries
    _field("gauge", "prefix_cache_device_blocks", "Device KV blocks the prefix cache names now.", "prefix_cached_blocks"),
    _field(
        "counter",
        "prefix_cache_device_evicted_blocks_total",
        "Device KV blocks the prefix cache dropped (for room or by a reset).",
        "prefix_evicted_blocks",
    ),
    _field("counter", "prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.", "prefix_queried_tokens"),
    _field("counter", "prefix_cache_hits_total", "Prompt tokens whose KV the prefix cache had.", "prefix_hit_tokens"),
    _field(
        "counter",
        "prefix_cache_host_hits_total",
        "Of the prefix cache's hits, tokens found in the host tier (offloaded requests' reuse and promotions).",
        "prefix_host_hit_tokens",
    ),
    # the KV hierarchy: bytes = blocks x kv_store_block_bytes
    _field(
        "counter",
        "prefix_cache_promoted_blocks_total",
        "Host KV blocks loaded into device blocks for resident requests.",
        "prefix_promoted_blocks",
    ),
    _field(
        "counter",
        "prefix_cache_demoted_blocks_total",
        "Evicted device KV blocks sent to the host tier (written unless it had them).",
        "prefix_demoted_blocks",
    ),
    # the control plane (docs/control_plane.md): busy / (busy + idle) is the share of the worker's time inside its forward
    _field("counter", "worker_busy_seconds_total", "Time the worker spent inside its forward.", "busy_s"),
    _field(
        "counter",
        "worker_idle_seconds_total",
        "Time the worker spent between forwards while it had a plan to run or awaited one.",
        "idle_s",
    ),
    _field("counter", "plan_bytes_total", "Bytes of the serialized step plans sent to the worker.", "plan_bytes"),
    _field(
        "counter",
        "steady_decode_steps_total",
        "Steps that only decode running requests (no admission, no prefill chunk).",
        "steady_steps",
    ),
    _field("counter", "steady_decode_plan_bytes_total", "Bytes of the steady decode steps' plans.", "steady_plan_bytes"),
    _field("gauge", "steady_decode_plan_bytes_max", "Bytes of the largest steady decode step's plan.", "steady_plan_bytes_max"),
    _field("gauge", "plans_in_flight", "Plans sent to the worker whose result has not come back.", "inflight"),
    _field(
        "counter",
        "tier_copy_seconds_total",
        "Time the worker spent demoting and promoting prefix blocks before its forwards.",
        "tier_copy_s",
    ),
    _field("gauge", "tier_copy_seconds_max", "The most one step spent demoting and promoting before its forward.", "tier_copy_s_max"),
    _field(
        "counter",
        "step_isolated_failures_total",
        "Requests that failed alone in a step that raised; the step's other requests ran.",
        "isolated_failures",
    ),
)


def worker_label(w: Worker) -> str:
    return f"{w.node_name}/{w.worker_id}" if w.node_name else str(w.worker_id)


class SchedulerStatsCollector(Collector):
    """SCHEDULER_STATS from the latest snapshot, read at scrape time; before the first snapshot, each
    family without samples (its HELP and TYPE only)."""

    def __init__(self):
        self.stats: Stats | None = None

    def collect(self) -> Iterator[Metric]:
        stats = self.stats  # one snapshot for the whole scrape
        workers = [(w, worker_label(w)) for w in stats.workers] if stats is not None else []
        for stat in SCHEDULER_STATS:
            make = CounterMetricFamily if stat.kind == "counter" else GaugeMetricFamily
            family = make(stat.name, stat.help, labels=["worker"] if stat.per_worker else None)
            if stat.per_worker:
                for w, label in workers:
                    family.add_metric([label], stat.value(w, stats))
            elif stats is not None:
                family.add_metric([], stat.value(stats))
            yield family


class Registry(CollectorRegistry):
    """A CollectorRegistry without the <name>_created samples prometheus_client's Counter and Histogram
    add (OpenMetrics' creation times; the text format shows each as a gauge family of its own): /metrics
    keeps the names it had. Per registry, not prometheus_client.disable_created_metrics() (the process's)."""

    def collect(self) -> Iterator[Metric]:
        for family in super().collect():
            created = family.name + "_created"
            family.samples = [s for s in family.samples if s.name != created]
            yield family


class Labelled:
    """A prometheus_client Counter or Gauge with labels, counted or set with them as keywords:
    `inc(amount, node=...)`, `set(value, node=...)`; `labels(...)` as prometheus_client's."""

    def __init__(self, kind: type[Counter] | type[Gauge], name: str, help_text: str, labelnames: Sequence[str], registry: Registry):
        self.metric = kind(name, help_text, sorted(labelnames), registry=registry)

    def labels(self, **labels: str):
        return self.metric.labels(**labels)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        self.metric.labels(**labels).inc(amount)

    def set(self, value: float, **labels: str) -> None:
        self.metric.labels(**labels).set(value)


class ClusterMetrics:
    """What a node's scheduler reports (SchedulerStats), vLLM-style names under the pulseinfer: prefix:
    a node's own /metrics (pulseinfer/node_status.py), and the gateway's for its nodes summed."""

    def __init__(self):
        self.registry = Registry()
        self.scheduler = SchedulerStatsCollector()
        self.registry.register(self.scheduler)

    def set_cluster(self, stats: Stats) -> None:
        """The scheduler's SchedulerStats from now on (the next scrape reads them)."""
        self.scheduler.stats = stats

    def render(self) -> str:
        """The text exposition (its content type: CONTENT_TYPE_LATEST)."""
        return generate_latest(self.registry).decode()

    def value(self, name: str, **labels: str) -> float | None:
        """One sample's value as a scrape would read it (None: no such sample)."""
        return self.registry.get_sample_value(name, labels)


class GatewayMetrics(ClusterMetrics):
    """The nodes' metrics and the gateway's own: requests as its clients saw them."""

    def __init__(self):
        super().__init__()
        p, r = PREFIX, self.registry

        def latency(name: str, help_text: str) -> Histogram:
            return Histogram(p + name, help_text, buckets=LATENCY_BUCKETS, registry=r)

        def counter(name: str, help_text: str, *labels: str) -> Counter | Labelled:
            return Labelled(Counter, p + name, help_text, labels, r) if labels else Counter(p + name, help_text, registry=r)

        self.ttft = latency("time_to_first_token_seconds", "Time from request arrival to its first token.")
        self.itl = latency("inter_token_latency_seconds", "Time between consecutive tokens of a request.")
        self.e2e = latency("e2e_request_latency_seconds", "Time from request arrival to its end.")
        self.prompt_tokens = counter("prompt_tokens_total", "Prompt tokens of admitted requests.")
        self.prompt_tokens_scored = counter("prompt_tokens_scored_total", "Prompt tokens whose logprobs the workers computed.")
        self.generation_tokens = counter("generation_tokens_total", "Generated tokens.")
        self.finished = counter("request_success_total", "Requests finished, by finish reason.", "finished_reason")
        self.errors = counter("request_errors_total", "Requests rejected or failed, by status code.", "code")
        self.grammar_checks = counter(
            "grammar_checks_total", "Structured outputs checked (once a request, whatever its n), by result.", "result"
        )
        self.routed = counter("router_requests_total", "Requests the gateway sent to each node, and why it chose it.", "node", "reason")
        self.node_up = Labelled(
            Gauge, p + "router_node_up", "1 while the node answers the gateway's polls, 0 while it does not.", ["node"], r
        )
        self.index_blocks = Labelled(Gauge, p + "router_index_blocks", "KV block names the router believes the node holds.", ["node"], r)
        self.block_events = counter("router_block_events_total", "Block names the node's events stored or removed.", "node")
