"""The KV hierarchy on a trace replay: the prefix cache's hits with the host tier as the device
tier's second level (--host-prefix-cache on: evicted device blocks demoted, host blocks promoted
for resident requests) against each tier serving only its own placements (off), for dense,
pulse with IO-adaptive offloading, and pulse with every request offloaded, on a small device pool.

    pulseinfer bench prefix-tiers [--trace bench/traces/mooncake_conversation_trace.jsonl.gz] [--trace-conversations 12]
        [--length-scale 0.0625] [--time-scale 10] [--device-kv-tokens 8192] [--settings dense,pulse-auto,pulse-always]
        [--copy-blocks 1,8,32,64] [--window-model gemma-3-270m] [--json docs/results/prefix_tiers.json]

First, in this process (the default model, dense, an in-process host pool), what moving blocks
between the tiers costs a worker: demoting N blocks (reserve, copy every layer, name) and
promoting them back (one gather per layer), best of 5, beside computing one 512-token prefill
chunk; and on a model with sliding-window layers (`--window-model`, '' for none), what its prefix
cache saves a request reusing a 2,048-token prefix (its time to first token with the cache off
and on) and what rebuilding its window rings from the sliding layers' history costs.
`--settings ''` runs only these.

Each run starts its own `pulseinfer serve`, replays the slice with `pulseinfer bench serve`, waits
for the server to go idle and reads /metrics (both tiers: used blocks against the cached ones,
hits, demotions, promotions, the time steps spent copying between the tiers), then resets the
prefix cache and reads the tiers again (both must be empty), and stops the server. One server at
a time, nothing else running.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from pulseinfer.bench import serve
from pulseinfer.bench.cluster import ServingCluster
from pulseinfer.bench.mooncake import CONVERSATION_TRACE

SETTINGS = {
    "dense": ("--mode", "dense", "--offload", "never"),
    "pulse-auto": ("--mode", "pulse"),
    "pulse-always": ("--mode", "pulse", "--offload", "always", "--budget", "256"),
}
HOST_TIER = ("off", "on")
METRICS = {  # what a run reports -> (metric, per worker)
    "hit_tokens": ("prefix_cache_hits_total", True),
    "host_hit_tokens": ("prefix_cache_host_hits_total", True),
    "promoted_blocks": ("prefix_cache_promoted_blocks_total", True),
    "demoted_blocks": ("prefix_cache_demoted_blocks_total", True),
    "host_demoted_blocks": ("prefix_cache_host_demoted_blocks_total", False),
    "device_evicted_blocks": ("prefix_cache_device_evicted_blocks_total", True),
    "tier_copy_s": ("tier_copy_seconds_total", True),
    "tier_copy_s_max": ("tier_copy_seconds_max", True),
    "steps": ("steps_total", True),
    "device_used": ("worker_device_kv_blocks_used", True),
    "device_cached": ("prefix_cache_device_blocks", True),
    "host_used": ("host_kv_blocks_used", False),
    "host_cached": ("prefix_cache_host_blocks", False),
    "allocators_corrupt": ("kv_allocators_corrupt", False),
}


@dataclass(frozen=True)
class PrefixTiersBenchConfig:
    trace: str = CONVERSATION_TRACE
    trace_conversations: int = 12  # every turn of the first 12 multi-turn conversations: 36 requests, 50% of tokens repeat
    trace_start_s: float = 0.0
    length_scale: float = 0.0625  # a 512-token trace block becomes 32 tokens
    time_scale: float = 10.0  # 1467 s of trace time in 147 s
    device_kv_tokens: int = 8192
    max_concurrency: int = 64
    slo_ttft_ms: float = 5000.0
    slo_tpot_ms: float = 500.0
    settings: str = ",".join(SETTINGS)
    copy_blocks: str = "1,8,32,64"  # demotions and promotions of this many blocks are timed first ('' for none)
    window_model: str = "gemma-3-270m"  # its prefix reuse and ring rebuild are timed first ('' for none)

    def chosen(self) -> list[str]:
        names = [name for name in self.settings.split(",") if name]
        if bad := [name for name in names if name not in SETTINGS]:
            raise ValueError(f"--settings: unknown {', '.join(bad)} (known: {', '.join(SETTINGS)})")
        return names


def _best_s(run: Callable[[], None], repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def copy_costs(counts: list[int]) -> dict:
    """A worker's demotion and promotion of `counts` blocks, against computing a 512-token chunk."""
    from pulseinfer.engine import Engine, EngineConfig  # the model: only here
    from pulseinfer.gpu_worker.config import WorkerConfig
    from pulseinfer.messages.sampling import SamplingParams
    from pulseinfer.scheduler.batcher import BatcherConfig

    config = EngineConfig(
        worker=WorkerConfig(mode="dense", device_kv_tokens=8192), batcher=BatcherConfig(offload="never"), dense_host_tier=True
    )
    with Engine(config) as engine:
        rows = [_tier_copies(engine, count) for count in counts]
        prompts = iter(list(range(start, start + 512)) for start in range(1000, 10_000, 1000))  # distinct: nothing cached
        prefill_s = _best_s(lambda: engine.generate([next(prompts)], SamplingParams(max_tokens=1)), repeats=3)
    return {"rows": rows, "prefill_512_tokens_s": prefill_s}


