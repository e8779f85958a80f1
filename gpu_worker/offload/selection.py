"""Selection for a step's offloaded decode rows: each row's top host blocks for a layer's query,
the hot buffers updated (the misses to recall), and the block tables attention reads: sink,
selected and window blocks in logical order."""

from __future__ import annotations

from typing import NamedTuple

import torch

from pulseinfer.gpu_worker.offload.config import OffloadGeometry
from pulseinfer.gpu_worker.offload.hot import HotBuffers
from pulseinfer.gpu_worker.offload.layout import OffloadedSeq
from pulseinfer.gpu_worker.offload.recall import Recall
from pulseinfer.gpu_worker.sparse import Scorer, select_blocks

NO_BLOCK = torch.iinfo(torch.long).max  # sorts after every logical block


class Selection(NamedTuple):
    """One layer's selection for a step's offloaded decode rows (in row order): host block indices
    [rows, groups, k], each row's best first (-1: padding), and the device block each one is in."""

    chosen: torch.Tensor
    devices: torch.Tensor


def by_rank(missed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (row, group, k) positions of the misses [rows, groups, k] by rank across the batch:
    every (row, group)'s first miss, then every second one, ...: a batch's recalls best first
    across its rows (and a row's heads), so a deadline cuts the lowest-ranked blocks."""
    rows, groups, _ = missed.shape
    row, group, k = missed.nonzero(as_tuple=True)
    rank = missed.cumsum(dim=-1)[row, group, k]  # 1 for a (row, group)'s first miss
    order = ((rank * groups + group) * rows + row).argsort()
    return row[order], group[order], k[order]


class RowSelector:
    """Selects for offloaded decode rows `seqs` (at their new lengths) and builds their tables.
    `index`: their rows among the batch's decode rows."""

    def __init__(
        self, seqs: list[OffloadedSeq], index: torch.Tensor, geometry: OffloadGeometry, scorer: Scorer, hot: HotBuffers, per_head: bool
    ):
        self.seqs, self.index, self.scorer, self.hot, self.per_head = seqs, index, scorer, hot, per_head
        self.geometry = g = geometry
        self.hot_rows = torch.tensor([s.hot_row for s in seqs], dtype=torch.long, device=index.device)
        # what each row selects from, at every layer of the step: its host blocks before the window
        self.host_counts = [g.window_start(seq.length) - g.sink_blocks for seq in seqs]
        self.summaries = [seq.summaries for seq in seqs]
        self.frame = self._frame(seqs, g, index.device)

    @staticmethod
    def _frame(seqs: list[OffloadedSeq], g: OffloadGeometry, device: torch.device) -> tuple[torch.Tensor, ...]:
        """What each row attends besides its selection, at its new length: its sink and window
        blocks [rows, width] (padded with its first block), their logical blocks (padded with
        NO_BLOCK), and the tokens of its last block."""
        rows = [seq.resident_blocks() for seq in seqs]
        width = max(map(len, rows), default=0)
        padded = [row + [(NO_BLOCK, row[0][1])] * (width - len(row)) for row in rows]
        logical, blocks = (torch.tensor([[pair[i] for pair in row] for row in padded], dtype=torch.long, device=device) for i in (0, 1))
        last_tokens = torch.tensor([(seq.length - 1) % g.block_size + 1 for seq in seqs], dtype=torch.long, device=device)
        return blocks.view(len(rows), width), logical.view(len(rows), width), last_tokens

    def select(self, layer: int, q: torch.Tensor, budget: int) -> tuple[Selection, list[Recall]]:
        """Each row's top-`budget` host blocks for the decode rows' queries q, the hot buffers
        updated: the selection, and its misses."""
        chosen = select_blocks(self.scorer, layer, q[self.index], self.summaries, self.host_counts, budget, self.per_head)
        devices, missed = self.hot.update(self.hot_rows, layer, chosen)
        return Selection(chosen, devices), self._misses(chosen, devices, missed)

    def _misses(self, chosen: torch.Tensor, devices: torch.Tensor, missed: torch.Tensor) -> list[Recall]:
        row, group, k = by_rank(missed)
        units = torch.stack((row, group, chosen[row, group, k], devices[row, group, k])).T.tolist()
        sink, seqs = self.geometry.sink_blocks, self.seqs
        return [Recall(seqs[r].seq_id, sink + j, h, seqs[r].host_blocks[j], dev) for r, h, j, dev in units]

    def tables(self, selection: Selection, landed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' blocks (in row order) and context lengths: sink, the `landed` selected
        blocks and window, in logical order."""
        g = self.geometry
        chosen, devices = selection
        groups = chosen.shape[1]
        resident, resident_logical, last_tokens = self.frame
        selected = (chosen + g.sink_blocks).masked_fill_(~landed, NO_BLOCK)
        logical = torch.cat((resident_logical[:, None].expand(-1, groups, -1), selected), dim=-1)
        logical, order = logical.sort(dim=-1)  # the attended blocks in logical order, then the rest
        attended = logical != NO_BLOCK
        count = attended.sum(dim=-1)  # [rows, groups]
        width = int(count.max())
        blocks = torch.cat((resident[:, None].expand(-1, groups, -1), devices), dim=-1).gather(-1, order[..., :width])
        table = torch.where(attended[..., :width], blocks, resident[:, :1, None])  # padding repeats the row's first block
        lens = (count[:, 0] - 1) * g.block_size + last_tokens
        return (table if self.per_head else table[:, 0]), lens

    def units_in(self, chosen: torch.Tensor, units: set[tuple[str, int, int]]) -> torch.Tensor:
        """Which chosen blocks [rows, groups, k] are among the (request, group, logical block) units."""
        rows, groups, _ = chosen.shape
        position = {seq.seq_id: i for i, seq in enumerate(self.seqs)}
        span = max(len(seq.host_blocks) for seq in self.seqs) + 1
        sink = self.geometry.sink_blocks
        keys = [(position[seq_id] * groups + group) * span + logical - sink for seq_id, group, logical in units if seq_id in position]
        index = (torch.arange(rows * groups, device=chosen.device).view(rows, groups, 1) * span) + chosen
        return torch.isin(index, torch.tensor(keys, dtype=torch.long, device=chosen.device))
