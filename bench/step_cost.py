"""How GPU-shaped a decode step is, measured on the CPU: per decode step of dense, headwise and pulse
(side by side in one run) the aten ops it dispatches, the host syncs it would make on CUDA, the
bytes its ops read and write, and the bandwidth floor a GPU step could not go below.

    pulseinfer bench step-cost [--layers 1,2] [--contexts 512,1024,2048] [--batches 8,64] \\
        [--modes dense,headwise,pulse] [--json OUT]

Dummy weights of `--geometry` (Qwen3-8B) cut to each of `--layers` layers: the largest count runs at
every context, all of them at the smallest, where a line through them parts the work outside the
layers (embedding, last norm, LM head, sampler: the same at every context) from the per-layer work;
the totals are scaled to the geometry's own layers (36). Every
row of a batch decodes the same prompt of `context` tokens plus one token of its own: a first request
prefills the prompt and the rows reuse its blocks through the prefix cache, so a batch of 64 costs one
prefill (the figures are per decode step: prefill is not counted). Dense keeps every row resident;
headwise and pulse offload every row (`--offload always`) to a device pool of only the rows' sink,
recent-window and hot-buffer blocks, with a budget of `--budget-share` of the context (2048 at 32k).

Per decode step, the mean of `--steps` steps after `--warmup`:
- ops: aten ops dispatched (a TorchDispatchMode); kernels: those that are not views or metadata
  (view, as_strided, expand, t, transpose, slice, select, detach, alias, unsqueeze, permute, ...);
- syncs: would-be host syncs of the compute thread (pulseinfer.bench.sync_proxy.DeviceTracker);
- bytes: for each kernel, the bytes of its tensor inputs and outputs, floating point counted at two
  bytes an element (bf16, as on a GPU; the CPU runs float32); an indexed read counts only the rows it
  reads (its output) and an indexed write only the rows it writes. An approximation of memory
  traffic: it ignores caches and fusion, and counts a tensor once per op that touches it;
- floor: the bf16 weights a step must read (all but the embedding table, of which one row per
  request) plus the KV it attends: every row's context for dense, sink + budget + recent window for
  headwise and pulse; ratio: bytes over floor.
Contexts beyond this machine (32k at batch 64) are extrapolated linearly from the measured ones,
and labelled so. Recalls run on the I/O thread (copies, not kernels): their bytes are reported apart.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from pulseinfer.bench.sync_proxy import DeviceTracker, place_on_device
from pulseinfer.common.model.meta import load_model_config
from pulseinfer.engine import Engine, EngineConfig
from pulseinfer.gpu_check.fixtures import geometry_dir, materialized
from pulseinfer.gpu_worker.config import WorkerConfig
from pulseinfer.gpu_worker.model.loader import LoadedModel, load_model, weight_shapes
from pulseinfer.gpu_worker.offload.config import OffloadConfig
from pulseinfer.messages.sampling import SamplingParams
from pulseinfer.scheduler.batcher import BatcherConfig

MODES = ("dense", "headwise", "pulse")
aten = torch.ops.aten
METADATA = {aten._unsafe_view, aten.lift_fresh, aten._reshape_alias}  # views by effect that their schema does not mark
GATHERS = {aten.embedding, aten.index_select, aten.index, aten.gather}  # the source (first input) read at the output's rows
SCATTERS = {aten.index_put_, aten.index_put, aten._index_put_impl_, aten.index_copy_, aten.index_copy, aten.scatter_, aten.scatter}
BF16 = 2
METRICS = ("ops", "kernels", "syncs", "bytes", "recall_bytes")
TOP = 12  # kernels and sync sites kept by name per step
# CPU paths standing in for CUDA's Triton kernels and pinned copies: their would-be syncs are not a GPU step's
STAND_INS = ("kernels/", "kv_store/")


@dataclass(frozen=True)
class StepCostBenchConfig:
    geometry: str = "qwen3-8b"  # a shipped geometry (pulseinfer/common/model/geometries)
    # layer counts (at least two), the largest at every context; all at the smallest context, where the
    # line through them parts a step's per-layer work from the rest
    layers: str = "1,2"
    contexts: str = "512,1024,2048"  # prompt tokens of every row, multiples of the block size
    batches: str = "8,64"
    modes: str = ",".join(MODES)
    steps: int = 2  # decode steps measured per (mode, context, batch), after the warm-up
    warmup: int = 1  # the first is the rows' own prompt token
    sink: int = 64
    recent: int = 256
    budget_share: float = 1 / 16  # host-tier tokens selected per (row, layer), of the context: 2048 at 32k
    calibration_tokens: int = 256  # the lowrank scorer's fit at start: its accuracy is not measured here
    target_context: int = 32768  # extrapolated to
    block_size: int = 16

    def ints(self, name: str) -> list[int]:
        text = getattr(self, name)
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError as e:
            raise ValueError(f"--{name} takes comma-separated integers, got {text!r}") from e
        if not values or min(values) < 1:
            raise ValueError(f"--{name} takes positive integers, got {text!r}")
        return sorted(set(values))

    def mode_list(self) -> list[str]:
        modes = [m.strip() for m in self.modes.split(",") if m.strip()]
        if not modes or set(modes) - set(MODES):
            raise ValueError(f"--modes takes {', '.join(MODES)}; got {self.modes!r}")
        return modes

    def budget(self, context: int) -> int:
        return max(1, round(context * self.budget_share / self.block_size)) * self.block_size

    def check(self) -> None:
        if len(self.ints("layers")) < 2:
            raise ValueError("--layers needs two layer counts or more: a line through them parts the per-layer work from the rest")
        if any(c % self.block_size for c in self.ints("contexts")) or self.steps < 1 or self.warmup < 1:
            raise ValueError(f"--contexts must be multiples of {self.block_size}, --steps and --warmup positive")


class OpCounter(TorchDispatchMode):
    """While `counting`: aten ops dispatched, those that are kernels, and the kernels' bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.counting = False
        self.ops = self.kernels = self.bytes = 0
        self.by_op: Counter[str] = Counter()  # kernels by name

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.counting:
            self.ops += 1
            if not func.is_view and func.overloadpacket not in METADATA:
                self.kernels += 1
                self.by_op[func.overloadpacket.__name__] += 1
                self.bytes += traffic(func.overloadpacket, args, kwargs or {}, out)
        return out


