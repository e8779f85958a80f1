"""Sliding-window layers (Gemma 3's local layers, a windowed Mistral's): each running request holds
one ring of `window` slots per sliding layer on the device, whatever its context; position p
lives in slot p % window of its ring, so a ring always holds the last `window` positions, all a
query of these layers sees. Nothing of these layers is offloaded or recalled: a window is small
and read at every step. The full layers keep the paged cache and are the offloaded backend's
(vLLM's and SGLang's hybrid caches split the two the same way)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pulseinfer.common.memory import check_fits
from pulseinfer.common.model.config import ModelConfig
from pulseinfer.gpu_worker.attention.base import AttentionBackend, StepAttention, Suspension
from pulseinfer.gpu_worker.attention.paged import decode_attention
from pulseinfer.gpu_worker.batch import ForwardBatch
from pulseinfer.kernels.attention import GatherWorkspace
from pulseinfer.scheduler.plan import StepPlan


class WindowCache:
    """The sliding layers' rings: K and V as [sliding layers, rings * window, kv_heads, head_dim]."""

    def __init__(self, config: ModelConfig, rings: int, dtype: torch.dtype, device: torch.device):
        if rings < 1:
            raise ValueError(f"the sliding-window cache needs at least one request's ring, got {rings}")
        self.window = config.sliding_window
        self.index = {layer: i for i, layer in enumerate(config.sliding_layers)}  # model layer -> ring layer
        shape = (len(self.index), rings * self.window, config.num_kv_heads, config.head_dim)
        nbytes = 2 * torch.Size(shape).numel() * dtype.itemsize
        check_fits(nbytes, device, f"the sliding-window KV of {rings} running requests (--max-running)")
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.free = list(range(rings - 1, -1, -1))
        self.rings: dict[str, int] = {}  # seq_id -> its ring

    @property
    def capacity(self) -> int:
        """Requests it holds at once: the scheduler runs no more."""
        return self.k.shape[1] // self.window

    def admit(self, plan: StepPlan) -> dict[str, str]:
        """Frees the rings of the requests the plan released, then gives each new one a ring; the
        chunks of requests that cannot have one, with the reason (the scheduler's cap prevents it)."""
        self.release(plan.released)
        failed = {}
        for chunk in plan.chunks:
            if chunk.seq_id in self.rings:
                continue
            if chunk.start_pos > 0:  # its window was written by a worker that is gone
                failed[chunk.seq_id] = "this worker holds no sliding-window KV of the request"
            elif not self.free:
                failed[chunk.seq_id] = f"the sliding-window cache holds {self.capacity} requests, all running"
            else:
                self.rings[chunk.seq_id] = self.free.pop()
        return failed

    def release(self, seq_ids: tuple[str, ...] | list[str]) -> None:
        for seq_id in seq_ids:
            if (ring := self.rings.pop(seq_id, None)) is not None:
                self.free.append(ring)

    def release_all(self) -> None:
        self.release(list(self.rings))


@dataclass(frozen=True)
class WindowStep:
    """Where one step's (or cohort's) tokens go in the rings and what each decode row reads."""

    write_index: torch.Tensor  # flat indices of the tokens written (each chunk's last `window`)
    write_slots: torch.Tensor
    decode_rings: torch.Tensor  # [b, 1]: each decode row's ring, as a one-block table
    decode_lens: torch.Tensor  # [b]: positions its ring holds, its own included
    prefill_rings: tuple[int, ...]  # per prefill span

    @classmethod
    def of(cls, batch: ForwardBatch, cache: WindowCache) -> WindowStep:
        window, device = cache.window, batch.positions.device
        decode = batch.decode_index.tolist()
        chunks = [(i, i + 1, seq_id) for i, seq_id in zip(decode, batch.decode_seq_ids)]
        chunks += [(span.start, span.end, span.seq_id) for span in batch.prefills]
        written = [torch.arange(max(start, end - window), end) for start, end, _ in chunks]
        rings = [torch.full((len(index),), cache.rings[seq_id]) for index, (_, _, seq_id) in zip(written, chunks)]
        write_index = torch.cat(written).to(device) if written else torch.empty(0, dtype=torch.long, device=device)
        ring_of = torch.cat(rings).long().to(device) if rings else write_index
        decode_rings = torch.tensor([cache.rings[seq_id] for seq_id in batch.decode_seq_ids], dtype=torch.long, device=device)
        return cls(
            write_index=write_index,
            write_slots=ring_of * window + batch.positions[write_index] % window,
            decode_rings=decode_rings[:, None],
            decode_lens=torch.clamp(batch.positions[batch.decode_index] + 1, max=window),
            prefill_rings=tuple(cache.rings[span.seq_id] for span in batch.prefills),
        )


