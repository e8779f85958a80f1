"""The KV hierarchy on a worker (docs/prefix_cache.md): the device and host tiers' prefix caches as one.

Demotion: cached device blocks the scheduler evicted for a step are written to the host tier before
the step writes anything (the scheduler may grant them again in that very plan), then named there;
names the host tier has already are not written again. Promotion: the host blocks a resident
request's cached prefix goes on with, past the device tier's, are copied into its device blocks
(one gather per layer for the whole step) instead of being computed, and then let go of.

On CUDA the copies are kernels queued on the compute stream ahead of the step's forward: a promotion
is what the forward reads first, and a demotion's reads must precede the forward's writes. A
demotion's names are published once its copies have landed, checked without blocking at the next
step (or when the worker idles), so the step never waits for them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pulseinfer.gpu_worker.kv_cache import PagedKVCache
from pulseinfer.gpu_worker.offload.config import HostTier
from pulseinfer.gpu_worker.offload.manager import HOST_ERRORS, OffloadManager
from pulseinfer.kv_store.client import HostPoolLost
from pulseinfer.kv_store.prefix_cache import demotion_owner, promotion_owner
from pulseinfer.kv_store.view import PoolView
from pulseinfer.messages.plan import Chunk

log = logging.getLogger("gpu_worker")


@dataclass(frozen=True)
class Landing:
    """Demoted blocks written (or being written) to the host tier, named once `landed()`."""

    names: list[bytes]
    blocks: list[int]
    landed: Callable[[], bool]


class KVHierarchy:
    def __init__(self, cache: PagedKVCache, host: HostTier, offload: OffloadManager | None):
        """`offload`: the worker's offloaded requests, whose mapping of the host pool this shares
        (None: dense, this maps the pool itself)."""
        self.cache = cache
        self.host = host
        self.offload = offload
        self._view: PoolView | None = host.view if offload is None else None
        self.owner = demotion_owner(host.worker_id)
        self._landing: list[Landing] = []

    def step(self, demote: tuple[tuple[int, bytes], ...], chunks: tuple[Chunk, ...]) -> dict[str, str]:
        """Before a step: names the demotions that have landed, demotes the step's evicted blocks,
        then promotes its resident first chunks' host prefixes; returns the requests whose promotion
        failed, with why (their chunks cannot run)."""
        self._demote(demote)
        self.settle(wait=False)
        return self._promote([c for c in chunks if c.host_prefix and not c.offloaded])

    def settle(self, wait: bool) -> None:
        """Names the demoted blocks whose copies have landed (all of them with `wait`)."""
        if wait and self._landing and self.cache.k.is_cuda:
            torch.cuda.current_stream(self.cache.k.device).synchronize()
        while self._landing and (wait or self._landing[0].landed()):
            landing = self._landing.pop(0)
            try:
                self.host.allocator.insert(landing.names, landing.blocks, self.owner)
            except HOST_ERRORS as e:
                log.debug("%d demoted blocks stay unnamed: %s", len(landing.names), e)
                self._let_go()

    def release(self, owners: Sequence[str]) -> None:
        """Lets go of what `owners` hold in the host tier: a promotion's blocks once copied, those held
        for admissions that will not run (their scheduler went away), a demotion's reservation."""
        for owner in owners:
            try:
                self.host.allocator.release(owner)
            except HOST_ERRORS:
                pass  # a store that restarted or died holds none of them any more

    def detach(self) -> None:
        """The kv_store died: its pool and the demotions into it are gone. A dense worker unmaps it
        now; the next demotion or promotion maps the new one (an offloaded worker's manager does both)."""
        self._landing.clear()
        if self._view is not None:
            self._view.close()
            self._view = None

    # ------------------------------------------------------------ internals

    def _demote(self, demote: tuple[tuple[int, bytes], ...]) -> None:
        """Best effort: a block not demoted costs a later request its reuse, nothing else."""
        if not demote:
            return
        try:
            view = self._pool()  # first: after a kv_store restart, mapping the new pool registers this worker there
            reserved = self.host.allocator.reserve(self.owner, [name for _, name in demote])
            wanted = [(device, host, name) for (device, name), host in zip(demote, reserved) if host >= 0]
            if wanted:
                devices, hosts, names = map(list, zip(*wanted))
                self.cache.to_host(view, devices, hosts)
                self._landing.append(Landing(names, hosts, self._landed_marker()))
        except HOST_ERRORS as e:
            log.debug("%d evicted blocks not demoted: %s", len(demote), e)
            self._lost(e)
            self._let_go()

    def _promote(self, chunks: list[Chunk]) -> dict[str, str]:
        """One gather per layer of every chunk's host prefix into its device blocks; each chunk's host
        blocks are let go of after (also when the copy failed: the request then fails)."""
        if not chunks:
            return {}
        B = self.cache.spec.block_size
        hosts, devices = [], []
        for chunk in chunks:
            first = chunk.start_pos // B - len(chunk.host_prefix)
            hosts += chunk.host_prefix
            devices += chunk.block_table[first : first + len(chunk.host_prefix)]
        failed = {}
        try:
            self.cache.from_host(self._pool(), hosts, devices)
        except HOST_ERRORS as e:
            self._lost(e)
            failed = {c.seq_id: f"request {c.seq_id}: its cached prefix could not be loaded from the host tier: {e}" for c in chunks}
        self.release([promotion_owner(c.seq_id) for c in chunks])
        return failed

    def _landed_marker(self) -> Callable[[], bool]:
        """Whether the copies queued so far have landed: at once on the CPU, an event on CUDA."""
        if not self.cache.k.is_cuda:
            return lambda: True
        event = torch.cuda.Event()
        event.record()
        return event.query

    def _pool(self) -> PoolView:
        """The worker's mapping of the host pool, mapped anew after the kv_store restarted."""
        if self.offload is not None:
            if self.offload.view is None:
                self.offload.reattach()
            return self.offload.view
        if self._view is None:
            if self.host.reattach is None:
                raise HostPoolLost("the host pool is gone")
            self._view = self.host.reattach()
        return self._view

    def _lost(self, error: Exception) -> None:
        """A kv_store that restarted forgot this worker: its pool is mapped anew before the next copy."""
        if isinstance(error, HostPoolLost):
            if self.offload is not None:
                self.offload.detach()
            self.detach()

    def _let_go(self) -> None:
        """Drops every reservation of this worker's demotions (those still landing too)."""
        self._landing.clear()
        self.release([self.owner])
