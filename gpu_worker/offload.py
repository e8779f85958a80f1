"""Offloaded requests on the worker.

An offloaded request holds a fixed device footprint: sink blocks (the first tokens), a ring of
recent-window blocks (the partly filled block included) and a hot buffer of recalled blocks.
Every other full block lives in the host pool. Each block is written back once, when it fills
(earlier than it leaves the window, so the write has a window's worth of steps to complete);
its key summary (low-rank keys, or min and max per kv head: --scorer) stays on device for selection.

Decode attends sink + selected host blocks + window, in logical order: with a budget that
covers every host block the attended K/V are the dense ones, bit for bit, in the dense order.
Prefill of an offloaded request attends its whole context (read back from the host pool).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass, replace
from typing import NamedTuple, Protocol, TypeVar

import torch

from pulseinfer.gpu_worker.batch import ForwardBatch, PrefillSpan
from pulseinfer.gpu_worker.kv_cache import PagedKVCache
from pulseinfer.gpu_worker.sparse import SCORERS, AttentionMass, BlockSummaries, Scorer, select_blocks
from pulseinfer.kernels.attention import GatherWorkspace
from pulseinfer.kernels.gather_scatter import recall
from pulseinfer.kv_store.allocator import PoolExhausted
from pulseinfer.kv_store.client import HostPoolLost, KVStoreUnavailable, RemoteRecall
from pulseinfer.kv_store.view import PoolView
from pulseinfer.scheduler.plan import RECALL_FIELDS, RecallStats, StepPlan


class HostAllocator(Protocol):
    """kv_store's BlockAllocator in-process, or KVStoreClient across processes."""

    def allocate(self, owner: str, count: int) -> list[int]: ...

    def release(self, owner: str) -> int: ...


@dataclass(frozen=True)
class HostTier:
    """The host pool as a worker uses it: a mapping for the data, an allocator for the blocks."""

    view: PoolView
    allocator: HostAllocator
    reattach: Callable[[], PoolView] | None = None  # maps a restarted kv_store's new pool; None in-process
    # opens the worker's (shared-memory) cache as a target of the kv_store's I/O engine, which then
    # does the recalls; None: the worker's own I/O thread copies from its mapping of the pool
    recall_engine: Callable[[PagedKVCache], RemoteRecall] | None = None
    lost: Callable[[], bool] | None = None  # whether the kv_store process went away since the last call


LAYER_AHEAD = ("auto", "on", "off")
SUSPEND = ("off", "layer", "cursor")
RECALL_PARTS = 8  # with a recall deadline: each layer's gather in this many parts, landing in score order


@dataclass(frozen=True)
class OffloadConfig:
    sink: int = 64  # tokens at the start of the context, always attended, kept on device
    recent: int = 256  # recent window kept on device (the partly filled block included)
    budget: int = 1024  # host-tier tokens selected per (request, layer)
    # hot-buffer tokens beyond the budget: blocks selected at earlier steps (or prefetched and
    # then not selected) stay on device until evicted, least recently selected first, so fewer
    # are recalled again; the same blocks are attended. Costs this much device KV per offloaded request
    hot_extra: int = 0
    # what selection scores host blocks by (gpu_worker/sparse.py): lowrank, each block's keys
    # projected on --key-rank principal directions of the layer's keys (a calibration pass at
    # start) and scored by the attention they draw; quest, the Quest bound of each block's min/max
    # keys per kv head (+4.3% perplexity over dense at budget 1024 where lowrank is about +1%,
    # docs/accuracy.md; half lowrank's device memory at rank 16)
    scorer: str = "lowrank"
    key_rank: int = 16
    calibration_tokens: int = 2048  # tokens of the calibration text the lowrank basis is fitted on
    # recall layer l+1's blocks on the I/O thread while layer l computes, selected with a predicted
    # query; the true query's selection then recalls only what the prediction missed. auto: on
    # CUDA, where the copies overlap compute on the copy engine; off on CPU, where they would take
    # the compute's own cores and the second selection per layer costs more than it hides
    # (docs/decode.md); on | off
    layer_ahead: str = "auto"
    # one gather of all of a layer's missed units and one scatter; off (an ablation): one copy per unit
    gather: bool = True
    # wait at most this long per layer for its recalls, then attend over the selected blocks that
    # have landed (the rest are counted as truncated and land before the step ends); unset: wait
    # for every recall. Pulse mode only: a head-wise row cannot drop blocks of some heads alone.
    # On CUDA a part has "landed" once queued on the stream ahead of attention: nothing is cut
    recall_deadline_ms: float | None = None
    # a decode row whose recalls are still in flight at a layer is suspended there (the misses
    # then copy on the I/O thread, not in line): `layer`, it waits while the batch's other rows
    # attend, then attends, and every row finishes the layer before any starts the next; `cursor`,
    # each row keeps a layer cursor: the others go on through the later layers, and the suspended
    # rows resume from their layer after them, as a batch of their own. Pulse mode only, the
    # head-wise baseline recalls synchronously; no effect with a recall deadline (it never waits
    # past it). Off by default: on the CPU nearly every row misses a block at every layer, so few
    # rows can go ahead and the hand-off to the I/O thread made the wait longer (docs/benchmarks.md)
    suspend: str = "off"
    # evals: on each decode step also compute dense attention over the whole context, to report
    # the share of its mass the selection keeps (reads every host block: slow)
    measure_attention_mass: bool = False

    def __post_init__(self) -> None:
        if self.scorer not in SCORERS:
            raise ValueError(f"--scorer must be one of {', '.join(SCORERS)}, got {self.scorer!r}")
        if self.key_rank < 1 or self.calibration_tokens < 1:
            raise ValueError(f"--key-rank and --calibration-tokens must be >= 1, got {self.key_rank} and {self.calibration_tokens}")
        if self.layer_ahead not in LAYER_AHEAD:
            raise ValueError(f"--layer-ahead must be one of {', '.join(LAYER_AHEAD)}, got {self.layer_ahead!r}")
        if self.suspend not in SUSPEND:
            raise ValueError(f"--suspend must be one of {', '.join(SUSPEND)}, got {self.suspend!r}")
        if self.recall_deadline_ms is not None and not self.recall_deadline_ms >= 0:
            raise ValueError(f"--recall-deadline-ms must be >= 0, got {self.recall_deadline_ms}")

    @property
    def recall_deadline_s(self) -> float | None:
        return None if self.recall_deadline_ms is None else self.recall_deadline_ms / 1e3

    def layer_ahead_on(self, device: torch.device) -> bool:
        return self.layer_ahead == "on" or (self.layer_ahead == "auto" and device.type == "cuda")

    def geometry(self, block_size: int) -> OffloadGeometry:
        for name, low in (("sink", 0), ("recent", block_size), ("budget", block_size), ("hot_extra", 0)):
            value = getattr(self, name)
            if value < low or value % block_size:
                flag = name.replace("_", "-")
                raise ValueError(f"--{flag} must be a multiple of the block size ({block_size}) and at least {low}, got {value}")
        budget_blocks = self.budget // block_size
        return OffloadGeometry(
            block_size, self.sink // block_size, self.recent // block_size, budget_blocks, budget_blocks + self.hot_extra // block_size
        )


