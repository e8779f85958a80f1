"""The control plane alone: the real cluster (gateway, scheduler, kv_store, workers; HTTP streaming
clients) with workers whose forward is a fixed simulated time (`--simulate-step-ms`, a benchmark
tool: gpu_worker/simulated.py), so that what slows a step down is the control plane.

For each overlap mode, one `pulseinfer serve` of the Qwen3-8B geometry (no weights) with a device
KV pool like an H100's for an 8B model, every request offloaded (its history in the host pool, a
fixed device footprint: 256 of 32k run at once). For each batch size and context: that many concurrent streaming completions of
distinct random prompts of that many tokens, `max_tokens` --output-tokens, eos ignored. Measured
over the steady window, from the moment every request has its first token to the moment the first
one finishes (/metrics read at both ends; a point whose window holds fewer than --min-window-steps
steps runs again with twice the output tokens): worker busy fraction, steps/s, plan bytes per steady
decode step, scheduler CPU per step, tokens/s streamed; and client-side TPOT and ITL over whole
requests. The acceptance numbers (overlap on, batch 256, 32k) are checked and printed; the exit
code stays 0. Method and columns: docs/control_plane.md.

    pulseinfer bench control-plane [--simulate-step-ms 10] [--batches 1,16,64,256] [--contexts 4096,32768]
        [--overlap on,off] [--output-tokens 2048] [--min-window-steps 100] [--json docs/results/control_plane.json]
        [--markdown PATH]
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import uvloop

from pulseinfer.bench.cluster import ServingCluster
from pulseinfer.bench.stream_client import METRIC, Scrape, Timeline, stream_all
from pulseinfer.common.flags import to_flags
from pulseinfer.common.model.meta import load_model_meta
from pulseinfer.common.model.tokenizer import Tokenizer

MODEL = "qwen3-8b"  # a geometry of meta.GEOMETRIES: --load-format dummy, and the simulated worker reads no weights
DEFAULT_JSON = Path("docs/results/control_plane.json")
# the acceptance (the issue): at this point, with overlap on
ACCEPT_BATCH, ACCEPT_CONTEXT = 256, 32768
ACCEPT_BUSY, ACCEPT_TPOT_OVER_STEP = 0.95, 1.25


def plan_bytes_bound(batch: int) -> int:
    """Bytes a steady decode step's plan may take: O(batch), whatever the context."""
    return 32 * batch + 64


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not all(v >= 1 for v in values):
        raise ValueError(f"{flag} must be >= 1 each, got {text!r}")
    return values


@dataclass(frozen=True)
class ControlPlaneBenchConfig:
    simulate_step_ms: float = 10.0
    batches: str = "1,16,64,256"
    contexts: str = "4096,32768"
    overlap: str = "on,off"
    # the first request finishes this many tokens after its first, and the window ends there: at
    # 256 x 32k the ramp (every request admitted and prefilled) takes 128 steps at the prefill budget,
    # more while the requests reach the scheduler (4 s on a 2-core VM); the rest is the window. TPOT
    # covers whole requests: 2048 tokens make the burst's ramp a small part of an early request's life
    output_tokens: int = 2048
    min_window_steps: int = 100  # a point whose window holds fewer steps runs again with twice the output tokens
    device_kv_tokens: int = 400_000  # an H100's pool for an 8B model: 256 offloaded footprints (1344 tokens each) fit
    host_kv_tokens: int = 1024  # the kv_store's pool (sized from the geometry, prefaulted): the simulated workers never map it
    prefill_chunk: int = 65536  # prefill tokens per step: the ramp takes few steps
    seed: int = 0  # of the prompts

    def __post_init__(self) -> None:
        if not self.simulate_step_ms > 0:
            raise ValueError(f"--simulate-step-ms must be > 0, got {self.simulate_step_ms}")
        if self.min_window_steps < 0:
            raise ValueError(f"--min-window-steps must be >= 0, got {self.min_window_steps}")
        if self.output_tokens < 2:
            raise ValueError(f"--output-tokens must be >= 2 (TPOT is measured between tokens), got {self.output_tokens}")
        if not self.modes or any(m not in ("on", "off") for m in self.modes):
            raise ValueError(f"--overlap must be a comma-separated list of on and off, got {self.overlap!r}")
        for text, flag in ((self.batches, "--batches"), (self.contexts, "--contexts")):
            _ints(text, flag)  # a bad list fails here, before any cluster starts

    @property
    def modes(self) -> tuple[str, ...]:
        return tuple(self.overlap.split(","))

    @property
    def points(self) -> list[tuple[int, int]]:
        """(batch, context), batch first: the max plan bytes since the cluster started then covers this
        batch and smaller ones only."""
        contexts = _ints(self.contexts, "--contexts")
        return [(b, c) for b in sorted(_ints(self.batches, "--batches")) for c in sorted(contexts)]

    def serve_flags(self, overlap: str) -> list[str]:
        flags = {
            "--model": MODEL,
            "--load-format": "dummy",
            "--simulate-step-ms": self.simulate_step_ms,
            "--overlap": overlap,
            "--max-batch-size": max(b for b, _ in self.points),
            "--prefill-chunk": self.prefill_chunk,
            "--device-kv-tokens": self.device_kv_tokens,
            # every request's history in the host pool, as in the paper's setting: a fixed device footprint
            # each, so that a burst of 256 x 32k runs at once (with auto, the first arrivals would take
            # the pool resident and the rest would wait for them)
            "--offload": "always",
            "--host-kv-tokens": self.host_kv_tokens,
        }
        return [str(x) for item in flags.items() for x in item]


