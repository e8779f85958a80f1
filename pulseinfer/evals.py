"""Accuracy of sparse decoding on the real model: passkey retrieval, perplexity, and
multiple-choice loglikelihood as lm-evaluation-harness scores it.

Both run the in-process engine with every request offloaded in `pulse` and `headwise` mode
(so each decode step attends only sink + selected blocks + window) and resident in `dense`
mode, and report the share of dense attention mass the selections keep and the recall
transfers per decode step.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pulseinfer.engine import Engine, EngineConfig
from pulseinfer.gpu_worker.key_basis import prose
from pulseinfer.gpu_worker.model.loader import LoadedModel
from pulseinfer.messages.sampling import SamplingParams

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


@dataclass(frozen=True)
class ChoiceConfig:
    # JSON lines of {"question": str, "choices": [str, ...], "answer": index}: each choice scored as the
    # continuation " " + choice of the question, as lm-eval's multiple_choice tasks do (tests/data/lm_eval)
    file: Path | None = None
    limit: int = 0  # the first this many questions; 0: all
    # about this many tokens of the passkey eval's plain-text filler before each question: a long
    # context the question's tokens attend (with --score-prompt-with decode, set --score-from to it)
    filler: int = 0


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


def run_choice(engine: Engine, config: ChoiceConfig) -> dict:
    """lm-eval's loglikelihood of each choice (its tokens' logprobs summed, the prompt scored by the
    prefill) and accuracy (the likeliest choice is the answer), tokenized as lm-eval's remote
    tokenizer does: context and context + continuation encoded without special tokens."""
    if config.file is None:
        raise ValueError("choice needs --file: JSON lines of question, choices and answer")
    docs = [json.loads(line) for line in _read(config.file).splitlines() if line.strip()]
    docs = docs[: config.limit] if config.limit > 0 else docs
    lead = _filler(engine, config.filler)
    pairs = [_encode_pair(engine, lead + doc["question"], " " + choice) for doc in docs for choice in doc["choices"]]
    completions = engine.generate(
        [context + continuation for context, continuation in pairs], SamplingParams(max_tokens=1, prompt_logprobs=0)
    )
    scores = iter(sum(c.prompt_logprobs[len(context) - 1 :]) for (context, _), c in zip(pairs, completions))
    cases = []
    for doc in docs:
        loglikelihoods = [next(scores) for _ in doc["choices"]]
        cases.append({"loglikelihoods": loglikelihoods, "correct": loglikelihoods.index(max(loglikelihoods)) == doc["answer"]})
    return {"accuracy": sum(c["correct"] for c in cases) / len(cases), "questions": len(cases), "cases": cases}


def _filler(engine: Engine, tokens: int) -> str:
    """About `tokens` tokens of the passkey filler, ending in a newline ("" for 0)."""
    if tokens <= 0:
        return ""
    per_filler = len(engine.tokenizer.encode(" ".join([PASSKEY_FILLER] * 20), add_special=False)) / 20
    return " ".join([PASSKEY_FILLER] * max(1, round(tokens / per_filler))) + "\n"


def _encode_pair(engine: Engine, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's LM._encode_pair: trailing spaces of the context move to the continuation, whose
    tokens are those of the whole text after the context's."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = engine.tokenizer.encode(context + continuation, add_special=False)
    context_ids = engine.tokenizer.encode(context, add_special=False)
    return context_ids, whole[len(context_ids) :]


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from e


def evaluate(
    task: str, engine_config: EngineConfig, task_config: PasskeyConfig | PerplexityConfig | ChoiceConfig, loaded: LoadedModel | None = None
) -> dict:
    """Runs one eval; returns the settings, the results and the selection's statistics as one JSON-able dict."""
    torch.manual_seed(0)
    started = time.perf_counter()
    with Engine(sparse_engine_config(engine_config), loaded) as engine:
        run = {"passkey": run_passkey, "ppl": run_perplexity, "choice": run_choice}[task]
        results = run(engine, task_config)
        selection = engine.selection_stats()
    worker, offload = engine_config.worker, engine_config.worker.offload
    settings = {"task": task, "mode": worker.mode, "block_size": worker.block_size, **dataclasses.asdict(task_config)}
    if worker.mode != "dense":
        settings.update(budget=offload.budget, sink=offload.sink, recent=offload.recent)
    if task == "choice":
        settings.update(score_prompt_with=engine_config.batcher.score_prompt_with, score_from=engine_config.batcher.score_from)
    if "file" in settings:
        settings["file"] = str(settings["file"] or "pydoc_data.topics")
    return {"settings": settings, **results, "selection": selection, "seconds": round(time.perf_counter() - started, 1)}
