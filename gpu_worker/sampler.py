"""Token selection: greedy, or temperature / top-k / top-p with a per-token seeded generator."""

from __future__ import annotations

import torch

from scheduler.plan import SamplingSpec

_SEED_STRIDE = 1_000_003  # distinct generator seeds per (request seed, token index)


def sample(logits: torch.Tensor, specs: list[SamplingSpec]) -> list[int]:
    if logits.shape[0] != len(specs):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(specs)} sampling specs")
    greedy = logits.argmax(dim=-1).tolist()
    return [greedy[i] if spec.temperature == 0 else _sample_one(logits[i], spec) for i, spec in enumerate(specs)]


def _sample_one(logits: torch.Tensor, spec: SamplingSpec) -> int:
    scaled = logits.float() / spec.temperature
    if 0 < spec.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, spec.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if spec.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= spec.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    generator = torch.Generator(device="cpu").manual_seed((spec.seed * _SEED_STRIDE + spec.step) % (2**63))
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
