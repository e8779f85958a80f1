"""Selection for a step's offloaded decode rows: each row's top host blocks for a layer's query,
the hot buffers updated (the misses to recall), and the block tables attention reads: sink,
selected and window blocks in logical order."""

from __future__ import annotations

from typing import NamedTuple

import torch

from pulseinfer.common.syncs import to_device, to_host
from pulseinfer.gpu_worker.offload.config import OffloadGeometry
from pulseinfer.gpu_worker.offload.context import StepContext
from pulseinfer.gpu_worker.offload.layout import OffloadedSeq
from pulseinfer.gpu_worker.offload.recall import Recall
from pulseinfer.gpu_worker.sparse import select_blocks

NO_BLOCK = torch.iinfo(torch.long).max  # sorts after every logical block


class Selection(NamedTuple):
    """One layer's selection for a step's offloaded decode rows (in row order): host block indices
    [rows, groups, k], each row's best first (-1: padding), the device block each one is in, and
    the host block indices on the host too (read with the misses)."""

    chosen: torch.Tensor
    devices: torch.Tensor
    host: torch.Tensor


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

    def __init__(self, seqs: list[OffloadedSeq], index: torch.Tensor, ctx: StepContext):
        self.seqs, self.index, self.scorer, self.summaries, self.hot = seqs, index, ctx.scorer, ctx.summaries, ctx.hot
        self.per_head = ctx.policy.per_head
        self.geometry = g = ctx.geometry
        hot_rows = torch.tensor([s.hot_row for s in seqs], dtype=torch.long)
        frame, self.resident_counts = self._frame(seqs, g)
        self.hot_rows, *self.frame, self.slots, self.host_counts = to_device([hot_rows, *frame, *self._slots(seqs, g)], index.device)

    @staticmethod
    def _slots(seqs: list[OffloadedSeq], g: OffloadGeometry) -> tuple[torch.Tensor, torch.Tensor]:
        """What each row selects from, at every layer of the step: the summary slots of its host blocks
        before the window [rows, width] (padded with slot 0; at least as wide as the hot buffer, the
        widest selection), and how many there are."""
        counts = [g.window_start(seq.length) - g.sink_blocks for seq in seqs]
        width = max([g.hot_blocks, *counts])
        table = [seq.summary_slots[:n] + [0] * (width - n) for seq, n in zip(seqs, counts)]
        return torch.tensor(table, dtype=torch.long).view(len(seqs), width), torch.tensor(counts, dtype=torch.long)

    @staticmethod
    def _frame(seqs: list[OffloadedSeq], g: OffloadGeometry) -> tuple[list[torch.Tensor], torch.Tensor]:
        """What each row attends besides its selection, at its new length: its sink and window
        blocks [rows, width] (padded with its first block), their logical blocks (padded with
        NO_BLOCK), and the tokens of its last block; and how many blocks that is per row."""
        rows = [seq.resident_blocks() for seq in seqs]
        width = max(map(len, rows), default=0)
        padded = [row + [(NO_BLOCK, row[0][1])] * (width - len(row)) for row in rows]
        logical, blocks = (torch.tensor([[pair[i] for pair in row] for row in padded], dtype=torch.long) for i in (0, 1))
        last_tokens = torch.tensor([(seq.length - 1) % g.block_size + 1 for seq in seqs], dtype=torch.long)
        counts = torch.tensor([len(row) for row in rows], dtype=torch.long)
        return [blocks.view(len(rows), width), logical.view(len(rows), width), last_tokens], counts

    def select(self, layer: int, q: torch.Tensor, budget: int) -> tuple[Selection, list[Recall]]:
        """Each row's top-`budget` host blocks for the decode rows' queries q, the hot buffers
        updated: the selection, and its misses.

        This reads the device once: on CUDA a selection's one host sync, so one per layer and step
        (two with layer-ahead recall, whose predicted query selects too; one more per cohort of
        suspended rows). It stays because recalls are driven from the host: the misses become
        Recall lists (request, logical block, head, host block, device block) that the I/O thread
        copies by (recall.py) or that go to the kv_store's I/O engine over ZMQ, and a deadline's
        units in flight and the suspended rows are known by them. Removing it needs a recall kernel
        that takes the selection's device-side misses (and each request's host blocks on the
        device) and that bookkeeping on the device: a redesign, not a fix."""
        chosen = select_blocks(self.scorer, layer, q[self.index], self.summaries, self.slots, self.host_counts, budget, self.per_head)
        devices, missed = self.hot.update(self.hot_rows, layer, chosen)
        host, host_devices, host_missed = to_host([chosen, devices, missed])
        return Selection(chosen, devices, host), self._misses(host, host_devices, host_missed)

    def _misses(self, chosen: torch.Tensor, devices: torch.Tensor, missed: torch.Tensor) -> list[Recall]:
        """The recalls of the misses, best first (on the host)."""
        row, group, k = by_rank(missed)
        units = torch.stack((row, group, chosen[row, group, k], devices[row, group, k])).T.tolist()
        sink, seqs = self.geometry.sink_blocks, self.seqs
        return [Recall(seqs[r].seq_id, sink + j, h, seqs[r].host_blocks[j], dev) for r, h, j, dev in units]

    def tables(self, selection: Selection, late: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' blocks (in row order) and context lengths: sink, the selected blocks and
        window, in logical order; less the `late` selected blocks (a host mask [rows, groups, k]: a
        deadline left them in flight). The tables' width comes from the host's copy of the selection."""
        g = self.geometry
        chosen, devices, host = selection
        landed = host >= 0 if late is None else (host >= 0) & ~late
        width = int((self.resident_counts[:, None] + landed.sum(dim=-1)).max())
        landed_at = chosen >= 0 if late is None else (chosen >= 0) & ~to_device([late], chosen.device)[0]
        groups = chosen.shape[1]
        resident, resident_logical, last_tokens = self.frame
        selected = (chosen + g.sink_blocks).masked_fill_(~landed_at, NO_BLOCK)
        logical = torch.cat((resident_logical[:, None].expand(-1, groups, -1), selected), dim=-1)
        logical, order = logical.sort(dim=-1)  # the attended blocks in logical order, then the rest
        attended = logical != NO_BLOCK
        blocks = torch.cat((resident[:, None].expand(-1, groups, -1), devices), dim=-1).gather(-1, order[..., :width])
        table = torch.where(attended[..., :width], blocks, resident[:, :1, None])  # padding repeats the row's first block
        lens = (attended[:, 0].sum(dim=-1) - 1) * g.block_size + last_tokens
        return (table if self.per_head else table[:, 0]), lens

    def units_in(self, chosen: torch.Tensor, units: set[tuple[str, int, int]]) -> torch.Tensor:
        """Which chosen blocks [rows, groups, k] (on the host) are among the (request, group, logical block) units."""
        rows, groups, _ = chosen.shape
        position = {seq.seq_id: i for i, seq in enumerate(self.seqs)}
        span = max(len(seq.host_blocks) for seq in self.seqs) + 1
        sink = self.geometry.sink_blocks
        keys = [(position[seq_id] * groups + group) * span + logical - sink for seq_id, group, logical in units if seq_id in position]
        index = (torch.arange(rows * groups).view(rows, groups, 1) * span) + chosen
        return torch.isin(index, torch.tensor(keys, dtype=torch.long))
