"""The host tier's prefix cache as an offloaded request's worker sees it: a request starts from the
cached host blocks of its prefix (its sink and recent window read into its device footprint, the
key summaries of the rest computed from their keys: no model compute), and its full blocks are
named once written (sink blocks, which live on the device, first copied to host blocks of their own)."""

from __future__ import annotations

import torch

from pulseinfer.gpu_worker.kv_cache import PagedKVCache
from pulseinfer.gpu_worker.offload.layout import OffloadedSeq
from pulseinfer.gpu_worker.sparse import SummaryPool
from pulseinfer.kv_store.view import PoolView


def import_prefix(seq: OffloadedSeq, blocks: list[int], cache: PagedKVCache, view: PoolView, summaries: SummaryPool) -> None:
    """Makes `blocks` (host blocks of logical blocks 0..n-1, held for the request) its KV: one read
    of them per layer fills the sink and window slots and gives the host blocks' key summaries."""
    g = seq.geometry
    length = len(blocks) * g.block_size
    seq.host_blocks = list(blocks[g.sink_blocks :])
    on_device = list(range(min(g.sink_blocks, len(blocks)))) + list(seq.window(length))
    devs = torch.tensor([seq.device_block(j, length) for j in on_device], dtype=torch.long, device=cache.k.device)
    rows = torch.tensor(on_device, dtype=torch.long, device=cache.k.device)
    ids = torch.tensor(blocks, dtype=torch.long)
    seq.summary_slots = summaries.allocate(len(seq.host_blocks))
    slots = torch.tensor(seq.summary_slots, dtype=torch.long, device=cache.k.device)
    for layer in range(cache.shape.num_layers):
        units = view.read(ids, layer, cache.k.device)  # [blocks, K|V, kv_heads, block_size, dim]
        for i, cached in enumerate(cache.layer(layer)):
            cached.view(-1, g.block_size, *cached.shape[1:])[devs] = units[rows, i].transpose(1, 2)
        if seq.host_blocks:
            summaries.write(layer, slots, units[g.sink_blocks :, 0].transpose(1, 2))
    seq.length = length


def copy_sink(seq: OffloadedSeq, logical: list[int], host_blocks: list[int], cache: PagedKVCache, view: PoolView) -> None:
    """Writes the request's sink blocks `logical` to `host_blocks`, every layer."""
    cache.to_host(view, [seq.sink[j] for j in logical], host_blocks)
