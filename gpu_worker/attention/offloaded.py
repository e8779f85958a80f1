"""Offloaded sparse attention: an offloaded decode row attends its sink, the host blocks selected
for its query (recalled into its hot buffer) and its recent window; an offloaded prefill attends
its whole context, read back from the host pool. Resident rows of the same step attend as in the
paged backend."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pulseinfer.gpu_worker.attention.base import Suspension
from pulseinfer.gpu_worker.attention.paged import PagedAttention
from pulseinfer.gpu_worker.batch import DecodePhase, ForwardBatch, PrefillSpan
from pulseinfer.gpu_worker.kv_cache import PagedKVCache
from pulseinfer.gpu_worker.offload.manager import OffloadManager
from pulseinfer.gpu_worker.offload.step import OffloadStep
from pulseinfer.kernels.attention import GatherWorkspace, prefill_attention
from pulseinfer.kernels.prefill_triton import prefill_attention_triton
from pulseinfer.messages.plan import StepPlan


class OffloadedAttention(PagedAttention):
    def __init__(self, batch: ForwardBatch, cache: PagedKVCache, workspace: GatherWorkspace, offload: OffloadStep):
        super().__init__(batch, cache, workspace)
        self.offload = offload

    @property
    def prefetching(self) -> bool:
        return self.offload.prefetching

    def prefetch(self, layer: int, q: torch.Tensor) -> None:
        self.offload.prefetch(layer, q)

    def resume(self, layer: int, suspension: Suspension) -> torch.Tensor:
        self.offload.resume(layer)  # once the rows' recalls have landed
        return super().resume(layer, suspension)

    def cohort(self, batch: ForwardBatch) -> PagedAttention:
        return step_attention(batch, self.cache, self.workspace, self.offload.cohort(batch))

    def finish(self) -> None:
        self.offload.finish()

    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.offload.store(layer, k, v)

    def _decode_phases(self, layer: int, q: torch.Tensor) -> Iterable[DecodePhase]:
        return self.offload.decode_phases(layer, q, self.batch)

    def _prefill(self, layer: int, q: torch.Tensor, span: PrefillSpan) -> torch.Tensor:
        if span.ctx_blocks is not None:  # a resident request's
            return super()._prefill(layer, q, span)
        k, v = self.offload.prefill_context(layer, span, self.workspace)
        return (prefill_attention_triton if q.is_cuda else prefill_attention)(q, k, v, span.ctx_len)


def step_attention(batch: ForwardBatch, cache: PagedKVCache, workspace: GatherWorkspace, offload: OffloadStep | None) -> PagedAttention:
    """The offloaded attention of a step (or cohort) with offloaded chunks, else the resident one."""
    return PagedAttention(batch, cache, workspace) if offload is None else OffloadedAttention(batch, cache, workspace, offload)


class OffloadedBackend:
    def __init__(self, cache: PagedKVCache, offload: OffloadManager):
        self.cache, self.offload = cache, offload
        self.workspace = GatherWorkspace()  # the context gathers of every step's attention

    def begin(self, plan: StepPlan, batch: ForwardBatch) -> PagedAttention:
        return step_attention(batch, self.cache, self.workspace, self.offload.begin(plan, batch))
