"""Automatic prefix caching, block-granular as vLLM's: each full block of a request's tokens is
named by a hash chained over its tokens and its prefix's hash, so equal names mean equal tokens at
equal positions, hence equal KV. A new request reuses every full block of its longest cached prefix
and prefills only the rest.

One PrefixCache per tier: the scheduler's view of each worker's device pool (resident requests),
and the kv_store's host pool (HostBlocks, the pool's allocator with its cache). The cache holds one
reference on each block it names (as the allocator owner CACHE_OWNER), so a block outlives the
request that computed it; requests that reuse it add theirs. A block only the cache references is
free to evict: least recently used first, and only when an allocation needs room.

The two tiers are one hierarchy (docs/prefix_cache.md): a device block evicted is demoted, written to the
host tier under its name unless that tier has it already; a resident request whose prefix goes on
in the host tier past the device's promotes those blocks into device blocks instead of computing
them. Offloaded requests reuse host blocks in place. The host tier's own LRU decides what it keeps.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from pulseinfer.kv_store.allocator import BlockAllocator

CACHE_OWNER = "\0prefix-cache"  # no request id can be this (the APIs refuse control characters in ids)
ROOT = b""
NAME_BYTES = 16


def chain_hashes(ids: list[int], block_size: int, start: int, count: int, parent: bytes) -> list[bytes]:
    """Names of full blocks start..start+count-1 of `ids`, the first chained to `parent`."""
    out = []
    for i in range(start, start + count):
        parent = hashlib.blake2b(parent + array("I", ids[i * block_size : (i + 1) * block_size]).tobytes(), digest_size=NAME_BYTES).digest()
        out.append(parent)
    return out


@dataclass
class PrefixStats:
    queried_tokens: int = 0  # prompt tokens of requests placed, resident or offloaded (once each)
    hit_tokens: int = 0  # of those, tokens whose KV came from the cache
    host_hit_tokens: int = 0  # of those, from the host tier's cache (offloaded placements, and promotions)
    evicted_blocks: int = 0
    promoted_blocks: int = 0  # host blocks loaded into device blocks for a resident placement
    demoted_blocks: int = 0  # evicted device blocks sent to the host tier (the device side's count)


Observer = Callable[[list[bytes], bool], None]  # names stored (True) or removed (False)


class PrefixCache:
    def __init__(self, allocator: BlockAllocator, observer: Observer | None = None):
        """`observer` hears every name the cache starts or stops holding (block events, docs/deployment.md, several nodes)."""
        self.allocator = allocator
        self.blocks: OrderedDict[bytes, int] = OrderedDict()  # name -> device block, least recently used first
        self.stats = PrefixStats()
        self.observer = observer

    def __len__(self) -> int:
        return len(self.blocks)

    def __contains__(self, name: bytes) -> bool:
        return name in self.blocks

    def match(self, names: list[bytes]) -> list[int]:
        """Device blocks of the longest cached prefix of `names`."""
        found = []
        for name in names:
            block = self.blocks.get(name)
            if block is None:
                break
            found.append(block)
        return found

    def acquire(self, owner: str, names: list[bytes]) -> list[int]:
        """Gives `owner` a reference to each block of its longest cached prefix; returns them."""
        blocks = self.match(names)
        self.allocator.share(owner, blocks)
        self.touch(names[: len(blocks)])
        return blocks

    def touch(self, names: list[bytes]) -> None:
        """Marks a prefix's blocks used now, its head most recent: a tail is evicted before its head,
        which every longer prefix needs."""
        for name in reversed(names):
            if name in self.blocks:
                self.blocks.move_to_end(name)

    def insert(self, names: list[bytes], blocks: list[int]) -> None:
        """Names computed full blocks; a name already cached (computed twice at once) keeps its block."""
        new = []
        for name, block in zip(names, blocks):
            if name in self.blocks:
                self.blocks.move_to_end(name)
                continue
            self.allocator.share(CACHE_OWNER, [block])
            self.blocks[name] = block
            new.append(name)
        if new and self.observer:
            self.observer(new, True)

    def evictable(self) -> int:
        """Blocks only the cache references: free for the asking."""
        return sum(1 for block in self.blocks.values() if self.allocator.refcount(block) == 1)

    def evict(self, count: int) -> list[tuple[bytes, int]]:
        """Frees up to `count` blocks that only the cache references, least recently used first;
        returns them with their names (the device tier demotes them)."""
        victims = []
        for name, block in self.blocks.items():
            if len(victims) == count:
                break
            if self.allocator.refcount(block) == 1:
                victims.append(name)
        evicted = [(name, self.blocks.pop(name)) for name in victims]
        self.allocator.release_blocks(CACHE_OWNER, [block for _, block in evicted])
        self.stats.evicted_blocks += len(evicted)
        if victims and self.observer:
            self.observer(victims, False)
        return evicted

    def clear(self) -> int:
        """Drops every name; blocks that requests still hold stay theirs. Returns the blocks freed."""
        self.stats.evicted_blocks += len(self.blocks)
        if self.blocks and self.observer:
            self.observer(list(self.blocks), False)
        self.blocks.clear()
        return self.allocator.release(CACHE_OWNER)


class HostPrefix(Protocol):
    """The host tier's prefix cache as a worker's batcher asks it (HostBlocks in-process; the
    kv_store across processes)."""

    def match(self, names: list[bytes]) -> int: ...

    def acquire(self, owner: str, names: list[bytes]) -> list[int]: ...

    def release(self, owner: str) -> int: ...


def promotion_owner(seq_id: str) -> str:
    """Who holds the host blocks a resident placement promotes, until its worker has copied them:
    not the request itself, whose id may hold host blocks of its own (no request id has a control
    character)."""
    return seq_id + "\x01promote"


def demotion_owner(worker_id: int) -> str:
    """Who holds the host blocks a worker's demotions write, until they are named."""
    return f"\x01demote-w{worker_id}"