def _tensors(value: object) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _nbytes(tensors: list[torch.Tensor]) -> int:
    """As the GPU would hold them: floating point in bf16."""
    return sum(t.numel() * (BF16 if t.is_floating_point() else t.element_size()) for t in tensors)


def traffic(packet, args: tuple, kwargs: dict, out: object) -> int:
    """An op's bytes read and written; an indexed op touches only the indexed rows of its source or target."""
    inputs = _tensors((args, kwargs))
    if packet in GATHERS:
        return 2 * _nbytes(_tensors(out)) + _nbytes(inputs[1:])
    if packet in SCATTERS:
        return 2 * _nbytes(inputs[1:])
    return _nbytes(inputs) + _nbytes(_tensors(out))


@dataclass
class Counting:
    """The two counters, on the compute thread from before the engine is built until after it closes."""

    ops: OpCounter
    syncs: DeviceTracker

    @contextmanager
    def step(self) -> Iterator[Callable[[], dict]]:
        """Counts one step; yields what returns its counts once it ended."""
        self.ops.ops = self.ops.kernels = self.ops.bytes = 0
        self.ops.by_op.clear()
        self.syncs.syncs.clear()
        self.ops.counting = self.syncs.counting = True
        try:
            yield self._counts
        finally:
            self.ops.counting = self.syncs.counting = False

    def _counts(self) -> dict:
        syncs = self.syncs.syncs
        return {
            "ops": self.ops.ops,
            "kernels": self.ops.kernels,
            "bytes": self.ops.bytes,
            "syncs": sum(n for (_, site), n in syncs.items() if not site.startswith(STAND_INS)),
            "top_kernels": dict(self.ops.by_op.most_common(TOP)),
            "sync_sites": {f"{kind} {site}": n for (kind, site), n in syncs.most_common(TOP)},
        }


@contextmanager
def counting() -> Iterator[Counting]:
    with DeviceTracker() as syncs, OpCounter() as ops:
        yield Counting(ops, syncs)


