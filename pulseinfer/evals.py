"""Accuracy of sparse decoding on the real model: passkey retrieval and perplexity.

Both run the in-process engine with every request offloaded in `pulse` and `headwise` mode
(so each decode step attends only sink + selected blocks + window) and resident in `dense`
mode, and report the share of dense attention mass the selections keep and the recall
transfers per decode step.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pulseinfer.engine import Engine, EngineConfig
from pulseinfer.gpu_worker.key_basis import prose
from pulseinfer.gpu_worker.model.loader import LoadedModel
from pulseinfer.scheduler.request import SamplingParams

# The plain-text passkey test of Landmark Attention (Mohtashami & Jaggi, 2023), parts joined by newlines.
PASSKEY_INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
    "I will quiz you about the important information there."
)
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = "What is the pass key? The pass key is"


@dataclass(frozen=True)
class PasskeyConfig:
    lengths: str = "1000,2000,4000,6500"  # prompt lengths in tokens
    depths: str = "0.1,0.5,0.9"  # where the key sits, as a fraction of the filler
    trials: int = 2  # random keys per (length, depth)
    seed: int = 0


@dataclass(frozen=True)
class PerplexityConfig:
    file: Path | None = None  # text to score; default: the prose of Python's pydoc_data.topics
    context: int = 4096  # tokens per window
    score_tokens: int = 64  # the last tokens of each window, each predicted by a sparse decode step
    windows: int = 4  # non-overlapping windows from the start of the text


def sparse_engine_config(config: EngineConfig) -> EngineConfig:
    """Offloads every request in the sparse modes (the selection is what is measured) and none in dense,
    and turns on the attention-mass measurement."""
    offload = "never" if config.worker.mode == "dense" else "always"
    worker = dataclasses.replace(config.worker, offload=dataclasses.replace(config.worker.offload, measure_attention_mass=True))
    return dataclasses.replace(config, worker=worker, batcher=dataclasses.replace(config.batcher, offload=offload))


def _csv(text: str, kind: type) -> list:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise ValueError(f"expected comma-separated {kind.__name__} values, got {text!r}") from e
    if not values:
        raise ValueError(f"expected comma-separated {kind.__name__} values, got {text!r}")
    return values


def passkey_prompt(engine: Engine, length: int, depth: float, key: int) -> list[int]:
    """About `length` tokens of filler with the key at `depth` of it."""
    tok = engine.tokenizer
    needle = PASSKEY_NEEDLE.format(key=key)
    fixed = len(tok.encode("\n".join([PASSKEY_INTRO, "", needle, "", PASSKEY_QUESTION])))
    per_filler = len(tok.encode(" ".join([PASSKEY_FILLER] * 20))) / 20
    repeats = max(1, round((length - fixed) / per_filler))
    before = round(repeats * depth)
    parts = [PASSKEY_INTRO, " ".join([PASSKEY_FILLER] * before), needle, " ".join([PASSKEY_FILLER] * (repeats - before)), PASSKEY_QUESTION]
    return tok.encode("\n".join(parts))


def run_passkey(engine: Engine, config: PasskeyConfig) -> dict:
    lengths, depths = _csv(config.lengths, int), _csv(config.depths, float)
    if config.trials < 1 or any(not 0 <= d <= 1 for d in depths):
        raise ValueError("--trials must be >= 1 and every depth in [0, 1]")
    rng = random.Random(config.seed)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    results = []
    for length in lengths:
        cases = [(depth, rng.randrange(10000, 100000)) for depth in depths for _ in range(config.trials)]
        prompts = [passkey_prompt(engine, length, depth, key) for depth, key in cases]
        completions = engine.generate(prompts, params)
        for (depth, key), prompt, completion in zip(cases, prompts, completions):
            if completion.error:
                raise RuntimeError(f"passkey request failed: {completion.error}")
            results.append(
                {
                    "length": length,
                    "tokens": len(prompt),
                    "depth": depth,
                    "key": key,
                    "answer": completion.text,
                    "found": str(key) in completion.text,
                }
            )
    by_length = {
        str(length): sum(r["found"] for r in results if r["length"] == length) / sum(1 for r in results if r["length"] == length)
        for length in lengths
    }
    return {"accuracy": sum(r["found"] for r in results) / len(results), "accuracy_by_length": by_length, "cases": results}


def run_perplexity(engine: Engine, config: PerplexityConfig) -> dict:
    if not 0 < config.score_tokens < config.context or config.windows < 1:
        raise ValueError("--score-tokens must be in (0, --context) and --windows >= 1")
    text = prose() if config.file is None else _read(config.file)
    ids = engine.tokenizer.encode(text)
    count = min(config.windows, len(ids) // config.context)
    if count == 0:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one window of --context {config.context}")
    windows = [ids[i * config.context : (i + 1) * config.context] for i in range(count)]
    logprobs = engine.score(windows, config.score_tokens)
    nll = [-lp for window in logprobs for lp in window]
    per_window = [math.exp(-sum(w) / len(w)) for w in logprobs]
    return {"perplexity": math.exp(sum(nll) / len(nll)), "perplexity_by_window": per_window, "scored_tokens": len(nll), "windows": count}


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from e


def evaluate(
    task: str, engine_config: EngineConfig, task_config: PasskeyConfig | PerplexityConfig, loaded: LoadedModel | None = None
) -> dict:
    """Runs one eval; returns the settings, the results and the selection's statistics as one JSON-able dict."""
    torch.manual_seed(0)
    started = time.perf_counter()
    with Engine(sparse_engine_config(engine_config), loaded) as engine:
        results = run_passkey(engine, task_config) if task == "passkey" else run_perplexity(engine, task_config)
        selection = engine.selection_stats()
    worker, offload = engine_config.worker, engine_config.worker.offload
    settings = {"task": task, "mode": worker.mode, "block_size": worker.block_size, **dataclasses.asdict(task_config)}
    if worker.mode != "dense":
        settings.update(budget=offload.budget, sink=offload.sink, recent=offload.recent)
    if "file" in settings:
        settings["file"] = str(settings["file"] or "pydoc_data.topics")
    return {"settings": settings, **results, "selection": selection, "seconds": round(time.perf_counter() - started, 1)}
