"""Token selection: greedy, or temperature / top-k / top-p with a per-token seeded generator."""

from __future__ import annotations

import torch

from pulseinfer.common.syncs import to_host
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


def _probs(logits: torch.Tensor, spec: SamplingSpec) -> torch.Tensor:
    """The distribution a row samples from, on the logits' device. With a finite maximum the scaled
    row has a 0 at the top and <= 0 (or -inf) elsewhere: softmax of it is a valid distribution for any temperature."""
    logits = logits.float()
    scaled = (logits - logits.max()) / min(spec.temperature, _MAX_TEMPERATURE)
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
