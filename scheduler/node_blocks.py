"""The KV blocks this node holds, by name, in either tier, for the gateways' routers (docs/deployment.md, several nodes;
Scheduler.BlockEvents): each worker's device prefix cache tells its changes as they happen (its
PrefixCache observer), the host tier's are polled from the kv_store's journal. A name is held
while any worker or the host tier holds it; its arrival and departure are this node's events."""

from __future__ import annotations

from collections.abc import Iterable

from pulseinfer.kv_store.prefix_cache import BlockJournal
from pulseinfer.proto.pulseinfer.v1 import kv_store_pb2


class NodeBlocks:
    def __init__(self):
        self.holders: dict[bytes, int] = {}  # name -> how many device caches and host tier hold it
        self.host: set[bytes] = set()
        self.host_epoch = 0
        self.host_next = 0
        self.journal = BlockJournal()

    def device(self, names: list[bytes], stored: bool) -> None:
        """A worker's device prefix cache stored or dropped `names` (its observer)."""
        self._count(names, 1 if stored else -1)

    def host_events(self, events: kv_store_pb2.PrefixEvents) -> None:
        if events.snapshot:
            now = set(events.stored)
            self._count(self.host - now, -1)
            self._count(now - self.host, 1)
            self.host = now
        else:
            stored = [n for n in events.stored if n not in self.host]
            removed = [n for n in events.removed if n in self.host]
            self.host.update(stored)
            self.host.difference_update(removed)
            self._count(removed, -1)
            self._count(stored, 1)
        self.host_epoch, self.host_next = events.epoch, events.next

    def host_lost(self) -> None:
        """The kv_store does not answer: its pool (and the host tier) may be gone; a snapshot restores it."""
        self._count(self.host, -1)
        self.host, self.host_epoch, self.host_next = set(), 0, 0

    def _count(self, names: Iterable[bytes], delta: int) -> None:
        changed = []
        for name in names:
            count = self.holders.get(name, 0) + delta
            if count > 0:
                self.holders[name] = count
            else:
                self.holders.pop(name, None)
            if (delta > 0 and count == 1) or (delta < 0 and count == 0):
                changed.append(name)
        if changed:
            self.journal.record(changed, delta > 0)