def _tier_copies(engine, count: int) -> dict:
    """Device blocks 0..count-1 demoted (into an empty host tier each time), then promoted back."""
    from pulseinfer.messages.plan import Chunk

    hierarchy, host, block = engine.runner.hierarchy, engine.host.allocator, engine.runner.cache_spec.block_size
    names = [i.to_bytes(16, "little") for i in range(count)]
    demotion = tuple(zip(range(count), names))

    def demote() -> None:
        host.drop_prefix_cache()
        hierarchy.step(demotion, ())

    demote_s = _best_s(demote)
    cached = tuple(host.prefix.blocks[name] for name in names)
    promotion = Chunk("bench", (1,), count * block, tuple(range(count + 1)), None, host_prefix=cached)
    promote_s = _best_s(lambda: hierarchy.step((), (promotion,)))
    return {"blocks": count, "demote_s": demote_s, "promote_s": promote_s}


def window_costs(model: str, prefix_len: int = 2048) -> dict:
    """On a model with sliding-window layers: the time to first token of a request whose first
    `prefix_len` tokens another request computed, with the prefix cache off and on, and what
    rebuilding one request's rings from the history costs on its own."""
    from pulseinfer.engine import Engine, EngineConfig
    from pulseinfer.gpu_worker.config import WorkerConfig
    from pulseinfer.gpu_worker.model.loader import load_model
    from pulseinfer.messages.sampling import SamplingParams
    from pulseinfer.scheduler.batcher import BatcherConfig

    loaded = load_model(model)
    prefix = list(range(1000, 1000 + prefix_len))
    out = {"model": model, "prefix_tokens": prefix_len}
    for cache in ("off", "on"):
        config = EngineConfig(
            worker=WorkerConfig(mode="dense", device_kv_tokens=8192, max_running=4),
            batcher=BatcherConfig(prefix_cache=cache, offload="never"),
        )
        with Engine(config, loaded=loaded) as engine:
            engine.generate([[*prefix, 1, 2]], SamplingParams(max_tokens=1))
            started = time.perf_counter()
            (done,) = engine.generate([[*prefix, 3, 4]], SamplingParams(max_tokens=1))
            out[f"ttft_cache_{cache}_s"], out[f"cached_tokens_{cache}"] = time.perf_counter() - started, done.cached_tokens
            if cache == "on":
                out |= _ring_costs(engine, prefix_len)
    return out


