"""Structured outputs' cost per decode step: the sampler of a batch of rows, each under its own JSON
schema's grammar, against the same batch unconstrained, side by side in one run.

    pulseinfer bench structured-masks [--rows 32] [--steps 40] [--schemas tests/data/json_schemas.json] [--json OUT]

Every step samples (greedy) from random logits of the model's vocabulary: unconstrained, the sampler
alone; constrained, the same with each row's grammar mask made (llguidance, on the host, with the
GIL released), applied, and its matcher advanced past the sampled token. A row whose grammar
completes starts its schema again, so every step has `rows` live grammars. The mask is made before
the step's first read of the device: on a GPU it overlaps the forward, so what it adds to a step
there is the part that outlasts the forward.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pulseinfer.bench.timing import report
from pulseinfer.common.grammar import GrammarTokenizer, fill_masks, masked, structured_grammar
from pulseinfer.common.model.meta import load_model_meta
from pulseinfer.gpu_worker.sampler import sample
from pulseinfer.messages.plan import SamplingSpec


@dataclass(frozen=True)
class StructuredMasksBenchConfig:
    rows: int = 32
    steps: int = 40
    schemas: str = "tests/data/json_schemas.json"


def main(args: StructuredMasksBenchConfig, json_path: Path | None = None) -> int:
    torch.manual_seed(0)
    meta = load_model_meta()
    vocab = meta.config.vocab_size
    grammars = GrammarTokenizer(meta.tokenizer, vocab, [meta.tokenizer.eos_id])
    schemas = json.loads(Path(args.schemas).read_text())
    texts = [structured_grammar("json_schema", json.dumps(schemas[i % len(schemas)])) for i in range(args.rows)]
    matchers = [grammars.matcher(text) for text in texts]
    plain = [SamplingSpec(0.0, 1.0, 0, 0, 0) for _ in range(args.rows)]
    times: dict[str, list[float]] = {"unconstrained": [], "constrained": [], "fill_masks": [], "masked": []}
    for _ in range(args.steps):
        logits = torch.randn(args.rows, vocab)
        times["unconstrained"].append(_timed(sample, logits, plain))
        times["fill_masks"].append(_timed(fill_masks, matchers, vocab))
        times["masked"].append(_timed(masked, logits, torch.arange(args.rows), fill_masks(matchers, vocab)))
        specs = [dataclasses.replace(spec, structured=("json_schema", ""), grammar=m) for spec, m in zip(plain, matchers)]
        times["constrained"].append(_timed(sample, logits, specs))
        matchers = [grammars.matcher(text) if m.done else m for m, text in zip(matchers, texts)]
    results = {f"{name}_ms_mean": statistics.fmean(t) * 1e3 for name, t in times.items()}
    results |= {f"{name}_ms_p95": sorted(t)[int(0.95 * (len(t) - 1))] * 1e3 for name, t in times.items()}
    results["constrained_over_unconstrained"] = results["constrained_ms_mean"] / results["unconstrained_ms_mean"]
    results["vocab"] = vocab
    report(args, results, json_path, 36)
    return 0


def _timed(fn, *args) -> float:
    started = time.perf_counter()
    fn(*args)
    return time.perf_counter() - started