def engine_config(mode: str, context: int, config: StepCostBenchConfig) -> EngineConfig:
    """Dense with room for the shared prompt and every row's own blocks; headwise and pulse with
    every row offloaded to a device pool of only its footprint (sink, recent window, hot buffer)."""
    batch, block = max(config.ints("batches")), config.block_size
    tail = (config.warmup + config.steps + 2) // block + 2  # a row's own blocks beyond the shared prompt
    offload = OffloadConfig(
        sink=config.sink,
        recent=config.recent,
        budget=config.budget(context),
        layer_ahead="off" if mode == "headwise" else "auto",  # as bench decode: the baseline recalls in line
        calibration_tokens=config.calibration_tokens,
    )
    dense = mode == "dense"
    device_tokens = (context + batch * tail * block) if dense else batch * offload.geometry(block).device_blocks * block
    worker = WorkerConfig(mode=mode, block_size=block, device_kv_tokens=device_tokens, offload=offload, max_running=batch)
    batcher = BatcherConfig(max_batch_size=batch, prefill_chunk=1024, offload="never" if dense else "always", mixed_steps=False)
    return EngineConfig(worker=worker, batcher=batcher, host_kv_tokens=context + batch * tail * block + block)


def decode_steps(engine: Engine, count: Counting, prompts: list[list[int]], config: StepCostBenchConfig) -> list[dict]:
    """Decodes the prompts together: the counts of each of the last `steps` decode steps of the whole
    batch. The first is the rows' own prompt token, prefilled after the cached prompt: a step of one
    token a row too, the first of the warm-up. Fails if a row fails, or (headwise, pulse) was not offloaded."""
    params = SamplingParams(max_tokens=config.warmup + config.steps, temperature=0.0, ignore_eos=True)
    ids = {engine.submit(prompt, params) for prompt in prompts}
    recall_before = engine.selection_stats().get("recall", {}).get("bytes", 0)
    steps: list[dict] = []
    while engine.batcher.has_work():
        started = time.perf_counter()
        with count.step() as counts:
            finished = engine.step()
        plan = engine.last_plan
        if plan is not None and len(plan.decode_chunks) == len(plan.chunks) == len(prompts):
            recall = engine.selection_stats().get("recall", {}).get("bytes", 0)
            steps.append(counts() | {"recall_bytes": recall - recall_before, "seconds": time.perf_counter() - started})
        recall_before = engine.selection_stats().get("recall", {}).get("bytes", 0)
        for completion in finished:
            if completion.error or (engine.config.worker.mode != "dense" and not completion.offloaded):
                raise RuntimeError(f"row {completion.seq_id} failed ({completion.error}) or was not offloaded")
            ids.discard(completion.seq_id)
    if ids or len(steps) != config.warmup + config.steps:
        raise RuntimeError(f"{len(steps)} decode steps of the whole batch ran, {config.warmup + config.steps} were asked")
    return steps[-config.steps :]


def _mean(steps: list[dict]) -> dict:
    """The steps' mean figures, and the last one's most frequent kernels and sync sites."""
    means = {key: sum(s[key] for s in steps) / len(steps) for key in (*METRICS, "seconds")}
    return means | {key: steps[-1][key] for key in ("top_kernels", "sync_sites")}


def run_engine(mode: str, context: int, loaded: LoadedModel, prompt: list[int], config: StepCostBenchConfig) -> dict[int, dict]:
    """One mode at one context: the mean decode step at each batch size."""
    rows: dict[int, dict] = {}
    with counting() as count, Engine(engine_config(mode, context, config), loaded) as engine:
        # the first request prefills the prompt; the rows reuse its blocks and prefill their own token
        engine.generate([prompt + [0]], SamplingParams(max_tokens=1, ignore_eos=True))
        for batch in config.ints("batches"):
            rows[batch] = _mean(decode_steps(engine, count, [prompt + [1 + i] for i in range(batch)], config))
    return rows


def models(config: StepCostBenchConfig, folder: Path) -> dict[int, LoadedModel]:
    """The geometry at each layer count, every weight made once (the smaller models share the largest's)."""
    layers = config.ints("layers")
    largest = materialized(load_model(geometry_dir(config.geometry, folder, None, max(layers)), "dummy"))
    place_on_device(largest.weights.values())  # else the tracker copies them for each engine
    out = {max(layers): largest}
    for n in layers[:-1]:
        loaded = load_model(geometry_dir(config.geometry, folder, None, n), "dummy")
        out[n] = replace(loaded, weights={name: largest.weights[name] for name in loaded.weights})
    return out


