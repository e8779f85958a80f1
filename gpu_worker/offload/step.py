"""One step of a worker's offloaded requests, layer by layer: their writes, layer-ahead recall,
selection with the true query, recalls and the decode phases attention runs in; with layer
cursors, the cohorts of rows that go on and rows suspended for their recalls."""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from pulseinfer.common.syncs import to_device
from pulseinfer.gpu_worker.batch import DecodePhase, ForwardBatch, PrefillSpan
from pulseinfer.gpu_worker.offload.context import StepContext
from pulseinfer.gpu_worker.offload.layout import OffloadedSeq, context_kv
from pulseinfer.gpu_worker.offload.recall import Recall, RecallQueue
from pulseinfer.gpu_worker.offload.selection import RowSelector, Selection
from pulseinfer.gpu_worker.offload.writes import StepWrites
from pulseinfer.kernels.attention import GatherWorkspace
from pulseinfer.messages.plan import Chunk


class OffloadStep:
    """The offloaded chunks of one step. With layer cursors the rows suspended at a layer and the
    rows that go on are each a cohort of the step (`cohort`): a step of their own over their batch,
    sharing the step's recall queue."""

    def __init__(
        self, ctx: StepContext, seqs: list[OffloadedSeq], chunks: list[Chunk], batch: ForwardBatch, queue: RecallQueue, root: bool
    ):
        self.ctx, self.queue = ctx, queue
        self.root = root  # the step itself, not a cohort of it: counts rows and writes, sets lengths
        self.seqs, self.chunks = seqs, chunks
        self.decode_rows = {s.seq_id: batch.decode_seq_ids.index(s.seq_id) for s in seqs if s.seq_id in batch.decode_seq_ids}
        self.offloaded_rows = list(self.decode_rows.values())  # the order their tables are built in
        resident = [row for row in range(len(batch.decode_seq_ids)) if row not in self.offloaded_rows]
        rows = [torch.tensor(resident, dtype=torch.long), torch.tensor(self.offloaded_rows, dtype=torch.long)]
        resident_rows, decode_index = to_device(rows, batch.input_ids.device)
        self.resident_rows = resident_rows if resident else None
        self.offloaded_index = decode_index if resident else None  # None when they are the whole batch (no indexing then)
        self.by_id = {s.seq_id: s for s in seqs}
        self.writes = StepWrites(seqs, chunks, batch, ctx.geometry, ctx.cache)
        if root:
            for seq, chunk in zip(seqs, chunks):
                seq.length = chunk.end_pos  # layer by layer, the writes make it true before attention reads it
            ctx.counters.written_blocks += self.writes.host_blocks
        decode_seqs = [self.by_id[seq_id] for seq_id in self.decode_rows]  # in row order
        self.selector = RowSelector(decode_seqs, decode_index, ctx)

    def cohort(self, batch: ForwardBatch) -> OffloadStep | None:
        """This step over a cohort's batch (its rows, resident ones aside); None if it has no offloaded chunk."""
        chunks = [c for c in self.chunks if c.seq_id in batch.chunk_starts]
        seqs = [self.by_id[c.seq_id] for c in chunks]
        return OffloadStep(self.ctx, seqs, chunks, batch, self.queue, root=False) if chunks else None

    def finish(self) -> None:
        self.queue.finish()

    # ------------------------------------------------------------ per layer

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.writes.store(layer, self.ctx.cache, self.ctx.view, self.ctx.summaries, k, v)

    @property
    def prefetching(self) -> bool:
        return self.ctx.policy.layer_ahead and bool(self.decode_rows)

    def prefetch(self, layer: int, q: torch.Tensor) -> None:
        """Layer-ahead recall: selects `layer`'s blocks with a predicted query of each decode row
        and starts recalling the misses on the I/O thread; decode_phases(layer) waits for it. The
        prediction fills the hot buffer's whole capacity (room beyond the budget: more of what the
        true query picks is already on its way); the true query's selection never evicts its own blocks."""
        _, recalls = self._select(layer, q, self.ctx.geometry.hot_blocks)
        if recalls:
            self.queue.submit(layer, recalls)
            self.ctx.counters.add(prefetched_units=len(recalls))
            self._count(layer, recalls)

    def decode_phases(self, layer: int, q: torch.Tensor, batch: ForwardBatch) -> Iterator[DecodePhase]:
        """The batch's decode rows for this layer in the order they can attend: resident rows first,
        over their whole context; then the offloaded rows, selected with the true query and recalled,
        over their own (narrower) tables, so no row pays for another's padding. With suspension the
        offloaded rows whose recalls are still in flight wait in a last phase while the others
        attend, and attend once their recalls land; with layer cursors that phase is marked
        suspended: those rows leave the batch at this layer with their tables and attend when they
        resume (unless no row of it could go on: then they wait)."""
        policy = self.ctx.policy
        if not self.offloaded_rows:  # this step's offloaded requests all prefill
            yield from self._resident_phase(batch)
            return
        if policy.deadline_s is not None:
            selection = self._start_recalls(layer, q)
            in_flight = self.queue.settle(layer, time.perf_counter() + policy.deadline_s)
        elif policy.suspend:
            selection, in_flight = self._start_recalls(layer, q), set()
        else:
            selection, in_flight = self._recall_all(layer, q), set()
        tables, lens = self._tables(layer, q, selection, in_flight)
        yield from self._resident_phase(batch)
        waiting = {self.decode_rows[s] for s in self.queue.waiting_seqs(layer) if s in self.decode_rows}
        if not waiting:
            self.land(layer)  # landed already: nothing to wait for
            yield DecodePhase(self.offloaded_index, tables, lens)
            return
        self.ctx.counters.add(suspended_rows=len(waiting))
        ready = [i for i, row in enumerate(self.offloaded_rows) if row not in waiting]
        later = [i for i, row in enumerate(self.offloaded_rows) if row in waiting]
        ready_at, later_at, ready_rows, later_rows = self._index([ready, later], q.device)
        if ready:
            yield DecodePhase(ready_rows, tables[ready_at], lens[ready_at])
        if policy.cursors and (ready or self.resident_rows is not None or batch.prefills):
            suspended = tuple(self.offloaded_rows[i] for i in later)
            yield DecodePhase(later_rows, tables[later_at], lens[later_at], suspended_rows=suspended)
            return
        self.land(layer)
        yield DecodePhase(later_rows, tables[later_at], lens[later_at])

    def _resident_phase(self, batch: ForwardBatch) -> Iterator[DecodePhase]:
        if self.resident_rows is not None:
            rows = self.resident_rows
            yield DecodePhase(rows, batch.decode_block_tables[rows], batch.decode_ctx_lens[rows])

    def resume(self, layer: int) -> None:
        """Counts the layers the cohort resuming at `layer` runs apart, then waits for its recalls."""
        self.ctx.counters.add(resumed_layers=self.ctx.cache.shape.num_layers - layer)
        self.land(layer)

    def land(self, layer: int) -> None:
        """Waits (counted) until the layer's recalls in flight have landed."""
        self.queue.settle(layer, None)

    def _select(self, layer: int, q: torch.Tensor, budget: int) -> tuple[Selection, list[Recall]]:
        self.ctx.faults.check("selection", self.decode_rows)
        return self.selector.select(layer, q, budget)

    def _index(self, groups: list[list[int]], device: torch.device) -> list[torch.Tensor]:
        """Each group of positions among the offloaded rows, then their decode rows, on the device in one copy."""
        rows = [[self.offloaded_rows[i] for i in positions] for positions in groups]
        return to_device([torch.tensor(values, dtype=torch.long) for values in groups + rows], device)

    def _tables(
        self, layer: int, q: torch.Tensor, selection: Selection, in_flight: set[tuple[str, int, int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The offloaded decode rows' tables for this layer, less the selected units a deadline left
        in flight (counted as truncated)."""
        ctx = self.ctx
        if layer == 0 and self.root:
            ctx.counters.decoded_rows += len(self.decode_rows)
        chosen = selection.host  # what the host knows of the selection: no device read
        landed, late = chosen >= 0, None
        if in_flight:
            late = landed & self.selector.units_in(chosen, in_flight)
            landed &= ~late
            ctx.counters.add(truncated_units=int(late.sum()))
        if ctx.mass is not None:
            sink = ctx.geometry.sink_blocks
            for i, (seq, row) in enumerate(zip(self.selector.seqs, self.offloaded_rows)):
                self._measure(layer, q[row], seq, [(c[a] + sink).tolist() for c, a in zip(chosen[i], landed[i])])
        return self.selector.tables(selection, late)

    def _recall_all(self, layer: int, q: torch.Tensor) -> Selection:
        """Every selected block lands before attention: the layer-ahead recall first (the true
        query's misses may take its blocks), then the misses, copied on this thread."""
        self.land(layer)
        selection, recalls = self._select(layer, q, self.ctx.geometry.budget_blocks)
        if recalls:
            self._correct(layer, recalls)
            self.queue.in_line(layer, recalls)
        return selection

    def _start_recalls(self, layer: int, q: torch.Tensor) -> Selection:
        """Selects with the true query; its misses queue behind the layer-ahead recall on the I/O
        thread (so blocks are written in the order they were assigned)."""
        selection, recalls = self._select(layer, q, self.ctx.geometry.budget_blocks)
        if recalls:
            self._correct(layer, recalls)
            self.queue.submit(layer, recalls)
        return selection

    def _correct(self, layer: int, recalls: list[Recall]) -> None:
        self._count(layer, recalls)
        self.ctx.counters.add(corrected_units=len(recalls) if self.ctx.policy.layer_ahead and layer > 0 else 0)

    def _count(self, layer: int, recalls: list[Recall]) -> None:
        view, per_head = self.ctx.view, self.ctx.policy.per_head
        size = len(recalls) * view.unit_bytes // (view.kv_heads if per_head else 1)
        self.ctx.counters.recalled(layer, len(recalls), len(recalls) * (2 if per_head else 1), size)

    def _measure(self, layer: int, q: torch.Tensor, seq: OffloadedSeq, selected: list[list[int]]) -> None:
        """Adds the share of dense attention mass on the attended blocks (evals only)."""
        ctx, g, length = self.ctx, self.ctx.geometry, seq.length
        k, _ = context_kv(seq, layer, ctx.cache, ctx.view, length, ctx.workspace)
        blocks = (length - 1) // g.block_size + 1
        attended = torch.zeros((len(selected), blocks), dtype=torch.bool)
        attended[:, : g.sink_blocks] = True
        attended[:, g.window_start(length) :] = True
        for group, chosen in enumerate(selected):
            attended[group, chosen] = True
        positions = attended.repeat_interleave(g.block_size, dim=1)[:, :length].to(q.device)
        ctx.mass.add(q, k[:length].transpose(0, 1), positions)

    def prefill_context(self, layer: int, span: PrefillSpan, workspace: GatherWorkspace) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of an offloaded request's whole context [0, span.ctx_len), in position order."""
        return context_kv(self.by_id[span.seq_id], layer, self.ctx.cache, self.ctx.view, span.ctx_len, workspace)
