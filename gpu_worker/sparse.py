"""Which host blocks an offloaded request attends: per-block key summaries and scores (Quest
bounds of min/max summaries, or attention estimated from low-rank keys), SoloHead or head-wise
top-k, and (for the evals) the share of dense attention mass a selection keeps.

`pulse` takes one top-k set per (request, layer) for all heads (SoloHead), so every recall is
one contiguous (block, layer) unit; `headwise` takes one set per kv head, the baseline whose
recalls fragment into one K run and one V run per (block, head).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from pulseinfer.common.syncs import to_device
from pulseinfer.kernels.scoring import lowrank_scores, quest_scores, quest_weights
from pulseinfer.kernels.summary import block_minmax

MODES = ("dense", "pulse", "headwise")


def check_mode(mode: str, offload_policy: str) -> None:
    """A dense worker offloads nothing: asking it to offload every request is a contradiction."""
    if mode == "dense" and offload_policy == "always":
        raise ValueError("--offload always needs --mode pulse or headwise (dense mode keeps every request resident)")


class QuestScorer:
    """Blocks summarized by the element-wise min and max of their keys per kv head, scored by
    the Quest bound (an upper bound of any of the block's q.k)."""

    def __init__(self, kv_heads: int, head_dim: int):
        self.kv_heads, self.head_dim = kv_heads, head_dim

    def shapes(self, block_size: int) -> list[tuple[int, ...]]:
        return [(BLOCKS, self.kv_heads, self.head_dim)] * 2

    def summarize(self, layer: int, k_blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return block_minmax(k_blocks)

    def scores(self, layer: int, q: torch.Tensor, hosted: Sequence[tuple[torch.Tensor, ...]], per_head: bool) -> list[torch.Tensor]:
        weights = quest_weights(q, self.kv_heads)  # once for every row
        return [quest_scores(w, kmin, kmax, per_head) for w, (kmin, kmax) in zip(weights, hosted)]


class LowRankScorer:
    """Blocks summarized by their keys projected on a per-layer low-rank basis (gpu_worker/key_basis.py),
    scored by the share of the query's attention they draw in that projection."""

    def __init__(self, bases: torch.Tensor):
        self.bases = bases  # [layers, kv_heads, head_dim, rank] on the device
        self.kv_heads, self.rank = bases.shape[1], bases.shape[3]

    def shapes(self, block_size: int) -> list[tuple[int, ...]]:
        return [(self.kv_heads, self.rank, BLOCKS, block_size)]  # each coordinate's blocks contiguous: lowrank_scores

    def summarize(self, layer: int, k_blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (torch.einsum("nbhd,hdr->hrnb", k_blocks.float(), self.bases[layer]),)

    def scores(self, layer: int, q: torch.Tensor, hosted: Sequence[tuple[torch.Tensor, ...]], per_head: bool) -> list[torch.Tensor]:
        return [lowrank_scores(row, self.bases[layer], keys, per_head) for row, (keys,) in zip(q, hosted)]


Scorer = QuestScorer | LowRankScorer
BLOCKS = -1  # in a scorer's summary shapes: the dimension that counts host blocks
SCORERS = ("lowrank", "quest")


class BlockSummaries:
    """Per layer and host block of one request: what its scorer selects by, kept on the device so
    selection never reads host keys."""

    def __init__(self, num_layers: int, scorer: Scorer, block_size: int, device: torch.device):
        self.scorer = scorer
        shapes = scorer.shapes(block_size)
        self.dims = [1 + shape.index(BLOCKS) for shape in shapes]  # after the layer dimension
        self.parts = [torch.empty((num_layers, *(0 if d == BLOCKS else d for d in shape)), device=device) for shape in shapes]

    def reserve(self, count: int) -> None:
        have = self.parts[0].shape[self.dims[0]]
        if count <= have:
            return
        for i, (old, dim) in enumerate(zip(self.parts, self.dims)):
            grown = list(old.shape)
            grown[dim] = max(count, 2 * have, 16)
            self.parts[i] = torch.empty(grown, device=old.device)
            self.parts[i].narrow(dim, 0, have).copy_(old)

    def write(self, layer: int, first: int, k_blocks: torch.Tensor) -> None:
        """k_blocks: [n, block_size, kv_heads, dim] for summary slots first .. first+n-1."""
        for part, dim, summary in zip(self.parts, self.dims, self.scorer.summarize(layer, k_blocks)):
            part[layer].narrow(dim - 1, first, k_blocks.shape[0]).copy_(summary)

    def hosted(self, layer: int, count: int) -> tuple[torch.Tensor, ...]:
        """The summaries of the layer's first `count` host blocks."""
        return tuple(part[layer].narrow(dim - 1, 0, count) for part, dim in zip(self.parts, self.dims))


def select_blocks(
    scorer: Scorer, layer: int, q: torch.Tensor, summaries: Sequence[BlockSummaries], counts: Sequence[int], budget: int, per_head: bool
) -> torch.Tensor:
    """For each decode row, the top-`budget` of its first `counts[row]` host blocks by the
    scorer's estimate for its query at `layer`: one set for all heads when not `per_head`
    (SoloHead), else one per kv head. q: [rows, q_heads, dim]. Returns host block indices
    [rows, groups (1 or kv_heads), budget], highest score first (recalls go in that order, so a
    deadline cuts the least promising blocks); a row with no more host blocks than the budget takes
    them all, in order, padded with -1. The rows' scores (their block counts differ) go into one
    padded matrix: one top-k for the whole batch."""
    over = [r for r, n in enumerate(counts) if n > budget]
    if over and len(over) == len(counts):  # the usual case in decode: no row to pad
        return _top(scorer, layer, q, summaries, counts, budget, per_head)
    # the rows' indices and counts from the host in one copy: a list indexing a device tensor would be a sync
    over_at, counts_at = to_device([torch.tensor(over, dtype=torch.long), torch.tensor(counts, dtype=torch.long)], q.device)
    chosen = torch.arange(budget, device=q.device).repeat(len(counts), scorer.kv_heads if per_head else 1, 1)
    chosen.masked_fill_(chosen >= counts_at[:, None, None], -1)
    if over:
        chosen[over_at] = _top(scorer, layer, q[over_at], [summaries[r] for r in over], [counts[r] for r in over], budget, per_head)
    return chosen


def _top(
    scorer: Scorer, layer: int, q: torch.Tensor, summaries: Sequence[BlockSummaries], counts: Sequence[int], budget: int, per_head: bool
) -> torch.Tensor:
    """select_blocks of rows that each have more than `budget` host blocks."""
    rows = scorer.scores(layer, q, [s.hosted(layer, n) for s, n in zip(summaries, counts)], per_head)
    scores = torch.full((len(counts), scorer.kv_heads if per_head else 1, max(counts)), float("-inf"), device=q.device)
    for i, (count, row) in enumerate(zip(counts, rows)):
        scores[i, :, :count] = row
    return scores.topk(budget, dim=-1).indices


class AttentionMass:
    """Share of the dense attention probability of each query head that falls on the positions
    a request attends (sink, selected blocks, window): 1.0 means the selection lost nothing.
    Summed on the device; read when asked (a read per layer would wait for the device each time)."""

    def __init__(self) -> None:
        self.count = 0
        self._total: torch.Tensor | None = None  # float64, on the device of the queries
        self._minimum: torch.Tensor | None = None

    def add(self, q: torch.Tensor, keys: torch.Tensor, attended: torch.Tensor) -> None:
        """q: [q_heads, dim]; keys: [kv_heads, length, dim] of the whole context in position order;
        attended: [groups, length] bool, groups 1 (shared by every head) or kv_heads."""
        heads, length, dim = keys.shape
        grouped = q.float().view(heads, -1, dim)
        probs = torch.softmax(grouped @ keys.float().transpose(1, 2) / math.sqrt(dim), dim=-1)  # [kv_heads, group, length]
        share = (probs * attended.expand(heads, length)[:, None, :]).sum(dim=-1)
        total, minimum = share.sum().double(), share.min()
        self._total = total if self._total is None else self._total + total
        self._minimum = minimum if self._minimum is None else torch.minimum(self._minimum, minimum)
        self.count += share.numel()

    @property
    def mean(self) -> float | None:
        return self._total.item() / self.count if self.count else None

    @property
    def minimum(self) -> float:
        return min(1.0, self._minimum.item()) if self.count else 1.0