@dataclass(frozen=True)
class OffloadGeometry:
    block_size: int
    sink_blocks: int
    ring_blocks: int
    budget_blocks: int  # host blocks selected per (request, layer)
    hot_blocks: int  # the hot buffer's capacity: at least the budget

    @property
    def device_blocks(self) -> int:
        """The device footprint of one offloaded request, whatever its length."""
        return self.sink_blocks + self.ring_blocks + self.hot_blocks

    def window_start(self, length: int) -> int:
        """First logical block of the recent window of a context of `length` tokens."""
        last = (length - 1) // self.block_size
        return max(self.sink_blocks, last - self.ring_blocks + 1)


T = TypeVar("T")


class DecodePhase(NamedTuple):
    """Decode rows that attend together at a layer, over their block tables."""

    rows: torch.Tensor | None  # None: every decode row of the batch
    tables: torch.Tensor  # [rows, max_blocks], or [rows, kv_heads, max_blocks] in headwise mode
    lens: torch.Tensor
    suspended: bool = False  # layer cursors: the rows leave the batch here and attend when they resume


class Recall(NamedTuple):
    """One missed unit: logical block `logical` of request `seq_id` (kv head `group` in headwise
    mode), from host block `host` into device block `device`."""

    seq_id: str
    logical: int
    group: int
    host: int
    device: int


