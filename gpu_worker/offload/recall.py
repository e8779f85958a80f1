"""The recall path: missed units copied from the host pool into the hot buffers, on the worker's
I/O thread (or in line), one gather per layer, landing in score order so a deadline can attend
over the leading units that landed."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as ResultTimeout  # before Python 3.11 not the builtin TimeoutError
from concurrent.futures import wait as wait_all
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from pulseinfer.common.syncs import to_device
from pulseinfer.gpu_worker.faults import FaultPlan
from pulseinfer.gpu_worker.kv_cache import PagedKVCache
from pulseinfer.gpu_worker.offload.config import RecallPolicy
from pulseinfer.gpu_worker.offload.counters import RecallCounters
from pulseinfer.kernels.gather_scatter import recall
from pulseinfer.kv_store.client import RemoteRecall
from pulseinfer.kv_store.cuda_ipc import CopyStream
from pulseinfer.kv_store.view import PoolView

RECALL_PARTS = 8  # with a recall deadline: each layer's gather in this many parts, landing in score order


class Recall(NamedTuple):
    """One missed unit: logical block `logical` of request `seq_id` (kv head `group` in headwise
    mode), from host block `host` into device block `device`."""

    seq_id: str
    logical: int
    group: int
    host: int
    device: int


class RecallJob:
    """Recalls of one layer on the I/O thread, in score order; `landed` counts the leading units
    whose copy has completed, so a deadline can attend over those and leave the rest."""

    def __init__(self, units: list[Recall]):
        self.units = units
        self.landed = 0
        self.future: Future | None = None

    def in_flight(self) -> set[tuple[str, int, int]]:
        return {(u.seq_id, u.group, u.logical) for u in self.units[self.landed :]}


@dataclass(frozen=True)
class HostCopier:
    """Copies units from the host pool into the device cache: the kv_store's I/O engine into the
    shared cache (`remote`), or this process from its mapping of the pool; on CUDA the recall
    kernel reads the pinned, mapped pool in place, on `copies`' stream, ordered with compute by its
    events as the engine's copies are (so recalls overlap compute and no thread waits for the GPU)."""

    view: PoolView
    remote: RemoteRecall | None
    cache: PagedKVCache
    per_head: bool
    copies: CopyStream | None  # on CUDA; None on CPU
    faults: FaultPlan = field(default_factory=FaultPlan)  # the tests' injected faults (none in service)

    def __call__(self, layer: int, recalls: list[Recall]) -> None:
        if self.faults.armed:
            self.faults.check("recall", {r.seq_id for r in recalls})
        if self.remote is not None:
            groups = [r.group for r in recalls] if self.per_head else None
            self.remote(layer, [r.host for r in recalls], [r.device for r in recalls], groups)
            return
        k_cache, v_cache = self.cache.layer(layer)
        index = torch.tensor([[r.host for r in recalls], [r.device for r in recalls], [r.group for r in recalls]], dtype=torch.long)
        index[0] = self.view.unit_rows(index[0], layer)
        if not k_cache.is_cuda:
            rows, dev, groups = index
            recall(self.view.units, rows, k_cache, v_cache, dev, groups if self.per_head else None)
            return
        with self.copies.copying():
            rows, dev, groups = to_device([index], k_cache.device)[0]
            recall(self.view.units, rows, k_cache, v_cache, dev, groups if self.per_head else None, self.view.mapped())


class RecallQueue:
    """One step's recalls, by layer: queued on the I/O thread or copied in line, waited for
    (the wait counted), and all landed before the step ends. A step's cohorts share its queue."""

    def __init__(self, io: ThreadPoolExecutor, copy: HostCopier, counters: RecallCounters, policy: RecallPolicy):
        self.io, self.copy, self.counters, self.policy = io, copy, counters, policy
        self.pending: dict[int, list[RecallJob]] = {}  # layer -> its recalls on the I/O thread
        self.landing: list[RecallJob] = []  # the recalls a deadline left behind: they land before the step ends

    def submit(self, layer: int, recalls: list[Recall]) -> None:
        job = RecallJob(recalls)
        job.future = self.io.submit(self._recall, layer, job)
        self.pending.setdefault(layer, []).append(job)

    def in_line(self, layer: int, recalls: list[Recall]) -> None:
        """Copies on this thread, counted as compute blocked on recalls."""
        self.counters.waiting(self._recall, layer, RecallJob(recalls))

    def settle(self, layer: int, deadline: float | None) -> set[tuple[str, int, int]]:
        """Waits (counted) for the layer's recalls on the I/O thread until `deadline` (None: until
        they land); returns the units still in flight, which finish() waits for."""
        return self.counters.waiting(self._settle, layer, deadline)

    def _settle(self, layer: int, deadline: float | None) -> set[tuple[str, int, int]]:
        in_flight = set()
        for job in self.pending.pop(layer, []):
            try:
                job.future.result(timeout=None if deadline is None else max(0.0, deadline - time.perf_counter()))
            except ResultTimeout:
                self.landing.append(job)
                in_flight |= job.in_flight()
        return in_flight

    def waiting_seqs(self, layer: int) -> set[str]:
        """Requests with a unit of this layer still in flight on the I/O thread."""
        return {u.seq_id for job in self.pending.get(layer, []) for u in job.units[job.landed :]}

    def finish(self) -> None:
        """Waits for every recall still in flight (a step that failed midway, or a deadline, must
        not leave the I/O thread writing into blocks the next step reuses); raises a late one's error."""
        jobs = [job for layer in self.pending.values() for job in layer] + self.landing
        self.counters.waiting(wait_all, [job.future for job in jobs])
        for job in self.landing:
            job.future.result()

    def _recall(self, layer: int, job: RecallJob) -> None:
        """One gather of every missed unit of the layer from the host pool, scattered into the hot
        buffers: whole (block, layer) units in pulse mode, one kv head of each in headwise mode.
        On CUDA one kernel reads the units from the mapped pool and scatters them.
        Without `gather` (the ablation) each unit is its own copy; with a deadline the gather is
        cut in RECALL_PARTS so attention can use the leading (best) units that landed."""
        started = time.perf_counter()
        for part in self._parts(job.units):
            self.copy(layer, part)
            job.landed += len(part)
        self.counters.add(io_busy_s=time.perf_counter() - started)

    def _parts(self, units: list[Recall]) -> list[list[Recall]]:
        policy = self.policy
        size = 1 if not policy.gather else len(units) if policy.deadline_s is None else -(-len(units) // RECALL_PARTS)
        return [units[i : i + size] for i in range(0, len(units), size)]