# ---------------------------------------------------------------- prompts


def ordinary_ids(tokenizer: Tokenizer, vocab_size: int) -> np.ndarray:
    """Ids the tokenizer has that are no special token and that the model's vocabulary covers."""
    size = min(tokenizer.backend.get_vocab_size(), vocab_size)
    return np.setdiff1d(np.arange(size), list(tokenizer.backend.get_added_tokens_decoder()))


def build_requests(pool: np.ndarray, batch: int, context: int, output_tokens: int, seed: int) -> list[bytes]:
    """HTTP requests of distinct random prompts given as token ids (no tokenization on the way), each
    on a connection of its own that the response closes."""
    prompts = pool[np.random.default_rng([seed, batch, context]).integers(0, len(pool), (batch, context))]
    head = b'{"prompt":['
    tail = (
        f'],"max_tokens":{output_tokens},"ignore_eos":true,"temperature":0,"stream":true,"stream_options":{{"include_usage":true}}}}'
    ).encode()
    out = []
    for prompt in prompts:
        body = head + ",".join(map(str, prompt.tolist())).encode() + tail
        out.append(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
    return out


# ---------------------------------------------------------------- the numbers


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile, linear between the closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def steady_window(timelines: list[Timeline]) -> tuple[float, float] | None:
    """From the moment every request has its first token to the moment the first one finishes; None if it is empty."""
    start = max(t.events[0] for t in timelines)
    end = min(t.finished for t in timelines)
    return (start, end) if start < end else None


def client_stats(timelines: list[Timeline], step_ms: float) -> dict:
    """Over whole requests: TPOT per request (p50, p99 over requests), the gaps between a request's
    events pooled (ITL), and the tokens/s the clients received (the sum of the requests' rates)."""
    tpots = [s for t in timelines if (s := t.tpot_s)]
    gaps = [b - a for t in timelines for a, b in zip(t.events, t.events[1:])]
    firsts = [t.events[0] for t in timelines]
    p99 = percentile(tpots, 99) * 1e3
    return {
        "tpot_p50_ms": percentile(tpots, 50) * 1e3,
        "tpot_p99_ms": p99,
        "tpot_p99_over_step": p99 / step_ms,
        "itl_p99_ms": percentile(gaps, 99) * 1e3 if gaps else None,
        "client_tokens_per_s": sum(1 / s for s in tpots),
        "completion_tokens": sum(t.completion_tokens for t in timelines),
        "ramp_s": max(firsts) - min(firsts),  # from the first request's first token to the last one's
    }


def window_stats(start: Scrape, end: Scrape, step_ms: float) -> dict:
    """The server's counters over the window (the two /metrics reads)."""
    (t0, before), (t1, after) = start, end
    wall = t1 - t0

    def delta(name: str) -> float:
        return after.get(METRIC + name, 0.0) - before.get(METRIC + name, 0.0)

    workers = after.get(METRIC + "workers_alive") or 1
    busy, idle = delta("worker_busy_seconds_total"), delta("worker_idle_seconds_total")
    steps, steady = delta("steps_total"), delta("steady_decode_steps_total")
    timed = busy + idle > 0  # the workers' time was counted (a scheduler that does not count it reports none)
    return {
        "window_s": wall,
        "window_steps": steps,
        "busy": busy / (busy + idle) if timed else None,
        "busy_of_wall": busy / (wall * workers) if timed else None,
        "steps_per_s": steps / wall,
        "ideal_steps_per_s": workers * 1e3 / step_ms,
        "plan_bytes_per_step": delta("steady_decode_plan_bytes_total") / steady if steady else None,
        "plan_bytes_max": after.get(METRIC + "steady_decode_plan_bytes_max") or None,  # since the cluster started
        "scheduler_cpu_ms_per_step": delta("scheduler_cpu_seconds_total") * 1e3 / steps if steps else None,
        "gateway_tokens_per_s": delta("generation_tokens_total") / wall,
        "offloaded": before.get(METRIC + "worker_requests_offloaded", 0.0),  # of the batch, all running at the window's start
        "overlap_reported": bool(after.get(METRIC + "overlap")),
    }


async def measure_once(port: int, config: ControlPlaneBenchConfig, pool: np.ndarray, batch: int, context: int, tokens: int) -> dict:
    timelines, start, end = await stream_all(port, build_requests(pool, batch, context, tokens, config.seed))
    row = {"batch": batch, "context": context, "output_tokens": tokens} | client_stats(timelines, config.simulate_step_ms)
    window = steady_window(timelines)
    if start is None or window is None:
        return row
    return row | {"client_window_s": window[1] - window[0]} | window_stats(start, end, config.simulate_step_ms)


async def measure_point(port: int, config: ControlPlaneBenchConfig, pool: np.ndarray, batch: int, context: int, max_position: int) -> dict:
    """One point, run again with twice the output tokens (up to the model's context) while its steady
    window holds fewer than --min-window-steps steps: the slower the control plane, the longer a large batch's ramp."""
    tokens = config.output_tokens
    while True:
        row = await measure_once(port, config, pool, batch, context, tokens)
        steps = row.get("window_steps", 0)
        more = min(2 * tokens, max_position - context)
        if steps >= config.min_window_steps:
            return row
        if more <= tokens:
            print(f"  batch {batch} context {context}: a steady window of {steps:.0f} steps at the most output tokens the context allows")
            return row
        print(f"  batch {batch} context {context}: a steady window of {steps:.0f} steps with {tokens} output tokens; again with {more}")
        tokens = more


async def measure_mode(port: int, config: ControlPlaneBenchConfig, pool: np.ndarray, max_position: int) -> list[dict]:
    await stream_all(port, build_requests(pool, 1, 16, 4, config.seed))  # warm-up: the first request's one-time costs
    rows = []
    for batch, context in config.points:
        started = time.perf_counter()
        rows.append(await measure_point(port, config, pool, batch, context, max_position))
        print(f"  batch {batch:3d} context {context:5d}: {time.perf_counter() - started:.1f} s", flush=True)
    return rows


# ---------------------------------------------------------------- report

COLUMNS = (  # (header, key, format)
    ("overlap", "overlap", "{}"),
    ("batch", "batch", "{}"),
    ("context", "context", "{}"),
    ("tokens", "output_tokens", "{}"),
    ("window steps", "window_steps", "{:.0f}"),
    ("offloaded", "offloaded", "{:.0f}"),
    ("busy", "busy", "{:.1%}"),
    ("busy/wall", "busy_of_wall", "{:.1%}"),
    ("steps/s", "steps_per_s", "{:.1f}"),
    ("ideal", "ideal_steps_per_s", "{:.0f}"),
    ("plan B/step", "plan_bytes_per_step", "{:.0f}"),
    ("plan B max", "plan_bytes_max", "{:.0f}"),
    ("sched CPU ms/step", "scheduler_cpu_ms_per_step", "{:.2f}"),
    ("gateway tok/s", "gateway_tokens_per_s", "{:.0f}"),
    ("client tok/s", "client_tokens_per_s", "{:.0f}"),
    ("TPOT p50 ms", "tpot_p50_ms", "{:.2f}"),
    ("TPOT p99 ms", "tpot_p99_ms", "{:.2f}"),
    ("p99/step", "tpot_p99_over_step", "{:.2f}"),
    ("ITL p99 ms", "itl_p99_ms", "{:.2f}"),
)


def table(rows: list[dict]) -> list[list[str]]:
    """The header, then a line of cells per row ('-' where there was nothing to measure)."""
    cells = [[h for h, _, _ in COLUMNS]]
    return cells + [[form.format(row[key]) if row.get(key) is not None else "-" for _, key, form in COLUMNS] for row in rows]


def markdown(rows: list[dict]) -> str:
    header, *body = table(rows)
    lines = [header, ["---:"] * len(header), *body]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines) + "\n"


