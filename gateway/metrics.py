"""Prometheus text exposition for the few metric kinds the gateway keeps (no client library)."""

from __future__ import annotations

import bisect
from collections import defaultdict

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

Labels = tuple[tuple[str, str], ...]


def _labels(labels: Labels) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}" if labels else ""


class Counter:
    def __init__(self, name: str, help_text: str, kind: str = "counter"):
        self.name, self.help, self.kind = name, help_text, kind
        self.values: dict[Labels, float] = defaultdict(float)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        self.values[tuple(sorted(labels.items()))] += amount

    def set(self, value: float, **labels: str) -> None:
        """For gauges, and for counters kept by another process (copied from its stats)."""
        self.values[tuple(sorted(labels.items()))] = value

    def reset(self) -> None:
        self.values.clear()

    def samples(self) -> list[str]:
        return [f"{self.name}{_labels(k)} {v}" for k, v in self.values.items()]


def Gauge(name: str, help_text: str) -> Counter:  # noqa: N802 - reads like the metric kind it makes
    return Counter(name, help_text, kind="gauge")


class Histogram:
    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self.name, self.help, self.buckets = name, help_text, buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def samples(self) -> list[str]:
        lines, total = [], 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            total += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'{self.name}_bucket{{le="{le}"}} {total}')
        return lines + [f"{self.name}_sum {self.sum}", f"{self.name}_count {total}"]


def render(metrics: list[Counter | Histogram]) -> str:
    out = []
    for m in metrics:
        out += [f"# HELP {m.name} {m.help}", f"# TYPE {m.name} {m.kind}", *m.samples()]
    return "\n".join(out) + "\n"


PREFIX = "pulseinfer:"