def by_rank(missed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (row, group, k) positions of the misses [rows, groups, k] by rank across the batch:
    every (row, group)'s first miss, then every second one, ...: a batch's recalls best first
    across its rows (and a row's heads), so a deadline cuts the lowest-ranked blocks."""
    rows, groups, _ = missed.shape
    row, group, k = missed.nonzero(as_tuple=True)
    rank = missed.cumsum(dim=-1)[row, group, k]  # 1 for a (row, group)'s first miss
    order = ((rank * groups + group) * rows + row).argsort()
    return row[order], group[order], k[order]


NO_BLOCK = torch.iinfo(torch.long).max  # sorts after every logical block


class Selection(NamedTuple):
    """One layer's selection for a step's offloaded decode rows (in row order): host block indices
    [rows, groups, k], each row's best first (-1: padding), and the device block each one is in."""

    chosen: torch.Tensor
    devices: torch.Tensor


class RecallJob:
    """Recalls of one layer on the I/O thread, in score order; `landed` counts the leading units
    whose copy has completed, so a deadline can attend over those and leave the rest."""

    def __init__(self, units: list[Recall]):
        self.units = units
        self.landed = 0
        self.future: Future | None = None

    def in_flight(self) -> set[tuple[str, int, int]]:
        return {(u.seq_id, u.group, u.logical) for u in self.units[self.landed :]}


class OffloadedSeq:
    """One offloaded request's KV on this worker: where each logical block lives (the hot buffer's
    blocks: row `hot_row` of the worker's HotBuffers)."""

    def __init__(self, seq_id: str, footprint: tuple[int, ...], geometry: OffloadGeometry, summaries: BlockSummaries, hot_row: int):
        g = geometry
        self.seq_id = seq_id
        self.footprint = footprint
        self.geometry = geometry
        self.sink = footprint[: g.sink_blocks]
        self.ring = footprint[g.sink_blocks : g.sink_blocks + g.ring_blocks]
        self.length = 0  # tokens whose KV is stored
        self.host_blocks: list[int] = []  # host block of logical block sink_blocks + i
        self.summaries = summaries
        self.hot_row = hot_row

    def device_block(self, logical: int, length: int) -> int:
        """The device block of a sink or window block of a context of `length` tokens."""
        if logical < self.geometry.sink_blocks:
            return self.sink[logical]
        if logical >= self.geometry.window_start(length):
            return self.ring[logical % self.geometry.ring_blocks]
        raise KeyError(f"logical block {logical} of {self.seq_id} is in the host tier")

    def resident_blocks(self) -> list[tuple[int, int]]:
        """(logical block, device block) of the sink and of the recent window attended at the current
        length, in logical order: what a decode row attends besides its selected host blocks."""
        length, g = self.length, self.geometry
        sink = range(min(g.sink_blocks, (length - 1) // g.block_size + 1))
        return [(j, self.sink[j]) for j in sink] + [(j, self.ring[j % g.ring_blocks]) for j in self.window(length)]

    def window(self, length: int) -> range:
        """Logical blocks of the recent window of a context of `length` tokens."""
        last = (length - 1) // self.geometry.block_size
        return range(self.geometry.window_start(length), last + 1) if last >= self.geometry.sink_blocks else range(0)


class HotBuffers:
    """The hot buffers of every offloaded request on this worker as tensors, one row per request,
    so a layer's selections for the whole batch update in a few tensor ops, with no Python per
    block: per (layer, selection group), the host block each hot device block holds (-1: none yet)
    and when it was last selected. One group of all kv heads in `pulse` mode, one per kv head in
    `headwise` mode (head h of a hot device block then holds whichever block head h selected).
    LRU: the selected blocks present become the most recently used, in selection order, so the
    blocks outside the selection are the least; the misses take the unused device blocks (in
    footprint order), then the least recently used ones."""

    def __init__(self, num_layers: int, groups: int, geometry: OffloadGeometry, device: torch.device):
        self.capacity = geometry.hot_blocks
        # one column more than the capacity: a selection's padding writes there, and it is never read
        self.shape = (num_layers, groups, self.capacity + 1)
        self.hot_start = geometry.sink_blocks + geometry.ring_blocks  # a footprint's first hot block
        self.held = torch.empty((0, *self.shape), dtype=torch.long, device=device)
        self.stamps = torch.empty_like(self.held)
        self.devices = torch.empty((0, self.capacity + 1), dtype=torch.long, device=device)  # each row's hot device blocks
        self.free: list[int] = []
        self.clock = 0  # every update's stamps exceed the earlier ones'

    def add(self, footprint: tuple[int, ...]) -> int:
        """A row for a new offloaded request, its hot buffer empty."""
        if not self.free:
            have = self.held.shape[0]
            grow = max(have, 4)
            grown = [torch.cat((t, t.new_empty((grow, *t.shape[1:])))) for t in (self.held, self.stamps, self.devices)]
            self.held, self.stamps, self.devices = grown
            self.free = list(range(have + grow - 1, have - 1, -1))
        row, hot = self.free.pop(), footprint[self.hot_start :]
        self.held[row] = -1
        self.stamps[row] = torch.arange(-self.capacity - 1, 0)  # unused blocks: older than any selection, in footprint order
        self.devices[row] = torch.tensor((*hot, hot[0]))  # the spare column: a block of the row's own
        return row

    def remove(self, row: int) -> None:
        self.free.append(row)

    def update(self, rows: torch.Tensor, layer: int, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Makes the chosen host blocks [len(rows), groups, k] (best first, -1 padding; k at most
        the capacity) the most recently used of the rows' hot buffers at `layer`. Returns the device
        block of each chosen block (padding: one of the row's) and which of them missed (their
        device block is to be filled)."""
        held, stamps = self.held[rows, layer], self.stamps[rows, layer]  # [rows, groups, capacity + 1]
        capacity, k = self.capacity, chosen.shape[-1]
        valid = chosen >= 0
        ordered, holder = held[..., :capacity].sort(dim=-1)  # each chosen block's holder by binary search
        at = torch.searchsorted(ordered, chosen).clamp_(max=capacity - 1)
        hit = (ordered.gather(-1, at) == chosen) & valid
        missed = valid & ~hit
        order = missed.cumsum(dim=-1).sub_(1)  # each miss's rank among its group's misses
        # the hits in selection order, then the misses; every stamp of this update after every earlier one
        recency = torch.where(missed, order + k, torch.arange(k, device=chosen.device)).add_(self.clock)
        self.clock += 2 * k
        slots = torch.where(hit, holder.gather(-1, at), capacity)  # capacity: the spare column
        stamps.scatter_(-1, slots, recency)  # the hits are now the newest: the oldest blocks are the others
        victims = stamps[..., :capacity].argsort(dim=-1)
        slots = torch.where(missed, victims.gather(-1, order.clamp_(min=0)), slots)
        self.held[rows, layer] = held.scatter_(-1, slots, chosen)
        self.stamps[rows, layer] = stamps.scatter_(-1, slots, recency)
        return self.devices[rows][:, None, :].expand(-1, slots.shape[1], -1).gather(-1, slots), missed


class OffloadManager:
    """The worker's offloaded requests: their states, host blocks and per-step plumbing."""

    def __init__(self, config: OffloadConfig, cache: PagedKVCache, host: HostTier, scorer: Scorer, per_head: bool = False):
        self.scorer = scorer
        self.geometry = config.geometry(cache.spec.block_size)
        self.layer_ahead = config.layer_ahead_on(cache.k.device)
        self.gather = config.gather
        if per_head and config.recall_deadline_ms is not None:
            raise ValueError("--recall-deadline-ms needs --mode pulse (head-wise recalls are synchronous)")
        self.deadline_s = config.recall_deadline_s
        self.suspend = config.suspend != "off" and not per_head
        self.cursors = config.suspend == "cursor" and not per_head
        self.num_layers = cache.shape.num_layers
        self.view = host.view
        self.allocator = host.allocator
        self.reattach = host.reattach
        self.cache = cache
        self.recall_engine = host.recall_engine
        self.remote = host.recall_engine(cache) if host.recall_engine is not None else None
        self.per_head = per_head  # headwise: one selection per kv head, recalls per (block, head)
        self.mass = AttentionMass() if config.measure_attention_mass else None
        # the I/O engine of this worker: one thread, so recalls run while the compute thread goes on
        self.io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pulseinfer-io")
        self.workspace = GatherWorkspace()  # the attention-mass measurement's context gathers
        self.seqs: dict[str, OffloadedSeq] = {}
        self.hot = HotBuffers(self.num_layers, scorer.kv_heads if per_head else 1, self.geometry, cache.k.device)
        self.decoded_rows = 0  # offloaded (request, step) decodes
        # RecallStats summed since start, as plain counters: both threads add to them, under the lock,
        # several times a layer (a RecallStats built and summed per call cost ~2 ms a decode step)
        self._recalled = dict.fromkeys(RECALL_FIELDS, 0)
        self._recall_lock = threading.Lock()
        self.recall_bytes_by_layer = [0] * self.num_layers
        self.written_blocks = 0

    def close(self) -> None:
        self.io.shutdown()
        if self.remote is not None:
            self.remote.close()

    def add_recall(self, **counts: float) -> None:
        with self._recall_lock:
            for name, count in counts.items():
                self._recalled[name] += count

    @property
    def recall(self) -> RecallStats:
        with self._recall_lock:
            return RecallStats(**self._recalled)

    def release_all(self) -> None:
        """Frees every offloaded request's state and host blocks: the scheduler that planned them is gone."""
        self.release(list(self.seqs))

    def detach(self) -> None:
        """The kv_store died: every offloaded request's KV went with its pool. Drops their states and
        unmaps the pool now (it holds the dead pool's memory); the next offloaded request maps the
        new one. Between steps only: a step in flight reads the mapping."""
        self._drop_seqs()
        if self.view is not None:
            self.view.close()
            self.view = None
        if self.remote is not None:
            self.remote.close()
            self.remote = None

    def _drop_seqs(self) -> None:
        for seq in self.seqs.values():
            self.hot.remove(seq.hot_row)
        self.seqs.clear()

    def release(self, seq_ids: tuple[str, ...] | list[str]) -> None:
        for seq_id in seq_ids:
            seq = self.seqs.pop(seq_id, None)
            if seq is None:
                continue
            self.hot.remove(seq.hot_row)
            try:
                self.allocator.release(seq_id)
            except (HostPoolLost, KVStoreUnavailable):
                pass  # a store that restarted or died holds none of these blocks any more

    def admit(self, plan: StepPlan) -> tuple[StepPlan, dict[str, str]]:
        """Frees what the plan released, then readies each offloaded chunk's state and host
        blocks. Chunks that cannot run are dropped from the plan and returned with the reason."""
        self.release(plan.released)
        failed: dict[str, str] = {}
        kept = []
        for chunk in plan.chunks:
            if not chunk.offloaded:
                kept.append(chunk)
                continue
            try:
                self._ready_or_reattach(chunk)
                kept.append(chunk)
            except (PoolExhausted, KVStoreUnavailable, HostPoolLost, ValueError) as e:
                failed[chunk.seq_id] = str(e)
        lost = [c for c in kept if c.offloaded and c.seq_id not in self.seqs]  # readied, then dropped by a pool loss
        failed.update({c.seq_id: f"request {c.seq_id}: its offloaded KV was lost when the kv_store restarted" for c in lost})
        return replace(plan, chunks=tuple(c for c in kept if c not in lost)), failed

    def _ready_or_reattach(self, chunk) -> None:
        """A new request that finds the kv_store restarted maps the new pool and goes on; the
        requests whose KV was in the old pool are dropped (and fail)."""
        args = (chunk.seq_id, chunk.block_table, chunk.start_pos, chunk.end_pos)
        try:
            if self.view is None:  # detached from a dead kv_store
                raise HostPoolLost("the kv_store restarted")
            self._ready(*args)
        except HostPoolLost:
            self._drop_seqs()
            if self.reattach is None:
                raise
            self.detach()
            self.view = self.reattach()
            if self.recall_engine is not None:
                self.remote = self.recall_engine(self.cache)
            if chunk.start_pos != 0:
                raise
            self._ready(*args)

    def _ready(self, seq_id: str, footprint: tuple[int, ...], start: int, end: int) -> None:
        g = self.geometry
        seq = self.seqs.get(seq_id)
        if seq is None:
            if start != 0:
                raise ValueError(f"request {seq_id}: its offloaded KV is gone from this worker (the kv_store restarted)")
            if len(footprint) != g.device_blocks:
                raise ValueError(f"request {seq_id}: {len(footprint)} device blocks for an offloaded request, expected {g.device_blocks}")
            summaries = BlockSummaries(self.num_layers, self.scorer, g.block_size, self.cache.k.device)
            seq = self.seqs[seq_id] = OffloadedSeq(seq_id, tuple(footprint), g, summaries, self.hot.add(tuple(footprint)))
        if seq.length != start or seq.footprint != tuple(footprint):
            raise ValueError(f"request {seq_id}: the plan (position {start}) disagrees with the worker's state ({seq.length} tokens)")
        hosted = max(0, end // g.block_size - g.sink_blocks)
        need = hosted - len(seq.host_blocks)
        if need > 0:
            seq.host_blocks += self._allocate(seq_id, need)
            seq.summaries.reserve(hosted)

    def _allocate(self, seq_id: str, count: int) -> list[int]:
        try:
            return self.allocator.allocate(seq_id, count)
        except PoolExhausted as e:
            raise PoolExhausted(f"request {seq_id}: host KV pool exhausted ({e})") from e

    def begin(self, plan: StepPlan, batch: ForwardBatch) -> OffloadStep | None:
        chunks = [c for c in plan.chunks if c.offloaded]
        if not chunks:
            return None
        return OffloadStep(self, chunks, batch)

    def stats(self) -> dict[str, int | float | None]:
        rows, r = max(self.decoded_rows, 1), self.recall
        return {
            "offloaded": len(self.seqs),
            "host_blocks": sum(len(s.host_blocks) for s in self.seqs.values()),
            "written_blocks": self.written_blocks,
            "decoded_rows": self.decoded_rows,
            "recalled_units": r.units,
            "recall_transfers": r.transfers,
            "recall_bytes": r.bytes,
            "recall_transfers_per_step": r.transfers / rows,  # per offloaded request and decode step, all layers
            "recall_bytes_per_step": r.bytes / rows,
            "recall_bytes_by_layer": list(self.recall_bytes_by_layer),
            "prefetched_units": r.prefetched_units,
            "corrected_units": r.corrected_units,
            "truncated_units": r.truncated_units,
            "suspended_rows": r.suspended_rows,
            "resumed_layers": r.resumed_layers,
            "io_wait_seconds": r.io_wait_s,
            "io_busy_seconds": r.io_busy_s,
            "attention_mass": self.mass.mean if self.mass else None,
            "attention_mass_min": self.mass.minimum if self.mass and self.mass.count else None,
        }


class OffloadStep:
    """The offloaded chunks of one step: writes, recalls and attention rows, layer by layer.
    Index tensors that do not depend on the layer are built once here. With layer cursors the
    rows suspended at a layer and the rows that go on are each a cohort of the step (`cohort`):
    a step of their own over their batch, sharing the step's recalls in flight."""

    def __init__(self, manager: OffloadManager, chunks, batch: ForwardBatch, step: OffloadStep | None = None):
        self.manager = manager
        self.root = step is None  # the step itself, not a cohort of it: counts rows and writes, sets lengths
        self.geometry = g = manager.geometry
        self.seqs = [manager.seqs[c.seq_id] for c in chunks]
        self.chunks = chunks
        self.decode_rows = {s.seq_id: batch.decode_seq_ids.index(s.seq_id) for s in self.seqs if s.seq_id in batch.decode_seq_ids}
        self.offloaded_rows = list(self.decode_rows.values())  # the order _tables builds their tables in
        resident = [row for row in range(len(batch.decode_seq_ids)) if row not in self.offloaded_rows]
        rows_on = batch.input_ids.device
        self.resident_rows = torch.tensor(resident, dtype=torch.long, device=rows_on) if resident else None
        # the offloaded rows' phase: None when they are the whole batch (no indexing then)
        self.decode_index = torch.tensor(self.offloaded_rows, dtype=torch.long, device=rows_on)
        self.offloaded_index = self.decode_index if resident else None
        self.by_id = {s.seq_id: s for s in self.seqs}
        self.decode_seqs = [self.by_id[seq_id] for seq_id in self.decode_rows]  # in row order
        self.hot_rows = torch.tensor([s.hot_row for s in self.decode_seqs], dtype=torch.long, device=rows_on)
        # layer -> its recalls on the I/O thread (a suspended cohort waits on those its rows left), and
        # the recalls a deadline left behind, which land before the step ends: the step's, shared by its cohorts
        self.pending: dict[int, list[RecallJob]] = {} if step is None else step.pending
        self.landing: list[RecallJob] = [] if step is None else step.landing
        B = g.block_size
        # the new tokens of device blocks go straight to the cache; the host-bound blocks (full and past
        # the sink) are assembled in a buffer, one block per row: any earlier tokens of the chunk's
        # partly filled first block from the cache, the rest from the new tokens
        dev_slots, dev_tokens, prefix_buf, prefix_slots, host_buf, host_tokens = [], [], [], [], [], []
        host_ids, summary_runs = [], []
        for seq, chunk in zip(self.seqs, chunks):
            start, end = chunk.start_pos, chunk.end_pos
            flat = batch.chunk_starts[chunk.seq_id] - start  # the flat token index of context position 0
            hosted = len(host_ids)
            for j in range(start // B, (end - 1) // B + 1):
                lo, hi = max(start - j * B, 0), min(end - j * B, B)  # the block's new tokens, as offsets in it
                tokens = torch.arange(flat + j * B + lo, flat + j * B + hi)
                if j < g.sink_blocks or j >= g.window_start(end):
                    dev = seq.device_block(j, end)
                    dev_slots.append(torch.arange(dev * B + lo, dev * B + hi))
                    dev_tokens.append(tokens)
                if j >= g.sink_blocks and hi == B:
                    row0 = len(host_ids) * B
                    if lo:
                        dev = seq.device_block(j, start)
                        prefix_buf.append(torch.arange(row0, row0 + lo))
                        prefix_slots.append(torch.arange(dev * B, dev * B + lo))
                    host_buf.append(torch.arange(row0 + lo, row0 + B))
                    host_tokens.append(tokens)
                    host_ids.append(seq.host_blocks[j - g.sink_blocks])
            if len(host_ids) > hosted:  # the chunk's newly full host blocks are consecutive: one summary write
                summary_runs.append((seq, max(start // B, g.sink_blocks) - g.sink_blocks, hosted, len(host_ids) - hosted))
        device = batch.input_ids.device

        def cat(parts: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat(parts).to(device) if parts else torch.empty(0, dtype=torch.long, device=device)

        self.dev_slots, self.dev_tokens = cat(dev_slots), cat(dev_tokens)
        self.prefix_buf, self.prefix_slots = cat(prefix_buf), cat(prefix_slots)
        self.host_buf, self.host_tokens = cat(host_buf), cat(host_tokens)
        self.host_ids = torch.tensor(host_ids, dtype=torch.long)  # indexes the host pool: stays on the CPU
        self.summary_runs = summary_runs  # (request, first summary slot, first host_ids row, count)
        if self.root:
            for seq, chunk in zip(self.seqs, chunks):
                seq.length = chunk.end_pos  # layer by layer, the writes below make it true before attention reads it
            manager.written_blocks += len(host_ids)
        self.frame = self._frame(device)
        # what each decode row selects from, at every layer of the step: its host blocks before the window
        self.host_counts = [g.window_start(seq.length) - g.sink_blocks for seq in self.decode_seqs]
        self.summaries = [seq.summaries for seq in self.decode_seqs]

    def _frame(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """What each offloaded decode row attends besides its selection, at its new length: its sink
        and window blocks [rows, width] (padded with its first block), their logical blocks (padded
        with NO_BLOCK), and the tokens of its last block."""
        rows = [seq.resident_blocks() for seq in self.decode_seqs]
        width = max(map(len, rows), default=0)
        padded = [row + [(NO_BLOCK, row[0][1])] * (width - len(row)) for row in rows]
        logical, blocks = (torch.tensor([[pair[i] for pair in row] for row in padded], dtype=torch.long, device=device) for i in (0, 1))
        B = self.geometry.block_size
        last_tokens = torch.tensor([(seq.length - 1) % B + 1 for seq in self.decode_seqs], dtype=torch.long, device=device)
        return blocks.view(len(rows), width), logical.view(len(rows), width), last_tokens

    def cohort(self, batch: ForwardBatch) -> OffloadStep | None:
        """This step over a cohort's batch (its rows, resident ones aside); None if it has no offloaded chunk."""
        chunks = [c for c in self.chunks if c.seq_id in batch.chunk_starts]
        return OffloadStep(self.manager, chunks, batch, self) if chunks else None

    # ------------------------------------------------------------ per layer

    def store(self, layer: int, cache: PagedKVCache, k: torch.Tensor, v: torch.Tensor) -> None:
        """Writes the chunks' new K/V: sink and window blocks to the device, newly full blocks to the host pool."""
        B, count = self.geometry.block_size, self.host_ids.numel()
        k_cache, v_cache = cache.layer(layer)
        blocks = []
        for new, cached in ((k, k_cache), (v, v_cache)):
            if count:  # read before the device writes: a long chunk's window may reuse the ring slot of its first block
                buf = torch.empty((count * B, *cached.shape[1:]), dtype=cached.dtype, device=cached.device)
                buf[self.prefix_buf] = cached[self.prefix_slots]
                buf[self.host_buf] = new[self.host_tokens]
                blocks.append(buf.view(count, B, *cached.shape[1:]))
            cached.index_copy_(0, self.dev_slots, new[self.dev_tokens])
        if count:
            k_blocks, v_blocks = blocks
            self.manager.view.write(self.host_ids, layer, k_blocks, v_blocks)
            for seq, first, row, n in self.summary_runs:
                seq.summaries.write(layer, first, k_blocks[row : row + n])

    @property
    def prefetching(self) -> bool:
        return self.manager.layer_ahead and bool(self.decode_rows)

    def prefetch(self, layer: int, cache: PagedKVCache, q: torch.Tensor) -> None:
        """Layer-ahead recall: selects `layer`'s blocks with a predicted query of each decode row
        and starts recalling the misses on the I/O thread; decode_tables(layer) waits for it. The
        prediction fills the hot buffer's whole capacity (room beyond the budget: more of what the
        true query picks is already on its way); the true query's selection never evicts its own blocks."""
        _, recalls = self._plan(layer, q, self.geometry.hot_blocks)
        if recalls:
            self._submit(layer, cache, recalls)
            self.manager.add_recall(prefetched_units=len(recalls))
            self._count(layer, recalls)

    def decode_phases(self, layer: int, cache: PagedKVCache, q: torch.Tensor, batch: ForwardBatch) -> Iterator[DecodePhase]:
        """The batch's decode rows for this layer in the order they can attend: (rows, or None for
        all of them; block tables [rows, max_blocks] or [rows, kv_heads, max_blocks] in headwise
        mode; context lengths). Resident rows first, over their whole context; then the offloaded
        rows, selected with the true query and recalled, over their own (narrower) tables, so no
        row pays for another's padding. With suspension the offloaded rows whose recalls are still
        in flight wait in a last phase while the others attend, and attend once their recalls land;
        with layer cursors that phase is marked suspended: those rows leave the batch at this layer
        with their tables and attend when they resume (unless no row of it could go on: then they wait)."""
        manager = self.manager
        if not self.offloaded_rows:  # this step's offloaded requests all prefill
            yield from self._resident_phase(batch)
            return
        if manager.deadline_s is not None:
            selection = self._start_recalls(layer, cache, q)
            in_flight = self._timed(self._settle, layer, time.perf_counter() + manager.deadline_s)
        elif manager.suspend:
            selection, in_flight = self._start_recalls(layer, cache, q), set()
        else:
            selection, in_flight = self._recall_all(layer, cache, q), set()
        tables, lens = self._tables(layer, cache, q, selection, in_flight)
        yield from self._resident_phase(batch)
        waiting = self._waiting_rows(layer)
        if not waiting:
            self.land(layer)  # landed already: nothing to wait for
            yield DecodePhase(self.offloaded_index, tables, lens)
            return
        manager.add_recall(suspended_rows=len(waiting))
        ready = [i for i, row in enumerate(self.offloaded_rows) if row not in waiting]
        if ready:
            yield DecodePhase(self._rows(ready, q.device), tables[ready], lens[ready])
        later = [i for i, row in enumerate(self.offloaded_rows) if row in waiting]
        if manager.cursors and (ready or self.resident_rows is not None or batch.prefills):
            yield DecodePhase(self._rows(later, q.device), tables[later], lens[later], suspended=True)
            return
        self.land(layer)
        yield DecodePhase(self._rows(later, q.device), tables[later], lens[later])

    def _resident_phase(self, batch: ForwardBatch) -> Iterator[DecodePhase]:
        if self.resident_rows is not None:
            rows = self.resident_rows
            yield DecodePhase(rows, batch.decode_block_tables[rows], batch.decode_ctx_lens[rows])

    def resume(self, layer: int) -> None:
        """Counts the layers the cohort resuming at `layer` runs apart, then waits for its recalls."""
        self.manager.add_recall(resumed_layers=self.manager.num_layers - layer)
        self.land(layer)

    def land(self, layer: int) -> None:
        """Waits (counted) until the layer's recalls in flight have landed."""
        self._timed(self._settle, layer, None)

    def _rows(self, positions: list[int], device: torch.device) -> torch.Tensor:
        """Decode rows of these positions among the offloaded rows."""
        return torch.tensor([self.offloaded_rows[i] for i in positions], dtype=torch.long, device=device)

    def _tables(
        self, layer: int, cache: PagedKVCache, q: torch.Tensor, selection: Selection, in_flight: set[tuple[str, int, int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The offloaded decode rows' blocks for this layer (in row order) and their context lengths:
        sink, selected and window blocks in logical order, less the selected units a deadline left
        in flight (counted as truncated)."""
        manager, g = self.manager, self.geometry
        if layer == 0 and self.root:
            manager.decoded_rows += len(self.decode_rows)
        chosen, devices = selection
        landed = chosen >= 0
        if in_flight:
            late = landed & self._units_in(chosen, in_flight)
            landed &= ~late
            manager.add_recall(truncated_units=int(late.sum()))
        if manager.mass is not None:
            for i, (seq, row) in enumerate(zip(self.decode_seqs, self.offloaded_rows)):
                self._measure(layer, cache, q[row], seq, [(c[a] + g.sink_blocks).tolist() for c, a in zip(chosen[i], landed[i])])
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
        return (table if manager.per_head else table[:, 0]), lens

    def _units_in(self, chosen: torch.Tensor, units: set[tuple[str, int, int]]) -> torch.Tensor:
        """Which chosen blocks [rows, groups, k] are among the (request, group, logical block) units."""
        rows, groups, _ = chosen.shape
        position = {seq.seq_id: i for i, seq in enumerate(self.decode_seqs)}
        span = max(len(seq.host_blocks) for seq in self.decode_seqs) + 1
        sink = self.geometry.sink_blocks
        keys = [(position[seq_id] * groups + group) * span + logical - sink for seq_id, group, logical in units if seq_id in position]
        index = (torch.arange(rows * groups, device=chosen.device).view(rows, groups, 1) * span) + chosen
        return torch.isin(index, torch.tensor(keys, dtype=torch.long, device=chosen.device))

    def _waiting_rows(self, layer: int) -> set[int]:
        """Decode rows with a unit of this layer still in flight on the I/O thread."""
        rows = self.decode_rows  # a cohort's: the layer's recalls may carry other cohorts' units
        return {rows[u.seq_id] for job in self.pending.get(layer, []) for u in job.units[job.landed :] if u.seq_id in rows}

    def _recall_all(self, layer: int, cache: PagedKVCache, q: torch.Tensor) -> Selection:
        """Every selected block lands before attention: the layer-ahead recall first (the true
        query's misses may take its blocks), then the misses, copied on this thread."""
        self._timed(self._settle, layer, None)
        selection, recalls = self._plan(layer, q, self.geometry.budget_blocks)
        if recalls:
            self._correct(layer, recalls)
            self._timed(self._recall, layer, cache, RecallJob(recalls))
        return selection

    def _start_recalls(self, layer: int, cache: PagedKVCache, q: torch.Tensor) -> Selection:
        """Selects with the true query; its misses queue behind the layer-ahead recall on the I/O
        thread (so blocks are written in the order they were assigned)."""
        selection, recalls = self._plan(layer, q, self.geometry.budget_blocks)
        if recalls:
            self._correct(layer, recalls)
            self._submit(layer, cache, recalls)
        return selection

    def _correct(self, layer: int, recalls: list[Recall]) -> None:
        self._count(layer, recalls)
        self.manager.add_recall(corrected_units=len(recalls) if self.manager.layer_ahead and layer > 0 else 0)

    def _timed(self, wait: Callable[..., T], *args) -> T:
        """Runs `wait`, counting its time as compute blocked on recalls."""
        started = time.perf_counter()
        try:
            return wait(*args)
        finally:
            self.manager.add_recall(io_wait_s=time.perf_counter() - started)

    def _plan(self, layer: int, q: torch.Tensor, budget: int) -> tuple[Selection, list[Recall]]:
        """Selects each decode row's top-`budget` host blocks for query q (one row per decode
        sequence) and updates the hot buffers: the selection, and its misses."""
        manager = self.manager
        chosen = select_blocks(manager.scorer, layer, q[self.decode_index], self.summaries, self.host_counts, budget, manager.per_head)
        devices, missed = manager.hot.update(self.hot_rows, layer, chosen)
        return Selection(chosen, devices), self._misses(chosen, devices, missed)

    def _misses(self, chosen: torch.Tensor, devices: torch.Tensor, missed: torch.Tensor) -> list[Recall]:
        row, group, k = by_rank(missed)
        units = torch.stack((row, group, chosen[row, group, k], devices[row, group, k])).T.tolist()
        sink, seqs = self.geometry.sink_blocks, self.decode_seqs
        return [Recall(seqs[r].seq_id, sink + j, h, seqs[r].host_blocks[j], dev) for r, h, j, dev in units]

    def _submit(self, layer: int, cache: PagedKVCache, recalls: list[Recall]) -> None:
        job = RecallJob(recalls)
        job.future = self.manager.io.submit(self._recall, layer, cache, job)
        self.pending.setdefault(layer, []).append(job)

    def _settle(self, layer: int, deadline: float | None) -> set[tuple[str, int, int]]:
        """Waits for the layer's recalls on the I/O thread until `deadline` (None: until they
        land); returns the units still in flight, which finish() waits for."""
        in_flight = set()
        for job in self.pending.pop(layer, []):
            try:
                job.future.result(timeout=None if deadline is None else max(0.0, deadline - time.perf_counter()))
            except TimeoutError:
                self.landing.append(job)
                in_flight |= job.in_flight()
        return in_flight

    def finish(self) -> None:
        """Waits for every recall still in flight (a step that failed midway, or a deadline, must
        not leave the I/O thread writing into blocks the next step reuses); raises a late one's error."""
        jobs = [job for layer in self.pending.values() for job in layer] + self.landing
        self._timed(wait_all, [job.future for job in jobs])
        for job in self.landing:
            job.future.result()

    def _recall(self, layer: int, cache: PagedKVCache, job: RecallJob) -> None:
        """One gather of every missed unit of the layer from the host pool, scattered into the hot
        buffers: whole (block, layer) units in pulse mode, one kv head of each in headwise mode.
        On CUDA the units are staged on the device first (one copy per unit), then scattered.
        Without `gather` (the ablation) each unit is its own copy; with a deadline the gather is
        cut in RECALL_PARTS so attention can use the leading (best) units that landed."""
        started = time.perf_counter()
        for part in self._parts(job.units):
            self._copy(layer, cache, part)
            job.landed += len(part)
        self.manager.add_recall(io_busy_s=time.perf_counter() - started)

    def _parts(self, units: list[Recall]) -> list[list[Recall]]:
        size = 1 if not self.manager.gather else len(units) if self.manager.deadline_s is None else -(-len(units) // RECALL_PARTS)
        return [units[i : i + size] for i in range(0, len(units), size)]

    def _copy(self, layer: int, cache: PagedKVCache, recalls: list[Recall]) -> None:
        view, per_head, remote = self.manager.view, self.manager.per_head, self.manager.remote
        if remote is not None:  # the kv_store's I/O engine copies into the shared cache
            remote(layer, [r.host for r in recalls], [r.device for r in recalls], [r.group for r in recalls] if per_head else None)
            return
        k_cache, v_cache = cache.layer(layer)
        host = torch.tensor([r.host for r in recalls], dtype=torch.long)
        dev = torch.tensor([r.device for r in recalls], dtype=torch.long, device=k_cache.device)
        heads = torch.tensor([r.group for r in recalls], dtype=torch.long, device=k_cache.device) if per_head else None
        if k_cache.is_cuda:
            units, index = view.read(host, layer, k_cache.device), torch.arange(len(recalls), device=k_cache.device)
        else:
            units, index = view.units, view.unit_rows(host, layer)
        recall(units, index, k_cache, v_cache, dev, heads)

    def _count(self, layer: int, recalls: list[Recall]) -> None:
        """Recall statistics, counted on the compute thread (the I/O thread adds only its busy time)."""
        manager, view = self.manager, self.manager.view
        size = len(recalls) * view.unit_bytes // (view.kv_heads if manager.per_head else 1)
        manager.add_recall(units=len(recalls), transfers=len(recalls) * (2 if manager.per_head else 1), bytes=size)
        manager.recall_bytes_by_layer[layer] += size

    def _measure(self, layer: int, cache: PagedKVCache, q: torch.Tensor, seq: OffloadedSeq, selected: list[list[int]]) -> None:
        """Adds the share of dense attention mass on the attended blocks (evals only)."""
        g, length = self.geometry, seq.length
        k, _ = self.context_kv(layer, cache, seq, length, self.manager.workspace)
        blocks = (length - 1) // g.block_size + 1
        attended = torch.zeros((len(selected), blocks), dtype=torch.bool)
        attended[:, : g.sink_blocks] = True
        attended[:, g.window_start(length) :] = True
        for group, chosen in enumerate(selected):
            attended[group, chosen] = True
        positions = attended.repeat_interleave(g.block_size, dim=1)[:, :length].to(q.device)
        self.manager.mass.add(q, k[:length].transpose(0, 1), positions)

    def prefill_context(
        self, layer: int, cache: PagedKVCache, span: PrefillSpan, workspace: GatherWorkspace
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of an offloaded request's whole context [0, span.ctx_len), in position order."""
        return self.context_kv(layer, cache, self.by_id[span.seq_id], span.ctx_len, workspace)

    def context_kv(
        self, layer: int, cache: PagedKVCache, seq: OffloadedSeq, length: int, workspace: GatherWorkspace
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions [0, length) of an offloaded request (sink and window from the
        device, the rest read back from the host pool): [blocks * block_size, kv_heads, dim]."""
        g = self.geometry
        B = g.block_size
        blocks = (length - 1) // B + 1
        k_cache, v_cache = cache.layer(layer)
        row_size = B * k_cache.shape[1] * k_cache.shape[2]
        k_out, v_out = workspace.buffers(blocks, row_size, k_cache)
        hosted = range(g.sink_blocks, g.window_start(length))
        on_device = [j for j in range(blocks) if j not in hosted]
        positions = torch.tensor(on_device, dtype=torch.long, device=k_cache.device)
        devs = torch.tensor([seq.device_block(j, length) for j in on_device], dtype=torch.long, device=k_cache.device)
        for out, cached in ((k_out, k_cache), (v_out, v_cache)):
            out[positions] = cached.view(-1, row_size)[devs]
        if len(hosted):
            units = self.manager.view.read(torch.tensor(seq.host_blocks[: len(hosted)], dtype=torch.long), layer, k_cache.device)
            for i, out in enumerate((k_out, v_out)):
                out[hosted.start : hosted.stop] = units[:, i].transpose(1, 2).reshape(len(hosted), -1)
        shape = (blocks * B, *k_cache.shape[1:])
        return k_out.view(shape), v_out.view(shape)