class HostBlocks:
    """The host pool's blocks: an allocator whose allocations evict cached blocks no request holds
    when the pool is short of free ones, and the prefix cache of the offloaded requests' blocks.
    The kv_store serves it to its workers; the in-process engine uses it directly."""

    def __init__(self, num_blocks: int):
        self.allocator = BlockAllocator(num_blocks)
        self.journal = BlockJournal()
        self.prefix = PrefixCache(self.allocator, self.journal.record)

    def allocate(self, owner: str, count: int) -> list[int]:
        short = count - self.allocator.num_free
        if short > 0:
            self.prefix.evict(short)
        return self.allocator.allocate(owner, count)

    def release(self, owner: str) -> int:
        return self.allocator.release(owner)

    def match(self, names: list[bytes]) -> int:
        """Blocks of the longest cached prefix of `names`."""
        return len(self.prefix.match(names))

    def acquire(self, owner: str, names: list[bytes]) -> list[int]:
        """Host blocks of the longest cached prefix of `names`, each now also referenced by `owner`."""
        return self.prefix.acquire(owner, names)

    def insert(self, names: list[bytes], blocks: list[int], owner: str = "") -> None:
        """Names blocks a request holds (full, written); raises ValueError for a free block. With
        `owner` (a demotion's reservation), its references to the blocks are dropped after."""
        if len(names) != len(blocks):
            raise ValueError(f"{len(names)} names for {len(blocks)} blocks")
        for block in blocks:
            if not 0 <= block < self.allocator.num_blocks or self.allocator.refcount(block) == 0:
                raise ValueError(f"block {block} is not in use and cannot be named")
        if owner and not set(blocks) <= set(self.allocator.blocks_of(owner)):
            raise ValueError(f"{owner!r} did not reserve blocks {sorted(set(blocks) - set(self.allocator.blocks_of(owner)))[:4]}")
        self.prefix.insert(names, blocks)
        if owner:
            self.allocator.release_blocks(owner, blocks)
            self.prefix.stats.demoted_blocks += len(blocks)

    def reserve(self, owner: str, names: list[bytes]) -> list[int]:
        """A host block held by `owner` for each name not cached yet, to demote it into; -1 for a
        name cached already (touched: it is in use again) or one there is no room for."""
        missing = [name for name in names if name not in self.prefix]
        self.prefix.touch([name for name in names if name in self.prefix])
        room = self.allocator.num_free + self.prefix.evictable()
        blocks = iter(self.allocate(owner, min(len(missing), room)) if missing and room else [])
        wanted = set(missing[:room])
        return [next(blocks) if name in wanted else -1 for name in names]

    def drop_prefix_cache(self) -> int:
        return self.prefix.clear()


@dataclass(frozen=True)
class BlockEvents:
    """What a reader of a BlockJournal gets: the names stored and removed since its last read or,
    for a reader that is new, fell behind or read a journal since restarted (epoch), a snapshot:
    every name held now (`stored`; forget what you had)."""

    epoch: int
    next: int  # ask `since` this next time
    snapshot: bool
    stored: list[bytes]
    removed: list[bytes]


class BlockJournal:
    """A tier's block events (docs/deployment.md, several nodes), numbered and bounded: readers pull what changed since
    their last number, so none is pushed to and a slow one costs a snapshot, not memory."""

    def __init__(self, capacity: int = 1 << 16):
        self.epoch = int.from_bytes(os.urandom(7), "little")  # a restarted holder's journal is a new one
        self.next = 0
        self.entries: deque[tuple[bytes, bool]] = deque(maxlen=capacity)
        self.listeners: list[Callable[[], None]] = []  # told after each record (a streaming reader's wake-up)

    def record(self, names: list[bytes], stored: bool) -> None:
        self.entries.extend((name, stored) for name in names)
        self.next += len(names)
        for listener in self.listeners:
            listener()

    def since(self, epoch: int, position: int, held: Callable[[], Iterable[bytes]]) -> BlockEvents:
        """Events after `position` of journal `epoch`; `held`: every name held now, for a snapshot."""
        first = self.next - len(self.entries)
        if epoch != self.epoch or not first <= position <= self.next:
            return BlockEvents(self.epoch, self.next, True, list(held()), [])
        final = dict(itertools.islice(self.entries, position - first, None))  # a name's last event is its state
        stored = [name for name, is_stored in final.items() if is_stored]
        return BlockEvents(self.epoch, self.next, False, stored, [name for name, is_stored in final.items() if not is_stored])
