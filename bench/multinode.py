"""Routing across nodes on a trace replay (docs/deployment.md, several nodes): one node, then two emulated nodes behind
a gateway routing cache_aware, then round_robin, each replaying the same Mooncake slice with
`pulseinfer bench serve` from the gateway's namespace; the prefix cache's hit rate and TTFT per
policy, and where the prompt tokens went.

    sudo pulseinfer bench multinode [--trace bench/traces/mooncake_conversation_trace.jsonl.gz]
        [--trace-conversations 12] [--length-scale 0.0625] [--time-scale 10] [--json docs/results/multinode.json]

The nodes are network, PID and mount namespaces on this machine (bench/emulated_nodes.py), so
root is needed; their gRPC is plaintext (--insecure) on that private network. Each setting starts
its own nodes and gateway and removes them after. One benchmark at a time, nothing else running:
the nodes share this machine's cores, so TTFT compares policies, not one node against two hosts."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from pulseinfer.bench import serve
from pulseinfer.bench.emulated_nodes import HTTP_PORT, EmulatedCluster, missing
from pulseinfer.bench.mooncake import CONVERSATION_TRACE
from pulseinfer.bench.timing import write_results

SETTINGS = {"single": (1, "cache_aware"), "cache_aware": (2, "cache_aware"), "round_robin": (2, "round_robin")}


@dataclass(frozen=True)
class MultinodeBenchConfig:
    trace: str = CONVERSATION_TRACE
    trace_conversations: int = 12  # every turn of the first 12 multi-turn conversations (as bench prefix-tiers)
    length_scale: float = 0.0625  # a 512-token trace block becomes 32 tokens
    time_scale: float = 10.0
    max_concurrency: int = 64
    node_flags: str = ""  # extra flags for every `pulseinfer node`, space-separated
    settings: str = ",".join(SETTINGS)
    startup_timeout_s: float = 600.0


def run_one(config: MultinodeBenchConfig, setting: str, logs: Path) -> dict:
    nodes, route = SETTINGS[setting]
    cluster = EmulatedCluster(nodes, logs / setting, config.node_flags.split(), ["--insecure"])
    (logs / setting).mkdir(parents=True)
    try:
        cluster.build()
        for i in range(nodes):
            cluster.start_node(i)
        cluster.start_gateway(route)
        every_up = dict.fromkeys((cluster.name(i) for i in range(nodes)), "up")
        cluster.wait_until(lambda: cluster.node_states() == every_up, "every node up", config.startup_timeout_s)
        bench = serve.ServeBenchConfig(
            base_url=f"http://127.0.0.1:{HTTP_PORT}",
            trace=config.trace,
            trace_conversations=config.trace_conversations,
            length_scale=config.length_scale,
            time_scale=config.time_scale,
            max_concurrency=config.max_concurrency,
        )
        result = cluster.run(serve.run, bench)
        per_node = [cluster.node_metrics(i) for i in range(nodes)]
    finally:
        cluster.close()
    queried = [m.get("pulseinfer:prefix_cache_queries_total", 0.0) for m in per_node]
    hits = [m.get("pulseinfer:prefix_cache_hits_total", 0.0) for m in per_node]
    return {
        "setting": setting,
        "nodes": nodes,
        "route": route,
        "prefix_hit_rate": result["prefix_hit_rate"],
        "node_hit_rate": sum(hits) / max(1.0, sum(queried)),
        "prompt_tokens_per_node": queried,
        "ttft": result["ttft"],
        "bench": result,
    }


def table(runs: list[dict]) -> str:
    lines = [
        "| setting | nodes | prefix-cache hit rate (cached / prompt tokens) | TTFT mean | TTFT p50 | TTFT p99 | prompt tokens per node |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        t = r["ttft"]
        split = " / ".join(f"{int(q)}" for q in r["prompt_tokens_per_node"])
        lines.append(
            f"| {r['setting']} | {r['nodes']} | {r['prefix_hit_rate']:.1%} | {t['mean_ms']:.0f} ms | "
            f"{t['p50_ms']:.0f} ms | {t['p99_ms']:.0f} ms | {split} |"
        )
    return "\n".join(lines)


def main(config: MultinodeBenchConfig, json_path: Path | None) -> int:
    if (why := missing()) is not None:
        raise RuntimeError(f"the emulated nodes {why}")
    chosen = [s for s in config.settings.split(",") if s]
    if unknown := [s for s in chosen if s not in SETTINGS]:
        raise ValueError(f"--settings: unknown {unknown}; choose from {', '.join(SETTINGS)}")
    logs = Path(tempfile.mkdtemp(prefix="pulseinfer-multinode-"))
    runs = []
    for setting in chosen:
        runs.append(run_one(config, setting, logs))
        print(f"{setting}: {runs[-1]['prefix_hit_rate']:.1%} of prompt tokens cached, TTFT mean {runs[-1]['ttft']['mean_ms']:.0f} ms")
    print(table(runs))
    write_results(config, {"runs": runs, "logs": str(logs)}, json_path)
    return 0