def _ring_costs(engine, prefix_len: int) -> dict:
    """One request's rings rebuilt from the history of a `prefix_len`-token prefix; the history's bytes a token."""
    window, runner = engine.runner.window, engine.runner
    ring, table = window.free[-1], tuple(range(prefix_len // window.block_size))
    history = 2 * window.history_k[:, 0].numel() * window.history_k.element_size()
    return {
        "ring_rebuild_s": _best_s(lambda: window._rebuild(ring, prefix_len, table)),
        "window_tokens": window.window,
        "history_bytes_per_token": history,
        "paged_bytes_per_token": runner.cache.shape.kv_bytes(runner.dtype) // runner.cache_spec.num_tokens,
    }


def _metrics(cluster: ServingCluster) -> dict[str, float]:
    return {key: cluster.metric(name, **({"worker": "0"} if per_worker else {})) or 0.0 for key, (name, per_worker) in METRICS.items()}


def _wait(cluster: ServingCluster, done, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if done():
            return True
        time.sleep(0.5)
    return False


def run_one(config: PrefixTiersBenchConfig, setting: str, host_tier: str) -> dict:
    flags = (*SETTINGS[setting], "--device-kv-tokens", str(config.device_kv_tokens), "--host-prefix-cache", host_tier)
    cluster = ServingCluster(*flags)
    try:
        bench = serve.ServeBenchConfig(
            base_url=cluster.base_url,
            trace=config.trace,
            trace_conversations=config.trace_conversations,
            trace_start_s=config.trace_start_s,
            length_scale=config.length_scale,
            time_scale=config.time_scale,
            max_concurrency=config.max_concurrency,
            slo_ttft_ms=config.slo_ttft_ms,
            slo_tpot_ms=config.slo_tpot_ms,
        )
        result = serve.run(bench)
        idle = _wait(cluster, lambda: cluster.metric("num_requests_running") == 0 == cluster.metric("num_requests_waiting"), 60)
        at_idle = _metrics(cluster)
        status, raw = cluster.http("/reset_prefix_cache", b"{}", {"Content-Type": "application/json"})
        _wait(cluster, lambda: _metrics(cluster)["host_used"] == 0 == _metrics(cluster)["device_used"], 10)
        after_reset = _metrics(cluster)
    finally:
        cluster.stop()
    return {
        "setting": setting,
        "host_prefix_cache": host_tier,
        "flags": list(flags),
        "idle": idle,
        "bench": result,
        "metrics_idle": at_idle,
        "reset": {"status": status, "freed_blocks": json.loads(raw).get("freed_blocks") if status == 200 else None},
        "metrics_after_reset": after_reset,
    }


def table(runs: list[dict]) -> str:
    head = (
        "| mode | host prefix cache | completed | cached tokens (of prompt) | of the potential | from the host tier | "
        "promoted / demoted blocks | TTFT mean / p50 / p99 (s) | TPOT mean (ms) | goodput (req/s) | SLOs met | "
        "tier copies per step: mean / max (ms) |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in runs:
        b, m, t = r["bench"], r["metrics_idle"], r["bench"]["trace"]
        potential = t["potential_token_hit_rate"] * b["prompt_tokens"]
        ttft = b["ttft"]
        lines.append(
            f"| {r['setting']} | {r['host_prefix_cache']} | {b['completed']}/{t['requests']} | "
            f"{b['cached_tokens']} of {b['prompt_tokens']} ({b['prefix_hit_rate']:.1%}) | {b['cached_tokens'] / max(1, potential):.0%} | "
            f"{int(m['host_hit_tokens'])} | {int(m['promoted_blocks'])} / {int(m['demoted_blocks'])} | "
            f"{ttft['mean_ms'] / 1e3:.1f} / {ttft['p50_ms'] / 1e3:.1f} / {ttft['p99_ms'] / 1e3:.1f} | {b['tpot']['mean_ms']:.0f} | "
            f"{b['goodput']:.3f} | {b['slo_attainment']:.1%} | "
            f"{m['tier_copy_s'] / max(1, m['steps']) * 1e3:.2f} / {m['tier_copy_s_max'] * 1e3:.1f} |"
        )
    return "\n".join(lines)


def main(config: PrefixTiersBenchConfig, json_path: Path | None) -> int:
    copies = copy_costs([int(n) for n in config.copy_blocks.split(",") if n]) if config.copy_blocks else None
    if copies is not None:
        for row in copies["rows"]:
            print(f"{row['blocks']} blocks: demote {row['demote_s'] * 1e3:.1f} ms, promote {row['promote_s'] * 1e3:.1f} ms")
        print(f"prefill of 512 tokens: {copies['prefill_512_tokens_s'] * 1e3:.0f} ms", flush=True)
    windowed = window_costs(config.window_model) if config.window_model else None
    if windowed is not None:
        w = windowed
        print(f"{w['model']}, {w['prefix_tokens']}-token cached prefix: time to first token {w['ttft_cache_off_s']:.2f} s with the "
              f"prefix cache off, {w['ttft_cache_on_s']:.2f} s on ({w['cached_tokens_on']} tokens cached); rings rebuilt in "
              f"{w['ring_rebuild_s'] * 1e3:.1f} ms; history {w['history_bytes_per_token']} bytes a token beside "
              f"{w['paged_bytes_per_token']} of paged KV", flush=True)  # fmt: skip
    runs = []
    for setting in config.chosen():
        for host_tier in HOST_TIER:
            run = run_one(config, setting, host_tier)
            runs.append(run)
            m = run["metrics_after_reset"]
            print(f"{setting}, host prefix cache {host_tier}: {run['bench']['prefix_hit_rate']:.1%} cached; after the reset "
                  f"device {int(m['device_used'])} and host {int(m['host_used'])} blocks used", flush=True)  # fmt: skip
    if runs:
        print(table(runs))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({"config": asdict(config), "copies": copies, "windowed": windowed, "runs": runs}, indent=1) + "\n")
    return 1 if any(r["bench"]["failed"] for r in runs) else 0