def plain(rows: list[dict]) -> str:
    lines = table(rows)
    widths = [max(len(line[i]) for line in lines) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in lines)


def acceptance(rows: list[dict], step_ms: float) -> list[dict] | None:
    """The issue's three numbers at overlap on, batch 256, 32k context; None when that point was not run."""
    row = next((r for r in rows if (r["overlap"], r["batch"], r["context"]) == ("on", ACCEPT_BATCH, ACCEPT_CONTEXT)), None)
    if row is None:
        return None
    busy, plan_max, p99 = row.get("busy"), row.get("plan_bytes_max"), row["tpot_p99_ms"]
    bound = plan_bytes_bound(ACCEPT_BATCH)
    return [
        {"check": f"worker busy >= {ACCEPT_BUSY:.0%}", "passed": busy is not None and busy >= ACCEPT_BUSY, "value": busy},
        {"check": f"plan bytes per steady decode step <= {bound}", "passed": plan_max is not None and plan_max <= bound, "value": plan_max},
        {
            "check": f"client TPOT p99 <= {ACCEPT_TPOT_OVER_STEP} x {step_ms:g} ms",
            "passed": p99 <= ACCEPT_TPOT_OVER_STEP * step_ms,
            "value": p99,
        },
    ]


def print_checks(rows: list[dict], checks: list[dict] | None) -> None:
    for row in rows:
        if "overlap_reported" in row and row["overlap_reported"] != (row["overlap"] == "on"):
            reported = "on" if row["overlap_reported"] else "off"
            print(f"warning: batch {row['batch']} context {row['context']}: --overlap {row['overlap']}, the scheduler reports {reported}")
    if checks is None:
        print(f"acceptance not checked: it needs overlap on, batch {ACCEPT_BATCH} and context {ACCEPT_CONTEXT}")
        return
    for check in checks:
        value = "-" if check["value"] is None else f"{check['value']:.4g}"
        verdict = "PASS" if check["passed"] else "FAIL"
        print(f"{verdict}  {check['check']} (overlap on, batch {ACCEPT_BATCH}, context {ACCEPT_CONTEXT}): {value}")


