"""What a worker's offloaded requests recalled and wrote, summed since start. The recall counters
carry RecallStats' field names, the names the proto and /metrics use too."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

from pulseinfer.messages.plan import RECALL_FIELDS, RecallStats

T = TypeVar("T")


class RecallCounters:
    def __init__(self, num_layers: int):
        # plain counters under a lock: both threads add to them several times a layer (a RecallStats
        # built and summed per call cost ~2 ms a decode step)
        self._summed = dict.fromkeys(RECALL_FIELDS, 0)
        self._lock = threading.Lock()
        self.bytes_by_layer = [0] * num_layers
        self.decoded_rows = 0  # offloaded (request, step) decodes
        self.written_blocks = 0

    def add(self, **counts: float) -> None:
        with self._lock:
            for name, count in counts.items():
                self._summed[name] += count

    def snapshot(self) -> RecallStats:
        with self._lock:
            return RecallStats(**self._summed)

    def recalled(self, layer: int, units: int, transfers: int, size: int) -> None:
        """Units recalled for a layer, counted on the compute thread (the I/O thread adds only its busy time)."""
        self.add(units=units, transfers=transfers, bytes=size)
        self.bytes_by_layer[layer] += size

    def waiting(self, wait: Callable[..., T], *args) -> T:
        """Runs `wait`, counting its time as compute blocked on recalls."""
        started = time.perf_counter()
        try:
            return wait(*args)
        finally:
            self.add(wait_s=time.perf_counter() - started)