class ClusterMetrics:
    """What a node's scheduler reports (SchedulerStats), vLLM-style names under the pulseinfer: prefix:
    a node's own /metrics (pulseinfer/node_status.py), and the gateway's for its nodes summed."""

    def __init__(self):
        p = PREFIX
        self.running = Gauge(p + "num_requests_running", "Requests in a worker's running batch.")
        self.waiting = Gauge(p + "num_requests_waiting", "Requests queued for a worker.")
        self.device_kv = Gauge(p + "gpu_cache_usage_perc", "Share of the workers' device KV blocks in use (0-1).")
        self.host_kv = Gauge(p + "cpu_cache_usage_perc", "Share of the kv_store host KV blocks in use (0-1).")
        self.workers_alive = Gauge(p + "workers_alive", "Workers with a recent heartbeat.")
        self.worker_running = Gauge(p + "worker_requests_running", "Requests in the worker's running batch.")
        self.batch = Gauge(p + "decode_batch_size", "Sequences in the worker's last decode step.")
        self.batch_max = Gauge(p + "decode_batch_size_max", "Largest decode batch the worker has run.")
        self.steps = Counter(p + "steps_total", "Steps (prefill and/or decode) the worker has run.")
        self.decode_steps = Counter(p + "decode_steps_total", "Decode steps the worker has run.")
        self.decode_tokens = Counter(p + "decode_tokens_total", "Sequence-steps decoded by the worker (sum of decode batch sizes).")
        self.step_overhead = Counter(
            p + "step_overhead_seconds_total", "Step round trip, from when the worker could start it, not in the forward."
        )
        self.preemptions = Counter(p + "num_preemptions_total", "Sequences preempted for lack of device KV blocks.")
        self.offloaded = Gauge(p + "worker_requests_offloaded", "Running requests whose KV lives mostly in the host pool.")
        self.offloaded_admissions = Counter(p + "offloaded_admissions_total", "Requests admitted as offloaded.")
        self.device_blocks_used = Gauge(p + "worker_device_kv_blocks_used", "Device KV blocks in use on the worker (its capped pool).")
        self.device_blocks_total = Gauge(p + "worker_device_kv_blocks_total", "Device KV blocks of the worker's capped pool.")
        self.host_blocks_used = Gauge(p + "host_kv_blocks_used", "kv_store host KV blocks in use.")
        self.host_blocks_total = Gauge(p + "host_kv_blocks_total", "kv_store host KV blocks.")
        self.engine_recalls = Counter(p + "kv_store_engine_recalls_total", "Layer recalls the kv_store's I/O engine completed.")
        self.engine_busy = Counter(p + "kv_store_engine_busy_seconds_total", "Time the kv_store's I/O engine spent copying recalls.")
        self.host_prefix_blocks = Gauge(p + "prefix_cache_host_blocks", "Host KV blocks the prefix cache names now.")
        self.host_prefix_demoted = Counter(
            p + "prefix_cache_host_demoted_blocks_total", "Evicted device KV blocks the host tier wrote and named (it had the rest)."
        )
        self.host_prefix_demoted_bytes = Counter(p + "prefix_cache_host_demoted_bytes_total", "Bytes of those blocks.")
        self.promoted_bytes = Counter(p + "prefix_cache_promoted_bytes_total", "Bytes of the host KV blocks promoted to the device.")
        self.block_bytes = Gauge(p + "kv_store_block_bytes", "One KV block, every layer: what a demotion or promotion of a block moves.")
        self.host_prefix_evicted = Counter(
            p + "prefix_cache_host_evicted_blocks_total", "Host KV blocks the prefix cache dropped (for room or by a reset)."
        )
        # WorkerStats fields copied as they are: recalls (recall_<RecallStats field>), and the offloading admission's inputs
        self.by_field = {
            **{f"recall_{name}": Counter(p + f"recall_{_seconds(name)}_total", text) for name, text in RECALL_HELP.items()},
            "link_bytes_per_s": Gauge(p + "admission_link_bytes_per_second", "Bandwidth the recalls achieved while copying (EMA)."),
            "recall_bytes_per_offloaded_step": Gauge(
                p + "admission_recall_bytes_per_offloaded_step", "Recall bytes one offloaded request adds per decode step (EMA)."
            ),
            "decode_compute_s": Gauge(p + "admission_decode_compute_seconds", "Predicted compute time of a decode step now."),
            "max_running": Gauge(
                p + "worker_max_running", "Requests the worker runs at once: its sliding-window rings (0: no cap of its own)."
            ),
            "held_for_link": Counter(
                p + "admission_held_for_link_total", "Requests that waited because their recall would not hide behind compute."
            ),
            # the prefix cache of the device tier: hit rate = hits / queries
            "prefix_cached_blocks": Gauge(p + "prefix_cache_device_blocks", "Device KV blocks the prefix cache names now."),
            "prefix_evicted_blocks": Counter(
                p + "prefix_cache_device_evicted_blocks_total", "Device KV blocks the prefix cache dropped (for room or by a reset)."
            ),
            "prefix_queried_tokens": Counter(p + "prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache."),
            "prefix_hit_tokens": Counter(p + "prefix_cache_hits_total", "Prompt tokens whose KV the prefix cache had."),
            "prefix_host_hit_tokens": Counter(
                p + "prefix_cache_host_hits_total",
                "Of the prefix cache's hits, tokens found in the host tier (offloaded requests' reuse and promotions).",
            ),
            # the KV hierarchy: bytes = blocks x kv_store_block_bytes
            "prefix_promoted_blocks": Counter(
                p + "prefix_cache_promoted_blocks_total", "Host KV blocks loaded into device blocks for resident requests."
            ),
            "prefix_demoted_blocks": Counter(
                p + "prefix_cache_demoted_blocks_total", "Evicted device KV blocks sent to the host tier (written unless it had them)."
            ),
            # the control plane (DESIGN.md section 10): busy / (busy + idle) is the share of the worker's time inside its forward
            "busy_s": Counter(p + "worker_busy_seconds_total", "Time the worker spent inside its forward."),
            "idle_s": Counter(
                p + "worker_idle_seconds_total", "Time the worker spent between forwards while it had a plan to run or awaited one."
            ),
            "plan_bytes": Counter(p + "plan_bytes_total", "Bytes of the serialized step plans sent to the worker."),
            "steady_steps": Counter(
                p + "steady_decode_steps_total", "Steps that only decode running requests (no admission, no prefill chunk)."
            ),
            "steady_plan_bytes": Counter(p + "steady_decode_plan_bytes_total", "Bytes of the steady decode steps' plans."),
            "steady_plan_bytes_max": Gauge(p + "steady_decode_plan_bytes_max", "Bytes of the largest steady decode step's plan."),
            "inflight": Gauge(p + "plans_in_flight", "Plans sent to the worker whose result has not come back."),
            "tier_copy_s": Counter(
                p + "tier_copy_seconds_total", "Time the worker spent demoting and promoting prefix blocks before its forwards."
            ),
            "tier_copy_s_max": Gauge(p + "tier_copy_seconds_max", "The most one step spent demoting and promoting before its forward."),
            "isolated_failures": Counter(
                p + "step_isolated_failures_total", "Requests that failed alone in a step that raised; the step's other requests ran."
            ),
        }
        self.prefix_hit_rate = Gauge(p + "prefix_cache_hit_rate", "Share of prompt tokens found in the prefix cache (0-1).")
        self.allocators_corrupt = Gauge(p + "kv_allocators_corrupt", "Block allocators failing their self-check (0: healthy).")
        self.scheduler_cpu = Counter(p + "scheduler_cpu_seconds_total", "CPU time of the scheduler process since it started.")
        self.overlap = Gauge(p + "overlap", "Overlapped scheduling: 1 when each worker's next plan is queued while it runs a step.")
        self.per_worker = [
            self.offloaded,
            self.offloaded_admissions,
            self.device_blocks_used,
            self.device_blocks_total,
            self.worker_running,
            self.batch,
            self.batch_max,
            self.steps,
            self.decode_steps,
            self.decode_tokens,
            self.step_overhead,
            self.preemptions,
            self.prefix_hit_rate,
            self.promoted_bytes,
            *self.by_field.values(),
        ]

    def set_cluster(self, stats) -> None:
        """Copies the scheduler's SchedulerStats into the gauges."""
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.workers_alive.set(stats.workers_alive)
        self.device_kv.set(_used(stats.device_blocks_total, stats.device_blocks_free))
        self.host_kv.set(_used(stats.host_blocks_total, stats.host_blocks_free))
        self.host_blocks_used.set(stats.host_blocks_total - stats.host_blocks_free)
        self.host_blocks_total.set(stats.host_blocks_total)
        self.engine_recalls.set(stats.kv_store_engine_recalls)
        self.engine_busy.set(stats.kv_store_engine_busy_s)
        self.host_prefix_blocks.set(stats.host_prefix_cached_blocks)
        self.host_prefix_evicted.set(stats.host_prefix_evicted_blocks)
        self.host_prefix_demoted.set(stats.host_prefix_demoted_blocks)
        self.host_prefix_demoted_bytes.set(stats.host_prefix_demoted_blocks * stats.host_block_bytes)
        self.block_bytes.set(stats.host_block_bytes)
        self.allocators_corrupt.set(sum(1 for w in stats.workers if w.integrity_error) + bool(stats.host_integrity_error))
        self.scheduler_cpu.set(stats.cpu_s)
        self.overlap.set(float(stats.overlap))
        for metric in self.per_worker:
            metric.reset()
        for w in stats.workers:
            label = f"{w.node_name}/{w.worker_id}" if w.node_name else str(w.worker_id)
            self.worker_running.set(w.running, worker=label)
            self.batch.set(w.last_decode_batch, worker=label)
            self.batch_max.set(w.max_decode_batch, worker=label)
            self.steps.set(w.steps, worker=label)
            self.decode_steps.set(w.decode_steps, worker=label)
            self.decode_tokens.set(w.decode_tokens, worker=label)
            self.step_overhead.set(w.step_overhead_s, worker=label)
            self.preemptions.set(w.preemptions, worker=label)
            self.offloaded.set(w.offloaded, worker=label)
            self.offloaded_admissions.set(w.offloaded_admissions, worker=label)
            self.device_blocks_used.set(w.device_blocks_total - w.device_blocks_free, worker=label)
            self.device_blocks_total.set(w.device_blocks_total, worker=label)
            for name, metric in self.by_field.items():
                metric.set(getattr(w, name), worker=label)
            self.prefix_hit_rate.set(w.prefix_hit_tokens / w.prefix_queried_tokens if w.prefix_queried_tokens else 0.0, worker=label)
            self.promoted_bytes.set(w.prefix_promoted_blocks * stats.host_block_bytes, worker=label)

    def render(self) -> str:
        return render([v for v in vars(self).values() if isinstance(v, (Counter, Histogram))] + list(self.by_field.values()))


