"""Compact integer names of a worker's running admissions (docs/architecture.md)."""

from __future__ import annotations

import heapq
from collections import deque

from pulseinfer.scheduler.request import Sequence


class Handles:
    """Compact integer names of a worker's running admissions, inside the cluster. A handle is used
    again only once the results of every step planned before its admission ended have come back, so a
    late result can never be taken for another request's; the smallest free one first keeps them short
    on the wire."""

    def __init__(self) -> None:
        self.running: dict[int, Sequence] = {}
        self.ended: list[int] = []  # for the next plan
        self._free: list[int] = []  # a heap
        self._next = 0
        self._retiring: deque[tuple[int, list[int]]] = deque()  # (step that released them, handles)

    def new(self, seq: Sequence) -> int:
        handle = heapq.heappop(self._free) if self._free else self._take_next()
        self.running[handle] = seq
        return handle

    def _take_next(self) -> int:
        self._next += 1
        return self._next - 1

    def unused(self, seq: Sequence) -> None:
        """An admission that was never sent."""
        del self.running[seq.handle]
        heapq.heappush(self._free, seq.handle)
        seq.handle = -1

    def end(self, seq: Sequence) -> None:
        del self.running[seq.handle]
        self.ended.append(seq.handle)
        seq.handle = -1

    def send_ended(self, step_id: int) -> tuple[int, ...]:
        ended, self.ended = tuple(self.ended), []
        if ended:
            self._retiring.append((step_id, list(ended)))
        return ended

    def step_done(self, step_id: int) -> None:
        while self._retiring and self._retiring[0][0] <= step_id:
            for handle in self._retiring.popleft()[1]:
                heapq.heappush(self._free, handle)
