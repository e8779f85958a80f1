"""Automatic prefix caching of a worker's device KV pool, block-granular as vLLM's: each full
block of a request's tokens is named by a hash chained over its tokens and its prefix's hash, so
equal names mean equal tokens at equal positions, hence equal KV. A new request reuses every
full block of its longest cached prefix and prefills only the rest.

The cache holds one reference on each block it names (as the allocator owner CACHE_OWNER), so a
block outlives the request that computed it; requests that reuse it add theirs. A block only the
cache references is free to evict: least recently used first, and only when an allocation needs
room. Offloaded requests keep their KV in a fixed device footprint and the host pool, so they
neither reuse nor add device blocks here.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from pulseinfer.kv_store.allocator import BlockAllocator

CACHE_OWNER = "\0prefix-cache"  # no request id can be this (the APIs refuse control characters in ids)
ROOT = b""


def chain_hashes(ids: list[int], block_size: int, start: int, count: int, parent: bytes) -> list[bytes]:
    """Names of full blocks start..start+count-1 of `ids`, the first chained to `parent`."""
    out = []
    for i in range(start, start + count):
        parent = hashlib.blake2b(parent + array("I", ids[i * block_size : (i + 1) * block_size]).tobytes(), digest_size=16).digest()
        out.append(parent)
    return out


@dataclass
class PrefixStats:
    queried_tokens: int = 0  # prompt tokens of requests placed, resident or offloaded (once each)
    hit_tokens: int = 0  # of those, tokens whose KV came from the cache
    evicted_blocks: int = 0


class PrefixCache:
    def __init__(self, allocator: BlockAllocator, block_size: int):
        self.allocator = allocator
        self.block_size = block_size
        self.blocks: OrderedDict[bytes, int] = OrderedDict()  # name -> device block, least recently used first
        self.stats = PrefixStats()

    def __len__(self) -> int:
        return len(self.blocks)

    def match(self, names: list[bytes]) -> list[int]:
        """Device blocks of the longest cached prefix of `names`."""
        found = []
        for name in names:
            block = self.blocks.get(name)
            if block is None:
                break
            found.append(block)
        return found

    def acquire(self, owner: str, names: list[bytes]) -> int:
        """Gives `owner` a reference to each block of its longest cached prefix; returns how many."""
        blocks = self.match(names)
        self.allocator.share(owner, blocks)
        self.touch(names[: len(blocks)])
        return len(blocks)

    def touch(self, names: list[bytes]) -> None:
        """Marks a prefix's blocks used now, its head most recent: a tail is evicted before its head,
        which every longer prefix needs."""
        for name in reversed(names):
            if name in self.blocks:
                self.blocks.move_to_end(name)

    def insert(self, names: list[bytes], blocks: list[int]) -> None:
        """Names computed full blocks; a name already cached (computed twice at once) keeps its block."""
        for name, block in zip(names, blocks):
            if name in self.blocks:
                self.blocks.move_to_end(name)
                continue
            self.allocator.share(CACHE_OWNER, [block])
            self.blocks[name] = block

    def evictable(self) -> int:
        """Blocks only the cache references: free for the asking."""
        return sum(1 for block in self.blocks.values() if self.allocator.refcount(block) == 1)

    def evict(self, count: int) -> int:
        """Frees up to `count` blocks that only the cache references, least recently used first."""
        victims = []
        for name, block in self.blocks.items():
            if len(victims) == count:
                break
            if self.allocator.refcount(block) == 1:
                victims.append(name)
        blocks = [self.blocks.pop(name) for name in victims]
        self.allocator.release_blocks(CACHE_OWNER, blocks)
        self.stats.evicted_blocks += len(blocks)
        return len(blocks)

    def clear(self) -> int:
        """Drops every name; blocks that requests still hold stay theirs. Returns the blocks freed."""
        self.stats.evicted_blocks += len(self.blocks)
        self.blocks.clear()
        return self.allocator.release(CACHE_OWNER)