class GatewayMetrics(ClusterMetrics):
    """The nodes' metrics and the gateway's own: requests as its clients saw them."""

    def __init__(self):
        super().__init__()
        p = PREFIX
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time from request arrival to its first token.")
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time between consecutive tokens of a request.")
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Time from request arrival to its end.")
        self.prompt_tokens = Counter(p + "prompt_tokens_total", "Prompt tokens of admitted requests.")
        self.prompt_tokens_scored = Counter(p + "prompt_tokens_scored_total", "Prompt tokens whose logprobs the workers computed.")
        self.generation_tokens = Counter(p + "generation_tokens_total", "Generated tokens.")
        self.finished = Counter(p + "request_success_total", "Requests finished, by finish reason.")
        self.errors = Counter(p + "request_errors_total", "Requests rejected or failed, by status code.")
        self.grammar_checks = Counter(p + "grammar_checks_total", "Structured outputs checked (once a request, whatever its n), by result.")
        self.routed = Counter(p + "router_requests_total", "Requests the gateway sent to each node, and why it chose it.")
        self.node_up = Gauge(p + "router_node_up", "1 while the node answers the gateway's polls, 0 while it does not.")
        self.index_blocks = Gauge(p + "router_index_blocks", "KV block names the router believes the node holds.")
        self.block_events = Counter(p + "router_block_events_total", "Block names the node's events stored or removed.")


def _seconds(name: str) -> str:
    """A field's name in Prometheus' units: wait_s -> wait_seconds."""
    return name.removesuffix("_s") + "_seconds" if name.endswith("_s") else name


def _used(total: int, free: int) -> float:
    return (total - free) / total if total else 0.0
