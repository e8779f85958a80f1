"""Sliding-window layers (Gemma 3's local layers, a windowed Mistral's): each running request holds
one ring of `window` slots per sliding layer on the device, whatever its context; position p
lives in slot p % window of its ring, so a ring always holds the last `window` positions, all a
query of these layers sees. Nothing of these layers is offloaded or recalled: a window is small
and read at every step. The full layers keep the paged cache and are the offloaded backend's
(vLLM's and SGLang's hybrid caches split the two the same way).

For the prefix cache, the sliding layers' KV of every resident token is also kept by its paged
slot (the history, beside the paged cache, of the same blocks): a request starting from a cached
prefix has its rings rebuilt from the history of the prefix's last `window` positions, which it
could not compute without the window before them, and so on back to the first token."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pulseinfer.common.memory import check_fits
from pulseinfer.common.model.config import ModelConfig
from pulseinfer.common.syncs import to_device
from pulseinfer.gpu_worker.attention.base import AttentionBackend, StepAttention, Suspension
from pulseinfer.gpu_worker.attention.paged import decode_attention
from pulseinfer.gpu_worker.batch import ForwardBatch
from pulseinfer.kernels.attention import GatherWorkspace
from pulseinfer.kernels.prefill_triton import window_prefill_attention_triton
from pulseinfer.messages.plan import StepPlan


class WindowCache:
    """The sliding layers' rings: K and V as [sliding layers, rings * ring_slots, kv_heads, head_dim].
    A ring is ceil(window / block_size) whole blocks (its first `window` slots used), so decode reads
    it as a block table like the paged cache's, with the same kernel."""

    def __init__(self, config: ModelConfig, rings: int, block_size: int, dtype: torch.dtype, device: torch.device, history_slots: int = 0):
        """`history_slots`: the paged cache's slots, whose sliding-layer KV is kept for the prefix
        cache (0: none kept, a request can only start from position 0)."""
        if rings < 1 or block_size < 1:
            raise ValueError(f"the sliding-window cache needs at least one request's ring and a block size, got {rings}, {block_size}")
        self.window, self.block_size = config.sliding_window, block_size
        self.ring_blocks = -(-self.window // block_size)
        self.ring_slots = self.ring_blocks * block_size
        self.index = {layer: i for i, layer in enumerate(config.sliding_layers)}  # model layer -> ring layer
        shape = (len(self.index), rings * self.ring_slots, config.num_kv_heads, config.head_dim)
        history = (len(self.index), history_slots, config.num_kv_heads, config.head_dim)
        for size, what in (
            (shape, f"the sliding-window KV of {rings} running requests (--max-running)"),
            (history, f"the sliding layers' KV of the device pool's {history_slots} tokens, for the prefix cache (--window-history)"),
        ):
            check_fits(2 * torch.Size(size).numel() * dtype.itemsize, device, what)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # zeros, as the paged cache's: a ring rebuilt from a block's unwritten tail reads them under a mask
        self.history_k = torch.zeros(history, dtype=dtype, device=device) if history_slots else None
        self.history_v = torch.zeros(history, dtype=dtype, device=device) if history_slots else None
        self.free = list(range(rings - 1, -1, -1))
        self.rings: dict[str, int] = {}  # seq_id -> its ring
        self.rebuilt = 0  # rings rebuilt from the history, since start

    @property
    def capacity(self) -> int:
        """Requests it holds at once: the scheduler runs no more."""
        return self.k.shape[1] // self.ring_slots

    def slots(self, ring: int) -> slice:
        """The slots of a ring that hold positions: position p in slot p % window."""
        return slice(ring * self.ring_slots, ring * self.ring_slots + self.window)

    @property
    def keeps_history(self) -> bool:
        return self.history_k is not None

    def admit(self, plan: StepPlan) -> dict[str, str]:
        """Frees the rings of the requests the plan released, then gives each new one a ring (rebuilt
        from the history when it starts from a cached prefix); the chunks of requests that cannot
        have one, with the reason (the scheduler's cap prevents it)."""
        self.release(plan.released)
        failed = {}
        for chunk in plan.chunks:
            if chunk.seq_id in self.rings:
                continue
            if chunk.start_pos > 0 and (not self.keeps_history or chunk.offloaded):
                failed[chunk.seq_id] = "this worker holds no sliding-window KV of the request's prefix"
            elif not self.free:
                failed[chunk.seq_id] = f"the sliding-window cache holds {self.capacity} requests, all running"
            else:
                self.rings[chunk.seq_id] = self.free.pop()
                if chunk.start_pos > 0:
                    self._rebuild(self.rings[chunk.seq_id], chunk.start_pos, chunk.block_table)
        return failed

    def rebuild(self, seq_id: str, start: int, block_table: tuple[int, ...]) -> None:
        """A running request's ring as it was before position `start` (a failed step's chunk runs again)."""
        self._rebuild(self.rings[seq_id], start, block_table)

    def _rebuild(self, ring: int, start: int, block_table: tuple[int, ...]) -> None:
        """The ring of a request starting at `start` holds positions start - window .. start - 1,
        each read from the history at its slot in the request's blocks: one gather per K and V."""
        B = self.block_size
        positions = torch.arange(max(0, start - self.window), start)
        table = torch.tensor(block_table[: -(-start // B)], dtype=torch.long)
        source = table[positions // B] * B + positions % B
        target = self.slots(ring).start + positions % self.window
        source, target = to_device([source, target], self.k.device)
        self.rebuilt += 1
        self.k[:, target] = self.history_k[:, source]
        self.v[:, target] = self.history_v[:, source]

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
    decode_tables: torch.Tensor  # [b, ring_blocks]: each decode row's ring, as a block table
    decode_lens: torch.Tensor  # [b]: positions its ring holds, its own included (slots 0 .. len-1)
    prefill_rings: tuple[int, ...]  # per prefill span

    @classmethod
    def of(cls, batch: ForwardBatch, cache: WindowCache) -> WindowStep:
        """Made on the host from what the batch knows there (its host indices, seq ids and spans) and
        moved in one non-blocking copy; the positions stay on the device: nothing is read back."""
        window, device = cache.window, batch.positions.device
        chunks = [(i, i + 1, seq_id) for i, seq_id in zip(batch.host.decode_index.tolist(), batch.decode_seq_ids)]
        chunks += [(span.start, span.end, span.seq_id) for span in batch.prefills]
        written = [torch.arange(max(start, end - window), end) for start, end, _ in chunks]
        bases = [torch.full((len(index),), cache.slots(cache.rings[seq_id]).start) for index, (_, _, seq_id) in zip(written, chunks)]
        rings = torch.tensor([cache.rings[seq_id] for seq_id in batch.decode_seq_ids], dtype=torch.long)
        empty = torch.empty(0, dtype=torch.long)
        write_index, base, rings = to_device([torch.cat([empty, *written]), torch.cat([empty, *bases]), rings], device)
        return cls(
            write_index=write_index,
            write_slots=base + batch.positions[write_index] % window,
            decode_tables=rings[:, None] * cache.ring_blocks + torch.arange(cache.ring_blocks, device=device),
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
        batch, step, cache, window = self.batch, self.step, self.cache, self.cache.window
        k_ring, v_ring = self.cache.k[ring_layer], self.cache.v[ring_layer]
        out = torch.empty_like(q)
        # prefills first: a chunk's writes overwrite the ring's older positions its own queries read
        prefill = window_prefill_attention_triton if q.is_cuda else window_prefill_attention
        for span, ring in zip(batch.prefills, step.prefill_rings):
            chunk, slots = slice(span.start, span.end), cache.slots(ring)
            start = span.ctx_len - (span.end - span.start)  # the chunk's first position, known here without a sync
            out[chunk] = prefill(q[chunk], k[chunk], v[chunk], k_ring[slots], v_ring[slots], start, window)
        k_ring.index_copy_(0, step.write_slots, k[step.write_index])
        v_ring.index_copy_(0, step.write_slots, v[step.write_index])
        if cache.keeps_history:  # every resident token's, at its paged slot, as the full layers write theirs
            cache.history_k[ring_layer].index_copy_(0, batch.write_slots, k[batch.resident_index])
            cache.history_v[ring_layer].index_copy_(0, batch.write_slots, v[batch.resident_index])
        if batch.decode_index.numel():  # after the writes: a decode row attends its own token too
            rows = batch.decode_index
            out[rows] = decode_attention(q[rows], k_ring, v_ring, step.decode_tables, step.decode_lens, cache.block_size, self.workspace)
        return out


def window_prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring_k: torch.Tensor, ring_v: torch.Tensor, start: int, window: int
) -> torch.Tensor:
    """Queries of a chunk at positions start .. start+n-1 over the ring holding the positions before
    it and the chunk's own k, v: each sees the keys at positions (p - window, p]. The torch reference
    of window_prefill_attention_triton; the CPU runs it."""
    positions = torch.arange(start, start + q.shape[0], device=q.device)
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
