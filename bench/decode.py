"""Decode benchmark: the same long requests served by each mode at the same device memory, side by
side in one run on one loaded model.

    pulseinfer bench decode --requests 16 --context 4000-6000 --output-tokens 64 --device-kv-share 0.25 \\
        --modes dense,headwise,pulse --json OUT [--plot OUT.png]

Modes: `dense` (every request resident, the batch capped by the device pool), `headwise` (per-kv-head
selection, recalls synchronous per layer), `pulse` (SoloHead, one gather per layer, layer-ahead recall
by default only on CUDA, IO-adaptive admission), and pulse with one feature off: `pulse-no-solohead`
(head-wise selection), `pulse-no-gather` (one copy per recalled unit), `pulse-no-layer-ahead` (recalls in
line at their layer: the same as `pulse` on the CPU), `pulse-no-admission` (every request offloaded,
whether or not it fits); `pulse-quest` selects by the Quest bound of min/max key summaries instead of the
default low-rank keys (cheaper to score, less accurate); `pulse-hot` gives the hot buffer `--hot-extra`
tokens beyond the budget (fewer recalls, the same blocks attended, a larger device footprint per
offloaded request).

Steps either prefill or decode, prefill first (SGLang's default scheduling), so each mode decodes as many
requests at once as its device memory admits. Decode tokens/s is the tokens of decode steps over their
time; the prefill all modes share is timed apart. TPOT is, per request, the mean time of the decode steps
that produced its tokens; `tpot_with_stalls` also counts the prefill steps of later requests it waited
through (its last token's time minus its first's, over the tokens between).

Agreement with dense is the share of greedy tokens equal to dense's at the same position. Run freely,
one differing token changes the continuation after it, so the share measures where the first
difference falls more than how often the selection changes a token. With `--teacher-forced` the other
modes decode dense's tokens (the same contexts, the same work) and agreement counts the positions where
their own greedy token is dense's: the per-token accuracy.

With `--rounds N` every mode runs N times, in the given order in even rounds and reversed in
odd ones (dense, pulse, pulse, dense), so no mode always runs first or last on a machine whose
speed drifts; each mode's numbers are the means over its rounds (tokens and per-layer bytes
from its first round), with `decode_tok_s_by_round` kept.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pulseinfer.engine import Engine, EngineConfig
from pulseinfer.gpu_worker.config import WorkerConfig
from pulseinfer.gpu_worker.model.loader import LoadedModel, load_model
from pulseinfer.gpu_worker.offload.config import OffloadConfig
from pulseinfer.messages.plan import Chunk, StepPlan
from pulseinfer.messages.sampling import SamplingParams
from pulseinfer.scheduler.batcher import BatcherConfig

BASELINES = ("dense", "headwise", "pulse")
ABLATIONS = ("pulse-no-solohead", "pulse-no-gather", "pulse-no-layer-ahead", "pulse-no-admission", "pulse-quest", "pulse-hot")


@dataclass(frozen=True)
class DecodeBenchConfig:
    model: str | None = None  # a GGUF file, HF directory or model name; default: SmolLM2-135M-Instruct
    load_format: str = "auto"  # dummy: seeded random weights of the model's geometry
    device: str = "cpu"
    prefill_chunk: int = 512  # prefill tokens per step
    requests: int = 16
    context: str = "4000-6000"  # prompt tokens: one length, or min-max spread evenly over the requests
    output_tokens: int = 64
    device_kv_share: float = 0.25  # the device KV pool as a share of the requests' total KV
    device_kv_tokens: int = 0  # the device KV pool in tokens; overrides --device-kv-share when set
    modes: str = ",".join(BASELINES)  # any of BASELINES and ABLATIONS
    budget: int = 1024  # host-tier tokens selected per (request, layer)
    hot_extra: int = 1024  # mode pulse-hot: hot-buffer tokens beyond the budget
    sink: int = 64
    # below the server's 256 so that an offloaded footprint (sink + recent + budget: 76 blocks of 16)
    # lets all 16 default requests fit the 25% pool at once (1,216 of 1,266 blocks); at 256 (84
    # blocks) 15 fit and the last decodes after them, alone (docs/decode.md)
    recent: int = 128
    block_size: int = 16
    rounds: int = 1  # runs of every mode, the order reversed every other round
    # the other modes decode dense's tokens (dense runs first) and agreement counts the positions where
    # their greedy token is dense's: one differing token no longer changes every token after it
    teacher_forced: bool = False

    def lengths(self) -> list[int]:
        low, _, high = self.context.partition("-")
        try:
            low, high = int(low), int(high or low)
        except ValueError as e:
            raise ValueError(f"--context must be a length or a range min-max, got {self.context!r}") from e
        if not 0 < low <= high or self.requests < 1 or self.output_tokens < 1 or self.rounds < 1:
            raise ValueError("--context lengths, --requests, --output-tokens and --rounds must be positive (min <= max)")
        step = (high - low) / max(1, self.requests - 1)
        return [round(low + i * step) for i in range(self.requests)]

    def device_tokens(self) -> int:
        if self.device_kv_tokens:
            return self.device_kv_tokens
        total = sum(length + self.output_tokens for length in self.lengths())
        return int(total * self.device_kv_share) // self.block_size * self.block_size

    def mode_list(self) -> list[str]:
        modes = [m.strip() for m in self.modes.split(",") if m.strip()]
        unknown = [m for m in modes if m not in BASELINES + ABLATIONS]
        if unknown or not modes:
            raise ValueError(f"--modes takes {', '.join(BASELINES + ABLATIONS)}; got {self.modes!r}")
        if self.teacher_forced and modes[0] != "dense":
            raise ValueError("--teacher-forced decodes dense's tokens in the other modes: --modes must start with dense")
        return modes


def engine_config(mode: str, config: DecodeBenchConfig) -> EngineConfig:
    """One mode as an engine: the decode mode, its offloading policy and which pulse features are on."""
    selection = "headwise" if mode in ("headwise", "pulse-no-solohead") else mode.split("-")[0]
    offload = OffloadConfig(
        sink=config.sink,
        recent=config.recent,
        budget=config.budget,
        # the baseline recalls synchronously; pulse takes the default (auto: on CUDA only)
        layer_ahead="off" if mode in ("headwise", "pulse-no-layer-ahead") else "auto",
        gather=mode != "pulse-no-gather",
        scorer="quest" if mode == "pulse-quest" else OffloadConfig.scorer,
        hot_extra=config.hot_extra if mode == "pulse-hot" else 0,
    )
    policy = {"dense": "never", "pulse-no-admission": "always"}.get(mode, "auto")
    host_tokens = sum(length + config.output_tokens + config.block_size for length in config.lengths())
    worker = WorkerConfig(
        mode=selection,
        device=config.device,
        device_kv_tokens=config.device_tokens(),
        block_size=config.block_size,
        offload=offload,
        max_running=config.requests,
    )
    batcher = BatcherConfig(max_batch_size=config.requests, prefill_chunk=config.prefill_chunk, offload=policy, mixed_steps=False)
    return EngineConfig(model=config.model, load_format=config.load_format, worker=worker, batcher=batcher, host_kv_tokens=host_tokens)


def prompts(loaded: LoadedModel, lengths: list[int]) -> list[list[int]]:
    """Prose of Python's documentation, a different passage for each request."""
    import pydoc_data.topics

    ids = loaded.tokenizer.encode(" ".join(pydoc_data.topics.topics.values()))
    stride = max(1, (len(ids) - max(lengths)) // len(lengths))
    return [ids[i * stride : i * stride + n] for i, n in enumerate(lengths)]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class TeacherForcing:
    """Feeds each request the reference's tokens, counting where the greedy token agrees with them."""

    def __init__(self, reference: dict[str, list[int]], prompt_lengths: dict[str, int]):
        self.reference, self.prompt_lengths = reference, prompt_lengths
        self.agreed = self.total = 0

    def __call__(self, logits: torch.Tensor, chunks: list[Chunk]) -> list[int]:
        greedy = logits.argmax(dim=-1).tolist()
        forced = [self.reference[c.seq_id][c.end_pos - self.prompt_lengths[c.seq_id]] for c in chunks]
        self.agreed += sum(a == b for a, b in zip(greedy, forced))
        self.total += len(forced)
        return forced


@dataclass(frozen=True)
class ServedStep:
    plan: StepPlan
    seconds: float
    ended: float  # time.perf_counter() at its end


def serve(engine: Engine, forcing: TeacherForcing | None = None) -> tuple[dict[str, list[int]], list[ServedStep]]:
    """Steps the engine until its requests have finished: each one's tokens, and every step that ran
    a plan, timed. A failed request fails the benchmark."""
    tokens: dict[str, list[int]] = {}
    steps: list[ServedStep] = []
    while engine.batcher.has_work():
        before = time.perf_counter()
        finished = engine.step(forcing)
        now = time.perf_counter()
        for completion in finished:
            if completion.error:
                raise RuntimeError(f"request {completion.seq_id} failed: {completion.error}")
            tokens[completion.seq_id] = completion.token_ids
        if engine.last_plan is not None:
            steps.append(ServedStep(engine.last_plan, now - before, now))
    return tokens, steps


def run_mode(
    mode: str, config: DecodeBenchConfig, loaded: LoadedModel, requests: list[list[int]], reference: list[list[int]] | None = None
) -> dict:
    """Serves the requests in one mode; timings per step and per request, recall statistics, tokens.
    With `reference` (tokens per request) the requests decode those tokens (teacher forcing)."""
    with Engine(engine_config(mode, config), loaded) as engine:  # closed: the next mode's engine maps a host pool of its own
        return _serve_mode(engine, mode, config, requests, reference)


def _serve_mode(engine: Engine, mode: str, config: DecodeBenchConfig, requests: list[list[int]], reference: list[list[int]] | None) -> dict:
    params = SamplingParams(max_tokens=config.output_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.submit(prompt, params) for prompt in requests]
    forcing = None
    if reference is not None:
        forcing = TeacherForcing(dict(zip(ids, reference)), {seq_id: len(prompt) for seq_id, prompt in zip(ids, requests)})
    started = time.perf_counter()
    tokens, steps = serve(engine, forcing)
    token_times: dict[str, list[float]] = {seq_id: [] for seq_id in ids}
    decode_time: dict[str, float] = dict.fromkeys(ids, 0.0)  # summed time of the decode steps each request was in
    decode_rows, decode_s, batch_sizes, prefill_s = 0, 0.0, [], 0.0
    for step in steps:
        for chunk in step.plan.chunks:
            if chunk.sampling is not None:
                token_times[chunk.seq_id].append(step.ended)
        decoded = step.plan.decode_chunks
        if not decoded:
            prefill_s += step.seconds
            continue
        batch_sizes.append(len(decoded))
        decode_rows, decode_s = decode_rows + len(decoded), decode_s + step.seconds
        for chunk in decoded:
            decode_time[chunk.seq_id] += step.seconds
    wall = time.perf_counter() - started
    tpot = [decode_time[seq_id] / (len(tokens[seq_id]) - 1) for seq_id in ids if len(tokens[seq_id]) > 1]
    stalled = [(t[-1] - t[0]) / (len(t) - 1) for t in token_times.values() if len(t) > 1]
    decode_steps = max(len(batch_sizes), 1)
    stats = engine.selection_stats()
    recall = stats.get("recall", {})
    return {
        "mode": mode,
        "decode_tok_s": decode_rows / decode_s if decode_s else 0.0,
        "output_tok_s": sum(len(t) for t in tokens.values()) / wall,  # prefill included
        "tpot_p50_s": statistics.median(tpot),
        "tpot_p99_s": _percentile(tpot, 0.99),
        "tpot_with_stalls_p50_s": statistics.median(stalled),
        "tpot_with_stalls_p99_s": _percentile(stalled, 0.99),
        "mean_decode_batch": statistics.fmean(batch_sizes) if batch_sizes else 0.0,
        "offloaded_requests": engine.batcher.num_offloaded,
        "held_for_link": engine.batcher.num_held_for_link,
        "recall_bytes_per_step": recall.get("bytes", 0) / decode_steps,
        "recall_transfers_per_step": recall.get("transfers", 0) / decode_steps,
        "recall_bytes_by_layer_per_step": [b / decode_steps for b in stats.get("recall_bytes_by_layer", [])],
        "recall_wait_s": recall.get("wait_s", 0.0),
        "decode_s": decode_s,
        "prefill_s": prefill_s,
        "wall_s": wall,
        "tokens": [tokens[seq_id] for seq_id in ids],
        **({"agreement_teacher_forced": forcing.agreed / forcing.total} if forcing else {}),
    }


def mean_of_rounds(rounds: list[dict]) -> dict:
    """One mode's runs as one row: numbers averaged, the rest (tokens, per-layer bytes) from the first run."""
    numeric = [k for k, v in rounds[0].items() if isinstance(v, int | float) and not isinstance(v, bool)]
    row = {**rounds[0], **{k: statistics.fmean(r[k] for r in rounds) for k in numeric}}
    row["decode_tok_s_by_round"] = [r["decode_tok_s"] for r in rounds]
    return row


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> float:
    """Share of greedy tokens equal to the reference's at the same position."""
    same = sum(a == b for got, want in zip(tokens, reference) for a, b in zip(got, want))
    return same / sum(len(want) for want in reference)


def ratios(rows: dict[str, dict]) -> dict[str, float]:
    out = {}
    for other in ("dense", "headwise"):
        if "pulse" in rows and other in rows:
            out[f"pulse_over_{other}_decode_tok_s"] = rows["pulse"]["decode_tok_s"] / rows[other]["decode_tok_s"]
            out[f"pulse_over_{other}_tpot_p50"] = rows["pulse"]["tpot_p50_s"] / rows[other]["tpot_p50_s"]
    return out


def run(config: DecodeBenchConfig, loaded: LoadedModel | None = None, log=print) -> dict:
    modes = config.mode_list()
    loaded = loaded or load_model(config.model, config.load_format)
    requests = prompts(loaded, config.lengths())
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for round_ in range(config.rounds):
        for mode in modes if round_ % 2 == 0 else modes[::-1]:
            reference = runs["dense"][0]["tokens"] if config.teacher_forced and mode != "dense" else None
            row = run_mode(mode, config, loaded, requests, reference)
            runs[mode].append(row)
            log(f"round {round_}, {mode}: {row['decode_tok_s']:.2f} decode tok/s, batch {row['mean_decode_batch']:.1f}")
    rows = {mode: mean_of_rounds(runs[mode]) for mode in modes}
    if "dense" in rows:
        for row in rows.values():
            forced = row.get("agreement_teacher_forced")
            row["agreement_with_dense"] = agreement(row["tokens"], rows["dense"]["tokens"]) if forced is None else forced
    settings = {**dataclasses.asdict(config), "lengths": config.lengths(), "device_kv_tokens": config.device_tokens()}
    return {"settings": settings, "modes": list(rows.values()), "ratios": ratios(rows)}


def table(result: dict) -> str:
    lines = [
        f"{'mode':22} {'decode tok/s':>12} {'TPOT p50 ms':>11} {'TPOT p99 ms':>11} {'batch':>6} "
        f"{'MB/step':>8} {'transfers/step':>14} {'wait s':>9} {'agree':>6}"
    ]
    for r in result["modes"]:
        lines.append(
            f"{r['mode']:22} {r['decode_tok_s']:12.2f} {r['tpot_p50_s'] * 1e3:11.0f} {r['tpot_p99_s'] * 1e3:11.0f} "
            f"{r['mean_decode_batch']:6.1f} {r['recall_bytes_per_step'] / 1e6:8.1f} {r['recall_transfers_per_step']:14.0f} "
            f"{r['recall_wait_s']:9.2f} {r.get('agreement_with_dense', float('nan')):6.3f}"
        )
    if result["settings"]["teacher_forced"]:
        lines.append("agree: teacher-forced, the share of positions where the mode's greedy token is dense's")
    lines += [f"{name}: {value:.2f}" for name, value in result["ratios"].items()]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Throughput and TPOT per mode, and recall bytes per layer per decode step."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("--plot needs matplotlib: pip install -e '.[bench]'") from e
    rows = result["modes"]
    names = [r["mode"] for r in rows]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4.5))
    a.bar(names, [r["decode_tok_s"] for r in rows])
    a.set_ylabel("decode tokens/s")
    width = 0.4
    xs = range(len(rows))
    b.bar([x - width / 2 for x in xs], [r["tpot_p50_s"] * 1e3 for r in rows], width, label="p50")
    b.bar([x + width / 2 for x in xs], [r["tpot_p99_s"] * 1e3 for r in rows], width, label="p99")
    b.set_xticks(list(xs), names)
    b.set_ylabel("TPOT (ms)")
    b.legend()
    for r in rows:
        if r["recall_bytes_by_layer_per_step"]:
            c.plot([v / 1e6 for v in r["recall_bytes_by_layer_per_step"]], label=r["mode"])
    c.set_xlabel("layer")
    c.set_ylabel("recall MB per decode step")
    c.legend()
    for axis in (a, b):
        axis.tick_params(axis="x", rotation=30)
    s = result["settings"]
    fig.suptitle(f"{s['requests']} requests of {s['context']} tokens, {s['output_tokens']} out, device KV {s['device_kv_tokens']} tokens")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(config: DecodeBenchConfig, json_path: Path | None, plot_path: Path | None) -> int:
    result = run(config)
    print(table(result))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=1) + "\n")
    if plot_path is not None:
        plot(result, plot_path)
    return 0
