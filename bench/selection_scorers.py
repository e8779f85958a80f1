"""Block scorers compared on perplexity, fast enough for many windows.

`pulseinfer eval ppl` decodes the last tokens of each window through the offloading engine. Here
the same teacher-forced decode is computed directly: each window's prefix once with dense causal
attention, then the scored positions with attention masked to what an offloaded request attends
(sink, the top-`budget` host blocks by the scorer, the recent window). For the worker's scorers
the perplexity is the engine's (tests/test_selection_scorers.py checks it against `eval ppl`).

    pulseinfer bench selection-scorers [--windows 16] [--context 4096] [--score-tokens 64]
        [--budget 1024] [--scorers dense,quest,lowrank,softmax,center,quest-4,oracle] [--json OUT]

Scorers (one selection per request and layer, over all query heads):
- `quest`: the Quest bound summed over the query heads (SoloHead, the worker's `--scorer quest`);
- `softmax`: each query head's bounds through a softmax first, then summed (an estimate of
  each block's share of attention, so no head dominates by the scale of its query);
- `lowrank`: each block's share of attention estimated from its keys projected on the layer's
  rank-16 key basis (what the worker runs by default);
- `center`: q . (kmin + kmax) / 2 summed (a mean-key estimate instead of a bound);
- `quest-4`: `softmax` over bounds of 4-token sub-blocks (4x the summaries);
- `oracle`: the dense attention probability of each block summed over the heads (needs every
  key: the best any scorer can do at this budget).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pulseinfer.gpu_worker.forward import Mask, dense_forward
from pulseinfer.gpu_worker.key_basis import calibration_ids, key_bases, prose
from pulseinfer.gpu_worker.model.decoder import Decoder
from pulseinfer.gpu_worker.model.loader import LoadedModel, load_model
from pulseinfer.gpu_worker.offload.config import OffloadConfig, OffloadGeometry
from pulseinfer.gpu_worker.sparse import LowRankScorer
from pulseinfer.kernels.scoring import quest_scores, quest_weights
from pulseinfer.kernels.summary import block_minmax


@dataclass(frozen=True)
class ScoringInput:
    """One decode query of one layer: what a scorer may look at."""

    q: torch.Tensor  # [heads, dim]
    blocks: torch.Tensor  # keys of the host blocks [n, block, kv_heads, dim]
    context: torch.Tensor  # every key of the context [length, kv_heads, dim] (the oracle's)
    host_start: int  # position of the first host block's first key
    layer: int
    lowrank: LowRankScorer  # the worker's, with the key bases fitted for this model


Scorer = Callable[[ScoringInput], torch.Tensor]  # -> a score per host block [n]


@dataclass(frozen=True)
class ScorerStudyConfig:
    windows: int = 16
    context: int = 4096
    score_tokens: int = 64
    budget: int = 1024
    sink: int = 64
    recent: int = 256
    block_size: int = 16
    key_rank: int = 16
    calibration_tokens: int = 2048
    scorers: str = "dense,quest,lowrank,softmax,center,quest-4,oracle"


def _head_bounds(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """The Quest bound of each query head (not summed over its GQA group): [heads, n]."""
    group = q.shape[0] // kmin.shape[1]
    kmin, kmax = kmin.repeat_interleave(group, 1), kmax.repeat_interleave(group, 1)
    return torch.einsum("hd,nhd->hn", q.clamp(min=0), kmax) + torch.einsum("hd,nhd->hn", q.clamp(max=0), kmin)


def quest(x: ScoringInput) -> torch.Tensor:
    kmin, kmax = block_minmax(x.blocks)
    every = torch.arange(kmin.shape[0])[None]
    return quest_scores(quest_weights(x.q[None], kmin.shape[1]), kmin, kmax, every, per_head=False)[0, 0]


def softmax(x: ScoringInput) -> torch.Tensor:
    return torch.softmax(_head_bounds(x.q, *block_minmax(x.blocks)) / math.sqrt(x.q.shape[-1]), dim=-1).sum(dim=0)


def center(x: ScoringInput) -> torch.Tensor:
    kmin, kmax = block_minmax(x.blocks)
    group = x.q.shape[0] // kmin.shape[1]
    return torch.einsum("hd,nhd->n", x.q, ((kmin + kmax) / 2).repeat_interleave(group, 1))


def quest_4(x: ScoringInput) -> torch.Tensor:
    n, size = x.blocks.shape[:2]
    kmin, kmax = block_minmax(x.blocks.reshape(n * size // 4, 4, *x.blocks.shape[2:]))
    bounds = _head_bounds(x.q, kmin, kmax).view(x.q.shape[0], n, size // 4) / math.sqrt(x.q.shape[-1])
    return torch.softmax(torch.logsumexp(bounds, dim=-1), dim=-1).sum(dim=0)


def lowrank(x: ScoringInput) -> torch.Tensor:
    summaries = x.lowrank.summarize(x.layer, x.blocks)
    every = torch.arange(x.blocks.shape[0])[None]
    return x.lowrank.scores(x.layer, x.q[None], summaries, every, torch.ones_like(every, dtype=torch.bool), per_head=False)[0, 0]


def oracle(x: ScoringInput) -> torch.Tensor:
    group = x.q.shape[0] // x.context.shape[1]
    logits = torch.einsum("hd,lhd->hl", x.q, x.context.repeat_interleave(group, 1)) / math.sqrt(x.q.shape[-1])
    n, size = x.blocks.shape[:2]
    host = torch.softmax(logits, dim=-1)[:, x.host_start : x.host_start + n * size]
    return host.reshape(x.q.shape[0], n, size).sum(dim=(0, 2))


SCORERS: dict[str, Scorer] = {
    "quest": quest,
    "lowrank": lowrank,
    "softmax": softmax,
    "center": center,
    "quest-4": quest_4,
    "oracle": oracle,
}


def sparse_mask(geometry: OffloadGeometry, start: int, scorer: Scorer | None, lowrank_scorer: LowRankScorer) -> Mask:
    """What an offloaded request at positions start.. attends: sink, the scorer's top blocks among
    the host blocks, the recent window (all of the causal context for `dense`)."""
    g, size = geometry, geometry.block_size

    def mask(layer: int, q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        length = keys.shape[0]
        allowed = torch.zeros((q.shape[0], length), dtype=torch.bool)
        for t in range(q.shape[0]):
            position = start + t
            window = g.window_start(position + 1) * size
            allowed[t, : position + 1] = True
            hosted = window // size - g.sink_blocks
            if scorer is None or hosted <= g.budget_blocks:
                continue
            host_start = g.sink_blocks * size
            blocks = keys[host_start:window].view(hosted, size, *keys.shape[1:])
            scores = scorer(ScoringInput(q[t], blocks, keys[: position + 1], host_start, layer, lowrank_scorer))
            dropped = torch.ones(hosted, dtype=torch.bool)
            dropped[scores.topk(g.budget_blocks).indices] = False
            allowed[t, host_start:window] &= ~dropped.repeat_interleave(size)
        return allowed

    return mask


def window_logprobs(model: Decoder, ids: list[int], score_tokens: int, masks: dict[str, Mask]) -> dict[str, torch.Tensor]:
    """Log-probabilities of the window's last `score_tokens` tokens, each predicted by a decode step
    as `eval ppl` runs it (the prompt is all but the last score_tokens + 1 tokens)."""
    start = len(ids) - score_tokens - 1
    _, prefix = dense_forward(model, ids[:start])
    targets = torch.tensor(ids[start + 1 :])
    out = {}
    for name, mask in masks.items():
        hidden, _ = dense_forward(model, ids[start:-1], start, prefix, mask)
        logits = model.logits(hidden)
        out[name] = torch.log_softmax(logits, dim=-1)[torch.arange(len(targets)), targets]
    return out


def study(config: ScorerStudyConfig, loaded: LoadedModel | None = None, log=print) -> dict:
    loaded = loaded or load_model()
    names = [n.strip() for n in config.scorers.split(",") if n.strip()]
    unknown = [n for n in names if n != "dense" and n not in SCORERS]
    if unknown or "dense" not in names:
        raise ValueError(f"--scorers takes dense (required, the reference) and {', '.join(SCORERS)}; got {config.scorers!r}")
    model = Decoder(loaded.config, loaded.weights, torch.device("cpu"), torch.float32)
    geometry = OffloadConfig(sink=config.sink, recent=config.recent, budget=config.budget).geometry(config.block_size)
    ids = loaded.tokenizer.encode(prose())
    start = config.context - config.score_tokens - 1
    lowrank_scorer = LowRankScorer(key_bases(model, calibration_ids(loaded.tokenizer, config.calibration_tokens), config.key_rank))
    masks = {name: sparse_mask(geometry, start, SCORERS.get(name), lowrank_scorer) for name in names}
    logprobs: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    with torch.inference_mode():
        for w in range(min(config.windows, len(ids) // config.context)):
            for name, lp in window_logprobs(model, ids[w * config.context : (w + 1) * config.context], config.score_tokens, masks).items():
                logprobs[name].append(lp)
            log(f"window {w}: " + ", ".join(f"{n} {math.exp(-torch.cat(lp).mean().item()):.3f}" for n, lp in logprobs.items()))
    return {"settings": asdict(config), "scorers": [_row(name, torch.cat(logprobs[name]), torch.cat(logprobs["dense"])) for name in names]}


def _row(name: str, logprobs: torch.Tensor, dense: torch.Tensor) -> dict:
    """Perplexity, and its ratio to dense with a paired 95% interval over the scored tokens."""
    diff = (dense - logprobs).tolist()
    mean, half = statistics.fmean(diff), 1.96 * statistics.stdev(diff) / math.sqrt(len(diff))
    return {
        "scorer": name,
        "perplexity": math.exp(-logprobs.mean().item()),
        "over_dense": math.exp(mean),
        "over_dense_95": [math.exp(mean - half), math.exp(mean + half)],
        "scored_tokens": len(diff),
    }


def main(config: ScorerStudyConfig, json_path: Path | None = None) -> int:
    result = study(config)
    for r in result["scorers"]:
        low, high = r["over_dense_95"]
        print(f"{r['scorer']:8} ppl {r['perplexity']:.3f}  / dense {r['over_dense']:.4f}  (95% {low:.4f}..{high:.4f})")
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=1) + "\n")
    return 0