class WindowedAttention:
    """A step's attention on a model with sliding layers: those attend their rings here, the full
    layers go to `full` (paged or offloaded), under their index among the full layers."""

    def __init__(
        self, full: StepAttention, cache: WindowCache, full_index: dict[int, int], batch: ForwardBatch, workspace: GatherWorkspace
    ):
        self.full, self.cache, self.full_index, self.batch, self.workspace = full, cache, full_index, batch, workspace
        self.step = WindowStep.of(batch, cache)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, Suspension | None]:
        if layer in self.full_index:
            return self.full.attend(self.full_index[layer], q, k, v)
        return self._attend_window(self.cache.index[layer], q, k, v), None

    def resume(self, layer: int, suspension: Suspension) -> torch.Tensor:
        return self.full.resume(self.full_index[layer], suspension)

    def cohort(self, batch: ForwardBatch) -> WindowedAttention:
        return WindowedAttention(self.full.cohort(batch), self.cache, self.full_index, batch, self.workspace)

    @property
    def prefetching(self) -> bool:
        return self.full.prefetching

    def prefetch(self, layer: int, q: torch.Tensor) -> None:
        if layer in self.full_index:  # a sliding layer recalls nothing
            self.full.prefetch(self.full_index[layer], q)

    def finish(self) -> None:
        self.full.finish()

    def _attend_window(self, ring_layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        batch, step, window = self.batch, self.step, self.cache.window
        k_ring, v_ring = self.cache.k[ring_layer], self.cache.v[ring_layer]
        out = torch.empty_like(q)
        # prefills first: a chunk's writes overwrite the ring's older positions its own queries read
        for span, ring in zip(batch.prefills, step.prefill_rings):
            chunk, slots = slice(span.start, span.end), slice(ring * window, (ring + 1) * window)
            out[chunk] = window_prefill_attention(
                q[chunk], k[chunk], v[chunk], k_ring[slots], v_ring[slots], batch.positions[chunk], window
            )
        k_ring.index_copy_(0, step.write_slots, k[step.write_index])
        v_ring.index_copy_(0, step.write_slots, v[step.write_index])
        if batch.decode_index.numel():  # after the writes: a decode row attends its own token too
            rows = batch.decode_index
            out[rows] = decode_attention(q[rows], k_ring, v_ring, step.decode_rings, step.decode_lens, window, self.workspace)
        return out


def window_prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring_k: torch.Tensor, ring_v: torch.Tensor, positions: torch.Tensor, window: int
) -> torch.Tensor:
    """Queries of a chunk at `positions` (consecutive) over the ring holding the positions before it
    and the chunk's own k, v: each sees the keys at positions (p - window, p]."""
    start = int(positions[0])
    slots = torch.arange(window, device=q.device)
    ring_pos = start - 1 - (start - 1 - slots) % window  # the latest position before the chunk in each slot
    key_pos = torch.cat([ring_pos, positions])
    allowed = (key_pos[None, :] >= 0) & (key_pos[None, :] <= positions[:, None]) & (key_pos[None, :] > positions[:, None] - window)
    keys, values = (torch.cat(pair).transpose(0, 1).unsqueeze(0) for pair in ((ring_k, k), (ring_v, v)))
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys, values, attn_mask=allowed, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


class WindowedBackend:
    """The full layers' backend, with the sliding layers' rings beside it."""

    def __init__(self, full: AttentionBackend, cache: WindowCache, config: ModelConfig):
        self.full, self.cache = full, cache
        self.full_index = {layer: i for i, layer in enumerate(config.full_layers)}
        self.workspace = GatherWorkspace()

    def begin(self, plan: StepPlan, batch: ForwardBatch) -> WindowedAttention:
        return WindowedAttention(self.full.begin(plan, batch), self.cache, self.full_index, batch, self.workspace)
