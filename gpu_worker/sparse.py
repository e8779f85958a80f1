"""Which host blocks an offloaded request attends: key summaries, Quest-bound scores, SoloHead or
head-wise top-k, and (for the evals) the share of dense attention mass a selection keeps.

`pulse` takes one top-k set per (request, layer) for all heads (SoloHead), so every recall is
one contiguous (block, layer) unit; `headwise` takes one set per kv head, the baseline whose
recalls fragment into one K run and one V run per (block, head).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kernels.scoring import quest_scores, quest_weights
from kernels.summary import block_minmax

MODES = ("dense", "pulse", "headwise")


def check_mode(mode: str, offload_policy: str) -> None:
    """A dense worker offloads nothing: asking it to offload every request is a contradiction."""
    if mode == "dense" and offload_policy == "always":
        raise ValueError("--offload always needs --mode pulse or headwise (dense mode keeps every request resident)")


class BlockSummaries:
    """Per layer and host block: element-wise min and max of its keys, per kv head."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, device: torch.device):
        self.kmin = torch.empty((num_layers, 0, kv_heads, head_dim), device=device)
        self.kmax = torch.empty_like(self.kmin)

    def reserve(self, count: int) -> None:
        if count <= self.kmin.shape[1]:
            return
        layers, have, heads, dim = self.kmin.shape
        grown = (layers, max(count, 2 * have, 16), heads, dim)
        for name in ("kmin", "kmax"):
            old = getattr(self, name)
            new = torch.empty(grown, device=old.device)
            new[:, :have] = old
            setattr(self, name, new)

    def write(self, layer: int, first: int, k_blocks: torch.Tensor) -> None:
        """k_blocks: [n, block_size, kv_heads, dim] for summary slots first .. first+n-1."""
        n = k_blocks.shape[0]
        self.kmin[layer, first : first + n], self.kmax[layer, first : first + n] = block_minmax(k_blocks)

    def hosted(self, layer: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """kmin, kmax [count, kv_heads, dim] of the layer's first `count` host blocks."""
        return self.kmin[layer, :count], self.kmax[layer, :count]


def select_blocks(
    q: torch.Tensor, summaries: Sequence[tuple[torch.Tensor, torch.Tensor]], budget: int, per_head: bool
) -> list[list[list[int]]]:
    """For each decode row, the top-`budget` of its host blocks by the Quest bound of its query
    (summed over each kv head's GQA group): one set for all heads when not `per_head` (SoloHead),
    else one per kv head. q: [rows, q_heads, dim]; summaries: per row (kmin, kmax) [n, kv_heads,
    dim]. Returns per row one list per selection group (1 or kv_heads), highest bound first:
    recalls go in that order, so a deadline cuts the least promising blocks. The rows' scores
    (their block counts differ) go into one padded matrix: one top-k and one copy to the host
    for the whole batch."""
    if not summaries:
        return []
    kv_heads = summaries[0][0].shape[1]
    groups = kv_heads if per_head else 1
    counts = [kmin.shape[0] for kmin, _ in summaries]
    over = [r for r, n in enumerate(counts) if n > budget]
    top: dict[int, list[list[int]]] = {}
    if over:
        weights = quest_weights(q, kv_heads)
        scores = torch.full((len(over), groups, max(counts[r] for r in over)), float("-inf"), device=q.device)
        for i, r in enumerate(over):
            scores[i, :, : counts[r]] = quest_scores(weights[r], *summaries[r], per_head)
        top = dict(zip(over, scores.topk(budget, dim=-1).indices.tolist()))
    return [top[r] if r in top else [list(range(n)) for _ in range(groups)] for r, n in enumerate(counts)]


class AttentionMass:
    """Share of the dense attention probability of each query head that falls on the positions
    a request attends (sink, selected blocks, window): 1.0 means the selection lost nothing."""

    def __init__(self) -> None:
        self.total = 0.0
        self.count = 0
        self.minimum = 1.0

    def add(self, q: torch.Tensor, keys: torch.Tensor, attended: torch.Tensor) -> None:
        """q: [q_heads, dim]; keys: [kv_heads, length, dim] of the whole context in position order;
        attended: [groups, length] bool, groups 1 (shared by every head) or kv_heads."""
        heads, length, dim = keys.shape
        grouped = q.float().view(heads, -1, dim)
        probs = torch.softmax(grouped @ keys.float().transpose(1, 2) / math.sqrt(dim), dim=-1)  # [kv_heads, group, length]
        share = (probs * attended.expand(heads, length)[:, None, :]).sum(dim=-1)
        self.total += share.sum().item()
        self.count += share.numel()
        self.minimum = min(self.minimum, share.min().item())

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None