def measure(config: StepCostBenchConfig, log: Callable[[str], None] = print) -> dict:
    """The mean decode step at each batch, by (layers, mode, context): the largest layer count at
    every context, the others at the smallest (the part of a step outside the layers does not
    depend on the context: the embedding, the last norm, the LM head and the sampler)."""
    config.check()
    contexts, layers = config.ints("contexts"), config.ints("layers")
    runs = [(max(layers), c) for c in contexts] + [(n, contexts[0]) for n in layers[:-1]]
    measured: dict = {}
    with tempfile.TemporaryDirectory() as folder:
        by_layers = models(config, Path(folder))
        vocab = by_layers[max(layers)].config.vocab_size
        generator = torch.Generator().manual_seed(0)
        prompt = torch.randint(1000, min(vocab, 40000), (max(contexts),), generator=generator).tolist()
        for mode in config.mode_list():
            for n, context in runs:
                started = time.perf_counter()
                measured[(n, mode, context)] = run_engine(mode, context, by_layers[n], prompt[:context], config)
                log(f"{n} layers, {mode}, context {context}: {time.perf_counter() - started:.0f} s")
    return measured


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares line through the points: (slope, intercept)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / spread if spread else 0.0
    return slope, my - slope * mx


def floor_bytes(mode: str, context: int, batch: int, config: StepCostBenchConfig) -> dict:
    """What a bf16 decode step of the whole geometry must read: weights, and the KV it attends."""
    c = load_model_config(config.geometry, "dummy")
    shapes = weight_shapes(c)
    embedding = shapes.pop("model.embed_tokens.weight")
    weights = sum(torch.Size(s).numel() for s in shapes.values()) + batch * embedding[1]
    attended = context if mode == "dense" else min(context, config.sink + config.budget(context) + config.recent)
    kv = batch * attended * c.num_layers * 2 * c.num_kv_heads * c.head_dim
    return {"weights": weights * BF16, "kv": kv * BF16, "attended_tokens": attended, "total": (weights + kv) * BF16}


def summarize(measured: dict, config: StepCostBenchConfig) -> list[dict]:
    """Per (mode, batch, context): the part outside the layers (the intercept over the layer counts
    at the smallest context), per layer (the rest of the largest layer count's, over its layers),
    totals at the geometry's layers, the floor."""
    full = load_model_config(config.geometry, "dummy").num_layers
    contexts, layers = config.ints("contexts"), config.ints("layers")
    out = []
    for mode in config.mode_list():
        for batch in config.ints("batches"):
            at = {n: measured[(n, mode, contexts[0])][batch] for n in layers}
            fixed = {m: fit([float(n) for n in layers], [at[n][m] for n in layers])[1] for m in METRICS}
            for context in contexts:
                step = measured[(max(layers), mode, context)][batch]
                row: dict = {"mode": mode, "batch": batch, "context": context, "measured": step}
                for metric in METRICS:
                    per_layer = (step[metric] - fixed[metric]) / max(layers)
                    row[metric] = {"per_layer": per_layer, "fixed": fixed[metric], "total": fixed[metric] + full * per_layer}
                row["floor"] = floor_bytes(mode, context, batch, config)
                row["bytes_over_floor"] = row["bytes"]["total"] / row["floor"]["total"]
                out.append(row)
    return out


def extrapolate(rows: list[dict], config: StepCostBenchConfig) -> list[dict]:
    """Per (mode, batch): each total at --target-context, from a line through the measured contexts."""
    out = []
    for mode in config.mode_list():
        for batch in config.ints("batches"):
            mine = [r for r in rows if r["mode"] == mode and r["batch"] == batch]
            xs = [float(r["context"]) for r in mine]
            row: dict = {"mode": mode, "batch": batch, "context": config.target_context, "extrapolated": True}
            for metric in METRICS:
                slope, intercept = fit(xs, [r[metric]["total"] for r in mine])
                row[metric] = {"total": intercept + slope * config.target_context}
            row["floor"] = floor_bytes(mode, config.target_context, batch, config)
            row["bytes_over_floor"] = row["bytes"]["total"] / row["floor"]["total"]
            out.append(row)
    return out


