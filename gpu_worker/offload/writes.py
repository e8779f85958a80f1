"""Where a step's new K/V of offloaded requests go: sink and window blocks to the device cache,
every block that fills (past the sink) to the host pool at once, with its key summary."""

from __future__ import annotations

import torch

from pulseinfer.common.syncs import to_device
from pulseinfer.gpu_worker.batch import ForwardBatch
from pulseinfer.gpu_worker.kv_cache import PagedKVCache
from pulseinfer.gpu_worker.offload.config import OffloadGeometry
from pulseinfer.gpu_worker.offload.layout import OffloadedSeq
from pulseinfer.gpu_worker.sparse import SummaryPool
from pulseinfer.kv_store.view import PoolView
from pulseinfer.messages.plan import Chunk


class StepWrites:
    """The chunks' write indices, built once per step (they do not depend on the layer)."""

    def __init__(self, seqs: list[OffloadedSeq], chunks: list[Chunk], batch: ForwardBatch, g: OffloadGeometry, cache: PagedKVCache):
        B = self.block_size = g.block_size
        # the new tokens of device blocks go straight to the cache; the host-bound blocks (full and past
        # the sink) are assembled in a buffer, one block per row: any earlier tokens of the chunk's
        # partly filled first block from the cache, the rest from the new tokens
        dev_slots, dev_tokens, prefix_buf, prefix_slots, host_buf, host_tokens = [], [], [], [], [], []
        host_ids, summary_slots, saved_buf, saved = [], [], [], []
        for seq, chunk in zip(seqs, chunks):
            start, end = chunk.start_pos, chunk.end_pos
            flat = batch.chunk_starts[chunk.seq_id] - start  # the flat token index of context position 0
            for j in range(start // B, (end - 1) // B + 1):
                lo, hi = max(start - j * B, 0), min(end - j * B, B)  # the block's new tokens, as offsets in it
                tokens = torch.arange(flat + j * B + lo, flat + j * B + hi)
                if j < g.sink_blocks or j >= g.window_start(end):
                    dev = seq.device_block(j, end)
                    dev_slots.append(torch.arange(dev * B + lo, dev * B + hi))
                    dev_tokens.append(tokens)
                if j >= g.sink_blocks and hi == B:
                    row0 = len(host_ids) * B
                    if lo and j >= g.sink_blocks and (end - 1) // B - j >= g.ring_blocks:
                        # the chunk wraps its ring onto this block: its earlier tokens are kept apart first,
                        # for this step and for running it again should it fail
                        saved_buf.append(torch.arange(row0, row0 + lo))
                        saved.append(seq.saved_prefix_of(start, cache))
                    elif lo:
                        dev = seq.device_block(j, start)
                        prefix_buf.append(torch.arange(row0, row0 + lo))
                        prefix_slots.append(torch.arange(dev * B, dev * B + lo))
                    host_buf.append(torch.arange(row0 + lo, row0 + B))
                    host_tokens.append(tokens)
                    host_ids.append(seq.host_blocks[j - g.sink_blocks])
                    summary_slots.append(seq.summary_slots[j - g.sink_blocks])

        def cat(parts: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)

        indices = [cat(parts) for parts in (dev_slots, dev_tokens, prefix_buf, prefix_slots, host_buf, host_tokens, saved_buf)]
        # the summary slot of each host block written, in host_ids' order
        *on_device, self.summary_slots = to_device([*indices, torch.tensor(summary_slots, dtype=torch.long)], batch.input_ids.device)
        self.dev_slots, self.dev_tokens, self.prefix_buf, self.prefix_slots, self.host_buf, self.host_tokens, self.saved_buf = on_device
        # [layers, rows, kv_heads, dim] of K and V: the saved earlier tokens, in saved_buf's rows
        self.saved = tuple(torch.cat(parts, dim=1) for parts in zip(*saved)) if saved else None
        self.host_ids = torch.tensor(host_ids, dtype=torch.long)  # indexes the host pool: stays on the CPU

    @property
    def host_blocks(self) -> int:
        """Blocks this step writes to the host pool (per layer)."""
        return self.host_ids.numel()

    def store(self, layer: int, cache: PagedKVCache, view: PoolView, summaries: SummaryPool, k: torch.Tensor, v: torch.Tensor) -> None:
        """Writes the chunks' new K/V: sink and window blocks to the device, newly full blocks to the host pool."""
        B, count = self.block_size, self.host_ids.numel()
        k_cache, v_cache = cache.layer(layer)
        blocks = []
        for i, (new, cached) in enumerate(((k, k_cache), (v, v_cache))):
            if count:  # read before the device writes (a wrapping chunk's prefix was saved at the step's start)
                buf = torch.empty((count * B, *cached.shape[1:]), dtype=cached.dtype, device=cached.device)
                buf[self.prefix_buf] = cached[self.prefix_slots]
                if self.saved is not None:
                    buf[self.saved_buf] = self.saved[i][layer]
                buf[self.host_buf] = new[self.host_tokens]
                blocks.append(buf.view(count, B, *cached.shape[1:]))
            cached.index_copy_(0, self.dev_slots, new[self.dev_tokens])
        if count:
            k_blocks, v_blocks = blocks
            view.write(self.host_ids, layer, k_blocks, v_blocks)
            summaries.write(layer, self.summary_slots, k_blocks)
