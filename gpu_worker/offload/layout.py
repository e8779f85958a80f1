"""Where an offloaded request's KV lives: its device footprint (sink blocks, a ring of recent-window
blocks, hot-buffer blocks), its host blocks, and reading its whole context back in position order."""

from __future__ import annotations

import torch

from pulseinfer.gpu_worker.kv_cache import PagedKVCache
from pulseinfer.gpu_worker.offload.config import OffloadGeometry
from pulseinfer.kernels.attention import GatherWorkspace
from pulseinfer.kv_store.view import PoolView


class OffloadedSeq:
    """One offloaded request's KV on this worker: where each logical block lives (the hot buffer's
    blocks: row `hot_row` of the worker's HotBuffers)."""

    def __init__(self, seq_id: str, footprint: tuple[int, ...], geometry: OffloadGeometry, hot_row: int):
        g = geometry
        self.seq_id = seq_id
        self.footprint = footprint
        self.geometry = geometry
        self.sink = footprint[: g.sink_blocks]
        self.ring = footprint[g.sink_blocks : g.sink_blocks + g.ring_blocks]
        self.length = 0  # tokens whose KV is stored
        self.host_blocks: list[int] = []  # host block of logical block sink_blocks + i
        self.summary_slots: list[int] = []  # the worker's SummaryPool slot of each host block
        self.hot_row = hot_row
        # (start, K, V [layers, tokens, kv_heads, dim]): the tokens before `start` of its block, kept apart
        # for a chunk from `start` that overwrites their ring slot (StepWrites)
        self.saved_prefix: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def saved_prefix_of(self, start: int, cache: PagedKVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every layer at positions of start's block before `start`, read from the ring
        before a chunk from `start` overwrites them, once: a run of the chunk again reads them here."""
        if self.saved_prefix is None or self.saved_prefix[0] != start:
            B = self.geometry.block_size
            first = self.device_block(start // B, start) * B
            slots = torch.arange(first, first + start % B, device=cache.k.device)
            self.saved_prefix = (start, cache.k[:, slots], cache.v[:, slots])
        return self.saved_prefix[1:]

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


def context_kv(
    seq: OffloadedSeq, layer: int, cache: PagedKVCache, view: PoolView, length: int, workspace: GatherWorkspace
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of positions [0, length) of an offloaded request (sink and window from the
    device, the rest read back from the host pool): [blocks * block_size, kv_heads, dim]."""
    g = seq.geometry
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
        units = view.read(torch.tensor(seq.host_blocks[: len(hosted)], dtype=torch.long), layer, k_cache.device)
        for i, out in enumerate((k_out, v_out)):
            out[hosted.start : hosted.stop] = units[:, i].transpose(1, 2).reshape(len(hosted), -1)
    shape = (blocks * B, *k_cache.shape[1:])
    return k_out.view(shape), v_out.view(shape)
