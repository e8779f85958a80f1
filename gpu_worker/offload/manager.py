"""The worker's offloaded requests over their lives: admitted (state and host blocks readied),
stepped, released; dropped together when the scheduler or the kv_store that held them goes away,
and the pool of a restarted kv_store mapped anew."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace

import torch

from pulseinfer.gpu_worker.batch import ForwardBatch
from pulseinfer.gpu_worker.faults import FaultPlan
from pulseinfer.gpu_worker.kv_cache import PagedKVCache
from pulseinfer.gpu_worker.offload.config import HostTier, OffloadConfig
from pulseinfer.gpu_worker.offload.context import StepContext
from pulseinfer.gpu_worker.offload.counters import RecallCounters
from pulseinfer.gpu_worker.offload.hot import HotBuffers
from pulseinfer.gpu_worker.offload.layout import OffloadedSeq
from pulseinfer.gpu_worker.offload.prefix import copy_sink, import_prefix
from pulseinfer.gpu_worker.offload.recall import HostCopier, RecallQueue
from pulseinfer.gpu_worker.offload.step import OffloadStep
from pulseinfer.gpu_worker.sparse import AttentionMass, Scorer, SummaryPool
from pulseinfer.kernels.attention import GatherWorkspace
from pulseinfer.kv_store.allocator import PoolExhausted
from pulseinfer.kv_store.client import HostPoolLost, KVStoreUnavailable
from pulseinfer.kv_store.cuda_ipc import CopyStream
from pulseinfer.messages.plan import BlockNames, Chunk, RecallStats, StepPlan

log = logging.getLogger("gpu_worker")
HOST_ERRORS = (PoolExhausted, KVStoreUnavailable, HostPoolLost, ValueError)


class OffloadManager:
    """The worker's offloaded requests: their states and host blocks, and each step's context."""

    def __init__(
        self,
        config: OffloadConfig,
        cache: PagedKVCache,
        host: HostTier,
        scorer: Scorer,
        per_head: bool = False,
        faults: FaultPlan | None = None,
    ):
        self.scorer = scorer
        self.faults = faults or FaultPlan()
        self.geometry = config.geometry(cache.spec.block_size)
        self.policy = config.policy(cache.k.device, per_head)
        self.cache = cache
        self.host = host
        self.view = host.view
        self.remote = host.recall_engine(cache) if host.recall_engine is not None else None
        self.mass = AttentionMass() if config.measure_attention_mass else None
        # the I/O engine of this worker: one thread, so recalls run while the compute thread goes on
        self.io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pulseinfer-io")
        self.copies = CopyStream(cache.k.device) if cache.k.is_cuda else None  # its recalls' own stream (in-process pool)
        self.workspace = GatherWorkspace()  # the attention-mass measurement's context gathers
        self.seqs: dict[str, OffloadedSeq] = {}
        num_layers = cache.shape.num_layers
        self.hot = HotBuffers(num_layers, scorer.kv_heads if per_head else 1, self.geometry, cache.k.device)
        self.summaries = SummaryPool(num_layers, scorer, self.geometry.block_size, cache.k.dtype, cache.k.device)
        self.counters = RecallCounters(num_layers)

    def close(self) -> None:
        self.io.shutdown()
        if self.remote is not None:
            self.remote.close()

    @property
    def recall(self) -> RecallStats:
        return self.counters.snapshot()

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
            self._forget(seq)
        self.seqs.clear()

    def _forget(self, seq: OffloadedSeq) -> None:
        self.hot.remove(seq.hot_row)
        self.summaries.release(seq.summary_slots)

    def release(self, seq_ids: tuple[str, ...] | list[str]) -> None:
        """Frees the requests' states and host blocks (also of one that never reached this worker:
        the scheduler takes a placement's cached host blocks for it before sending its first chunk)."""
        for seq_id in seq_ids:
            seq = self.seqs.pop(seq_id, None)
            if seq is not None:
                self._forget(seq)
            try:
                self.host.allocator.release(seq_id)
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
            except HOST_ERRORS as e:
                failed[chunk.seq_id] = str(e)
        lost = [c for c in kept if c.offloaded and c.seq_id not in self.seqs]  # readied, then dropped by a pool loss
        failed.update({c.seq_id: f"request {c.seq_id}: its offloaded KV was lost when the kv_store restarted" for c in lost})
        return replace(plan, chunks=tuple(c for c in kept if c not in lost)), failed

    def _ready_or_reattach(self, chunk: Chunk) -> None:
        """A new request that finds the kv_store restarted maps the new pool and goes on; the
        requests whose KV was in the old pool are dropped (and fail)."""
        try:
            if self.view is None:  # detached from a dead kv_store
                raise HostPoolLost("the kv_store restarted")
            self._ready(chunk)
        except HostPoolLost:
            self._drop_seqs()
            if self.host.reattach is None:
                raise
            self.reattach()
            if chunk.start_pos != 0:
                raise
            self._ready(chunk)

    def reattach(self) -> None:
        """Maps a restarted kv_store's new pool (registering anew); the old one's requests are dropped."""
        if self.host.reattach is None:
            raise HostPoolLost("the host pool is gone")
        self.detach()
        self.view = self.host.reattach()
        if self.host.recall_engine is not None:
            self.remote = self.host.recall_engine(self.cache)

    def _ready(self, chunk: Chunk) -> None:
        g = self.geometry
        seq_id, footprint, start, end = chunk.seq_id, chunk.block_table, chunk.start_pos, chunk.end_pos
        seq = self.seqs.get(seq_id)
        if seq is None:
            if start != len(chunk.host_prefix) * g.block_size:
                raise ValueError(f"request {seq_id}: its offloaded KV is gone from this worker (the kv_store restarted)")
            if len(footprint) != g.device_blocks:
                raise ValueError(f"request {seq_id}: {len(footprint)} device blocks for an offloaded request, expected {g.device_blocks}")
            seq = self.seqs[seq_id] = OffloadedSeq(seq_id, tuple(footprint), g, self.hot.add(tuple(footprint)))
            if chunk.host_prefix:
                import_prefix(seq, list(chunk.host_prefix), self.cache, self.view, self.summaries)
        if seq.length != start or seq.footprint != tuple(footprint):
            raise ValueError(f"request {seq_id}: the plan (position {start}) disagrees with the worker's state ({seq.length} tokens)")
        hosted = max(0, end // g.block_size - g.sink_blocks)
        need = hosted - len(seq.host_blocks)
        if need > 0:
            seq.host_blocks += self._allocate(seq_id, need)
            seq.summary_slots += self.summaries.allocate(need)

    def _allocate(self, seq_id: str, count: int) -> list[int]:
        try:
            return self.host.allocator.allocate(seq_id, count)
        except PoolExhausted as e:
            raise PoolExhausted(f"request {seq_id}: host KV pool exhausted ({e})") from e

    def forget_recalls(self, seq_ids: list[str]) -> None:
        """After a failed step, before its requests run again: what its recalls were to bring may not
        have landed, so their hot buffers start empty (recalled again when selected)."""
        for seq_id in seq_ids:
            if (seq := self.seqs.get(seq_id)) is not None:
                self.hot.clear(seq.hot_row)

    def name_blocks(self, named: tuple[BlockNames, ...]) -> None:
        """Gives the host tier's prefix cache the offloaded requests' full blocks the plan names, written
        by now (best effort: a block left unnamed costs a later request its reuse, nothing else)."""
        g, names, blocks = self.geometry, [], []
        for entry in named:
            seq = self.seqs.get(entry.seq_id)
            if seq is None:
                continue
            logical = range(entry.first, entry.first + len(entry.names))
            sink = [j for j in logical if j < g.sink_blocks]
            try:
                copies = self._allocate(seq.seq_id, len(sink)) if sink else []
            except HOST_ERRORS as e:
                log.debug("request %s: its sink blocks stay unnamed: %s", seq.seq_id, e)
                continue
            if sink:
                copy_sink(seq, sink, copies, self.cache, self.view)
            names += entry.names
            blocks += copies + [seq.host_blocks[j - g.sink_blocks] for j in logical if j >= g.sink_blocks]
        if names:
            if self.cache.k.device.type == "cuda":  # a name is published once its blocks' writes have landed
                torch.cuda.current_stream().synchronize()
            try:
                self.host.allocator.insert(list(names), blocks)
            except HOST_ERRORS as e:
                log.debug("%d blocks stay unnamed: %s", len(names), e)

    def begin(self, plan: StepPlan, batch: ForwardBatch) -> OffloadStep | None:
        chunks = [c for c in plan.chunks if c.offloaded]
        if not chunks:
            return None
        ctx = StepContext(
            self.cache,
            self.view,
            self.geometry,
            self.policy,
            self.scorer,
            self.summaries,
            self.hot,
            self.counters,
            self.mass,
            self.workspace,
            self.faults,
        )
        copier = HostCopier(self.view, self.remote, self.cache, self.policy.per_head, self.copies, self.faults)
        queue = RecallQueue(self.io, copier, self.counters, self.policy)
        return OffloadStep(ctx, [self.seqs[c.seq_id] for c in chunks], chunks, batch, queue, root=True)

    def stats(self) -> dict[str, int | float | list | dict | None]:
        c, recall = self.counters, self.recall
        rows = max(c.decoded_rows, 1)
        return {
            "offloaded": len(self.seqs),
            "host_blocks": sum(len(s.host_blocks) for s in self.seqs.values()),
            "written_blocks": c.written_blocks,
            "decoded_rows": c.decoded_rows,
            "recall": asdict(recall),  # RecallStats' names, as the proto and /metrics carry them
            "recall_transfers_per_step": recall.transfers / rows,  # per offloaded request and decode step, all layers
            "recall_bytes_per_step": recall.bytes / rows,
            "recall_bytes_by_layer": list(c.bytes_by_layer),
            "attention_mass": self.mass.mean if self.mass else None,
            "attention_mass_min": self.mass.minimum if self.mass and self.mass.count else None,
        }
