"""The hot buffers: recalled blocks kept on the device, least recently selected evicted first."""

from __future__ import annotations

import torch

from pulseinfer.common.syncs import to_device
from pulseinfer.gpu_worker.offload.config import OffloadGeometry


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
        # unused blocks: older than any selection, in footprint order; the spare column: a block of the row's own
        stamps, devices = to_device([torch.arange(-self.capacity - 1, 0), torch.tensor((*hot, hot[0]))], self.held.device)
        self.held[row] = -1
        self.stamps[row] = stamps
        self.devices[row] = devices
        return row

    def clear(self, row: int) -> None:
        """Row `row` holds nothing (its device blocks are filled again as they are selected)."""
        self.held[row] = -1

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
