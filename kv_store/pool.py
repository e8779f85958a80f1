"""The host KV pool: one POSIX shared-memory segment that every worker maps.

Its layout (`PoolGeometry`: one (block, layer) recall unit with all KV heads, K and V together,
is one contiguous range of `unit_bytes`) is in kv_store/layout.py.
"""

from __future__ import annotations

import errno
import mmap
import os

from pulseinfer.kv_store.layout import PoolGeometry
from pulseinfer.kv_store.segments import Segment, pool_name

MADV_POPULATE_WRITE = 23  # Linux 5.14+; Python 3.11's mmap module lacks the name
PAGE = mmap.PAGESIZE


def prefault(buffer: mmap.mmap) -> None:
    """Backs every page now, so the first recall never pays for a page fault (and a pool the
    machine cannot hold fails at start-up, not mid-request)."""
    try:
        buffer.madvise(MADV_POPULATE_WRITE)
    except OSError as e:
        if e.errno != errno.EINVAL:  # ENOMEM and the like: the machine cannot hold the pool
            raise
        for offset in range(0, len(buffer), PAGE):  # an older kernel: touch one byte per page
            buffer[offset] = 0


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


class SharedPool:
    """Owns the pool's segment (kv_store/segments.py): created exclusively and pre-faulted, unlinked on close."""

    def __init__(self, geometry: PoolGeometry, populate: bool = True):
        self.geometry = geometry
        self.segment = Segment(pool_name(), geometry.total_bytes)
        self.name = self.segment.name
        self.map = self.segment.map
        if populate:
            try:
                prefault(self.map)
            except OSError:
                self.close()
                raise

    def close(self) -> None:
        self.map.close()
        self.segment.close()