def machine() -> dict:
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")]
    return {"cpu": names[0] if names else platform.processor(), "cores": os.cpu_count(), "platform": platform.platform()}


def main(config: ControlPlaneBenchConfig, json_path: Path | None = DEFAULT_JSON, markdown_path: Path | None = None) -> int:
    meta = load_model_meta(MODEL, "dummy")
    pool = ordinary_ids(meta.tokenizer, meta.config.vocab_size)
    rows = []
    for mode in config.modes:
        print(f"overlap {mode}: starting the cluster", flush=True)
        cluster = ServingCluster(*config.serve_flags(mode))
        try:
            rows += [{"overlap": mode} | r for r in uvloop.run(measure_mode(cluster.http_port, config, pool, meta.config.max_position))]
        finally:
            cluster.stop()
    print(plain(rows))
    checks = acceptance(rows, config.simulate_step_ms)
    print_checks(rows, checks)
    result = {
        "command": shlex.join(["pulseinfer", "bench", "control-plane", *to_flags(config)]),
        "machine": machine(),
        "settings": dataclasses.asdict(config),
        "serve_flags": {mode: config.serve_flags(mode) for mode in config.modes},
        "rows": rows,
        "acceptance": checks,
    }
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=1))
    if markdown_path:
        markdown_path.parent.mkdir(parents=True, exist_ok=True)
        markdown_path.write_text(markdown(rows))
    return 0
