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

    def scores(
        self, layer: int, q: torch.Tensor, summaries: Sequence[torch.Tensor], table: torch.Tensor, valid: torch.Tensor, per_head: bool
    ) -> torch.Tensor:
        kmin, kmax = summaries
        return quest_scores(quest_weights(q, self.kv_heads), kmin, kmax, table, per_head)


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

    def scores(
        self, layer: int, q: torch.Tensor, summaries: Sequence[torch.Tensor], table: torch.Tensor, valid: torch.Tensor, per_head: bool
    ) -> torch.Tensor:
        (keys,) = summaries
        return lowrank_scores(q, self.bases[layer], keys, table, valid, per_head)


Scorer = QuestScorer | LowRankScorer
BLOCKS = -1  # in a scorer's summary shapes: the dimension that counts host blocks
SCORERS = ("lowrank", "quest")
FIRST_SLOTS = 16  # a pool's first size: a padded slot table always names a slot that exists


class SummaryPool:
    """Every offloaded request's key summaries on this worker, one tensor per summary part
    ([layers, ...], a slot where the scorer's shapes say BLOCKS), in the KV cache's dtype: a
    request holds one slot per host block, and a step's selection reads all its rows' summaries
    through one slot table, so a layer scores the whole batch in one pass. Kept on the device, so
    selection never reads host keys."""

    def __init__(self, num_layers: int, scorer: Scorer, block_size: int, dtype: torch.dtype, device: torch.device):
        self.scorer = scorer
        shapes = scorer.shapes(block_size)
        self.dims = [shape.index(BLOCKS) for shape in shapes]  # within a layer's part
        self.parts = [torch.empty((num_layers, *(0 if d == BLOCKS else d for d in shape)), dtype=dtype, device=device) for shape in shapes]
        self.free: list[int] = []  # taken from the end
        self._grow(FIRST_SLOTS)

    @property
    def capacity(self) -> int:
        return self.parts[0].shape[1 + self.dims[0]]

    def allocate(self, count: int) -> list[int]:
        """`count` free slots (grown by doubling when short: between steps, never inside one)."""
        if count <= 0:
            return []
        if count > len(self.free):
            self._grow(max(count - len(self.free), self.capacity))
        taken = self.free[-count:][::-1]
        del self.free[-count:]
        return taken

    def release(self, slots: Sequence[int]) -> None:
        self.free.extend(slots)

    def _grow(self, extra: int) -> None:
        have = self.capacity
        for i, (old, dim) in enumerate(zip(self.parts, self.dims)):
            grown = list(old.shape)
            grown[1 + dim] = have + extra
            self.parts[i] = old.new_empty(grown)
            self.parts[i].narrow(1 + dim, 0, have).copy_(old)
        self.free = list(range(have + extra - 1, have - 1, -1)) + self.free

    def write(self, layer: int, slots: torch.Tensor, k_blocks: torch.Tensor) -> None:
        """k_blocks: [n, block_size, kv_heads, dim] summarized into `slots` [n] (on the device)."""
        for part, dim, summary in zip(self.parts, self.dims, self.scorer.summarize(layer, k_blocks)):
            part[layer].index_copy_(dim, slots, summary.to(part.dtype))

    def at(self, layer: int) -> tuple[torch.Tensor, ...]:
        """Every slot's summaries at `layer`."""
        return tuple(part[layer] for part in self.parts)

    def of(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The summaries of `slots` at `layer`, as the scorer's summarize gives them."""
        return tuple(part[layer].index_select(dim, slots) for part, dim in zip(self.parts, self.dims))


def select_blocks(
    scorer: Scorer, layer: int, q: torch.Tensor, pool: SummaryPool, table: torch.Tensor, counts: torch.Tensor, budget: int, per_head: bool
) -> torch.Tensor:
    """For each decode row, the top-`budget` of its `counts[row]` host blocks by the scorer's
    estimate for its query at `layer`: one set for all heads when not `per_head` (SoloHead), else
    one per kv head. q: [rows, q_heads, dim]; table: [rows, width >= budget] each row's summary
    slots of its host blocks in order (padded with any slot); counts: [rows], on the device.
    Returns host block indices [rows, groups (1 or kv_heads), budget], highest score first
    (recalls go in that order, so a deadline cuts the least promising blocks); a row with no more
    host blocks than the budget takes them all, in order, padded with -1. One scoring pass and one
    top-k for the whole batch, whatever its rows' lengths: no per-row work."""
    position = torch.arange(table.shape[1], device=table.device)
    valid = position < counts[:, None]
    scores = scorer.scores(layer, q, pool.at(layer), table, valid, per_head)
    top = scores.masked_fill_(~valid[:, None, :], float("-inf")).topk(budget, dim=-1).indices
    every = position[:budget].expand_as(top).masked_fill(~valid[:, None, :budget], -1)
    return torch.where((counts > budget)[:, None, None], top, every)


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