def ratios(rows: list[dict], config: StepCostBenchConfig) -> dict[str, float]:
    """Pulse and headwise over dense at the largest batch, and each mode's growth from the smallest
    batch to the largest, in kernels per step, at each context (the target's extrapolated)."""
    at = {(r["mode"], r["batch"], r["context"]): r for r in rows}
    low, high = min(config.ints("batches")), max(config.ints("batches"))
    out = {}
    for context in sorted({r["context"] for r in rows}):
        for mode in config.mode_list():
            kernels = {b: at[(mode, b, context)]["kernels"]["total"] for b in (low, high)}
            out[f"{mode}_kernels_b{low}_to_b{high}_at_{context}"] = kernels[high] / kernels[low]
            if mode != "dense" and ("dense", high, context) in at:
                dense = at[("dense", high, context)]
                out[f"{mode}_over_dense_kernels_b{high}_at_{context}"] = kernels[high] / dense["kernels"]["total"]
                out[f"{mode}_over_dense_ops_b{high}_at_{context}"] = at[(mode, high, context)]["ops"]["total"] / dense["ops"]["total"]
    return out


def run(config: StepCostBenchConfig, log: Callable[[str], None] = print) -> dict:
    measured = measure(config, log)
    rows = summarize(measured, config)
    rows += extrapolate(rows, config)
    settings = asdict(config) | {"budgets": {c: config.budget(c) for c in config.ints("contexts") + [config.target_context]}}
    return {"settings": settings, "rows": rows, "ratios": ratios(rows, config)}


TABLES = (  # title, value of a row, format
    ("kernels per step (ops in brackets)", lambda r: f"{r['kernels']['total']:.0f} ({r['ops']['total']:.0f})", "{}"),
    ("host syncs per step", lambda r: r["syncs"]["total"], "{:.1f}"),
    ("GB read+written per step (bf16)", lambda r: r["bytes"]["total"] / 1e9, "{:.2f}"),
    ("floor GB per step (weights + attended KV, bf16)", lambda r: r["floor"]["total"] / 1e9, "{:.2f}"),
    ("bytes / floor", lambda r: r["bytes_over_floor"], "{:.2f}"),
    ("recall MB per step (I/O thread)", lambda r: r["recall_bytes"]["total"] / 1e6, "{:.1f}"),
)
PER_LAYER = ("kernels", "ops", "syncs", "bytes")


def table(result: dict) -> str:
    """One table per figure: a line per (mode, batch), a column per context and the extrapolated
    target, then the per-layer figures at the largest measured context."""
    rows = result["rows"]
    contexts = sorted({r["context"] for r in rows if not r.get("extrapolated")})
    target = result["settings"]["target_context"]
    keys = sorted({(r["mode"], r["batch"]) for r in rows}, key=lambda k: (MODES.index(k[0]), k[1]))
    at = {(r["mode"], r["batch"], r["context"]): r for r in rows}
    layers = load_model_config(result["settings"]["geometry"], "dummy").num_layers
    head = f"{'mode':9} {'batch':>5} " + " ".join(f"{c:>14}" for c in contexts) + f" {f'{target} (extrap.)':>16}"
    lines = [f"per decode step, totals scaled to {layers} layers; contexts in tokens per row"]
    for title, value, fmt in TABLES:
        lines += ["", title, head]
        for mode, batch in keys:
            cells = [fmt.format(value(at[(mode, batch, c)])) for c in contexts]
            extrapolated = fmt.format(value(at[(mode, batch, target)]))
            lines.append(f"{mode:9} {batch:5} " + " ".join(f"{c:>14}" for c in cells) + f" {extrapolated:>16}")
    lines += ["", f"per layer at context {contexts[-1]}: " + ", ".join(PER_LAYER) + " (MB)"]
    for mode, batch in keys:
        r = at[(mode, batch, contexts[-1])]
        figures = [r[m]["per_layer"] / (1e6 if m == "bytes" else 1) for m in PER_LAYER]
        lines.append(f"{mode:9} {batch:5} " + " ".join(f"{f:>10.1f}" for f in figures))
    lines += [""] + [f"{name}: {value:.2f}" for name, value in result["ratios"].items()]
    return "\n".join(lines)


def main(config: StepCostBenchConfig, json_path: Path | None = None) -> int:
    result = run(config)
    print(table(result))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=1) + "\n")
    return 0
