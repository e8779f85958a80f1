"""The host KV pool: one POSIX shared-memory segment that every worker maps.

Layout `[host_block][layer][K|V][kv_head][token][dim]`: one (block, layer) recall unit with
all KV heads, K and V together, is one contiguous range of `unit_bytes`.
"""

from __future__ import annotations

import errno
import mmap
import os
from dataclasses import dataclass

from pulseinfer.gpu_worker.model.config import ModelConfig
from pulseinfer.kv_store.segments import Segment, pool_name

MADV_POPULATE_WRITE = 23  # Linux 5.14+; Python 3.11's mmap module lacks the name
PAGE = mmap.PAGESIZE
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def unit_bytes(kv_heads: int, block_size: int, head_dim: int, element_bytes: int) -> int:
    """One (block, layer) recall unit: K and V of every kv head of a block."""
    return 2 * kv_heads * block_size * head_dim * element_bytes


@dataclass(frozen=True)
class PoolGeometry:
    num_blocks: int
    num_layers: int
    unit_bytes: int

    @classmethod
    def for_model(cls, config: ModelConfig, block_size: int, tokens: int, dtype: str) -> PoolGeometry:
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"--kv-dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
        if tokens < block_size:
            raise ValueError(f"host KV pool of {tokens} tokens is smaller than one block ({block_size})")
        unit = unit_bytes(config.num_kv_heads, block_size, config.head_dim, DTYPE_BYTES[dtype])
        return cls(num_blocks=tokens // block_size, num_layers=config.num_layers, unit_bytes=unit)

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.unit_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.block_bytes


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
