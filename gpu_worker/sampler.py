"""Token selection: greedy, or temperature / min-p / top-k / top-p (vLLM's order) with a per-token
seeded generator, after each row's logit_bias and, before its min_tokens, its stop tokens banned."""

from __future__ import annotations

import math

import torch

from pulseinfer.common.syncs import to_device, to_host
from pulseinfer.scheduler.plan import SamplingSpec

_SEED_STRIDE = 1_000_003  # distinct generator seeds per (request seed, token index)
# Below this a temperature is greedy: dividing by it only overflows, and the distribution it
# asks for is already one-hot to float32 precision (vLLM's _SAMPLING_EPS).
_SAMPLING_EPS = 1e-5
# A float64 temperature past float32's range becomes inf in the division, and -inf / inf is NaN;
# at float32's max every finite logit gap already scales to ~0 (uniform), so capping changes nothing.
_MAX_TEMPERATURE = torch.finfo(torch.float32).max
UNSAMPLEABLE = "the model's logits for this token have no finite maximum (NaN or inf), so no token can be chosen"


def sample(logits: torch.Tensor, specs: list[SamplingSpec]) -> list[int | str]:
    """A token per row, or, for a row that cannot be sampled (a broken model row), an error that
    fails only that row's request. The device is read once: every row's greedy token and finite
    check, and the distributions of the rows that sample, in one transfer."""
    if logits.shape[0] != len(specs):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(specs)} sampling specs")
    logits = _biased(logits, specs)
    sampled = [i for i, spec in enumerate(specs) if spec.temperature >= _SAMPLING_EPS]
    # amax propagates NaN, so this one check catches NaN, all -inf and +inf rows (whose distributions go unused)
    greedy, finite, *probs = to_host(
        [logits.argmax(dim=-1), torch.isfinite(logits.amax(dim=-1))] + [_probs(logits[i], specs[i]) for i in sampled]
    )
    distributions = dict(zip(sampled, probs))
    tokens: list[int | str] = []
    for i, (spec, token, ok) in enumerate(zip(specs, greedy.tolist(), finite.tolist())):
        if not ok:
            tokens.append(UNSAMPLEABLE)
        elif i in distributions:
            generator = torch.Generator(device="cpu").manual_seed((spec.seed * _SEED_STRIDE + spec.step) % (2**63))
            tokens.append(int(torch.multinomial(distributions[i], 1, generator=generator)))
        else:
            tokens.append(token)
    return tokens


def _biased(logits: torch.Tensor, specs: list[SamplingSpec]) -> torch.Tensor:
    """The logits with every row's logit_bias added and its stop tokens at -inf while it is short
    of min_tokens: one scatter for the batch, on a copy (the logits as they are when no row asks)."""
    if not any(spec.bias_ids or spec.step < spec.min_tokens for spec in specs):
        return logits
    rows, ids, values = [], [], []
    for row, spec in enumerate(specs):
        banned = spec.stop_ids if spec.step < spec.min_tokens else ()
        for tokens, add in ((spec.bias_ids, spec.bias_values), (banned, (float("-inf"),) * len(banned))):
            rows += [row] * len(tokens)
            ids += tokens
            values += add
    index = to_device([torch.tensor(rows), torch.tensor(ids), torch.tensor(values, dtype=torch.float32)], logits.device)
    return logits.float().index_put((index[0], index[1]), index[2], accumulate=True)


def _probs(logits: torch.Tensor, spec: SamplingSpec) -> torch.Tensor:
    """The distribution a row samples from, on the logits' device. With a finite maximum the scaled
    row has a 0 at the top and <= 0 (or -inf) elsewhere: softmax of it is a valid distribution for any temperature."""
    logits = logits.float()
    scaled = (logits - logits.max()) / min(spec.temperature, _MAX_TEMPERATURE)
    if spec.min_p > 0:  # p / p_max = exp(scaled): keep p >= min_p * p_max
        scaled = scaled.masked_fill(scaled < math.log(spec.min_p), float("-inf"))
    if 0 < spec.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, spec.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if spec.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p
        drop = sorted_probs.cumsum(-1) - sorted_probs >= spec.top_p
        drop[0] = False  # the top token always stays, even when top_p rounds to 0 in float32
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return probs
