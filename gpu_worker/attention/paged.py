"""Resident paged attention: every request's K/V in the device cache, read by block table."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pulseinfer.gpu_worker.attention.base import Suspension
from pulseinfer.gpu_worker.batch import DecodePhase, ForwardBatch, PrefillSpan
from pulseinfer.gpu_worker.kv_cache import PagedKVCache
from pulseinfer.kernels.attention import GatherWorkspace, paged_decode_attention, paged_prefill_attention
from pulseinfer.kernels.decode_triton import paged_decode_attention_triton
from pulseinfer.kernels.prefill_triton import paged_prefill_attention_triton
from pulseinfer.messages.plan import StepPlan


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    block: int,
    workspace: GatherWorkspace,
) -> torch.Tensor:
    """The Triton kernel on CUDA, the torch reference elsewhere: both take shared [b, n] or per-head
    [b, kv_heads, n] tables (paged, recalled or a window ring's)."""
    if q.is_cuda:
        return paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, block, workspace)
    return paged_decode_attention(q, k_cache, v_cache, tables, lens, block, workspace)


class PagedAttention:
    """One step's attention over the device cache. The offloaded backend extends it where an
    offloaded request's K/V differ: where they are stored, which blocks decode rows attend, and
    where a prefill reads its context from."""

    prefetching = False

    def __init__(self, batch: ForwardBatch, cache: PagedKVCache, workspace: GatherWorkspace):
        self.batch, self.cache, self.workspace = batch, cache, workspace

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, Suspension | None]:
        batch, block = self.batch, self.cache.spec.block_size
        self.cache.write(layer, batch.write_slots, k[batch.resident_index], v[batch.resident_index])
        self._store(layer, k, v)
        k_cache, v_cache = self.cache.layer(layer)
        out = torch.empty_like(q)
        suspended = None
        if batch.decode_index.numel():
            for rows, tables, lens, later in self._decode_phases(
                layer, q[batch.decode_index]
            ):  # rows whose recalls are in flight come last
                target = batch.decode_index if rows is None else batch.decode_index[rows]
                if later:
                    suspended = Suspension(list(later), q[target], tables, lens)  # the rows on the host: no device read
                    continue
                out[target] = decode_attention(q[target], k_cache, v_cache, tables, lens, block, self.workspace)
        for span in batch.prefills:
            out[span.start : span.end] = self._prefill(layer, q[span.start : span.end], span)
        return out, suspended

    def resume(self, layer: int, suspension: Suspension) -> torch.Tensor:
        """Over the tables selected when the rows were suspended (their K/V are written already)."""
        batch, q = self.batch, suspension.q
        k_cache, v_cache = self.cache.layer(layer)
        out = torch.empty((len(batch.input_ids), *q.shape[1:]), dtype=q.dtype, device=q.device)
        block = self.cache.spec.block_size
        out[batch.decode_index] = decode_attention(q, k_cache, v_cache, suspension.tables, suspension.lens, block, self.workspace)
        return out

    def cohort(self, batch: ForwardBatch) -> PagedAttention:
        return PagedAttention(batch, self.cache, self.workspace)

    def prefetch(self, layer: int, q: torch.Tensor) -> None:
        raise RuntimeError("resident attention recalls nothing")

    def finish(self) -> None:
        pass

    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Resident tokens are written above; the offloaded backend places its own here."""

    def _decode_phases(self, layer: int, q: torch.Tensor) -> Iterable[DecodePhase]:
        return [DecodePhase(None, self.batch.decode_block_tables, self.batch.decode_ctx_lens)]

    def _prefill(self, layer: int, q: torch.Tensor, span: PrefillSpan) -> torch.Tensor:
        k_cache, v_cache = self.cache.layer(layer)
        block = self.cache.spec.block_size
        if q.is_cuda:  # the kernel reads the context in place: no gather
            return paged_prefill_attention_triton(q, k_cache, v_cache, span.ctx_blocks, span.ctx_len, block)
        return paged_prefill_attention(q, k_cache, v_cache, span.ctx_blocks, span.ctx_len, block, self.workspace)


class PagedBackend:
    def __init__(self, cache: PagedKVCache):
        self.cache = cache
        self.workspace = GatherWorkspace()  # the context gathers of every step's attention

    def begin(self, plan: StepPlan, batch: ForwardBatch) -> PagedAttention:
        return PagedAttention(batch, self.cache, self.workspace)
