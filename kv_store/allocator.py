"""Block allocator with per-owner block lists and reference counts.

Used for the host pool (kv_store) and for the scheduler's view of each worker's device pool.
"""

from __future__ import annotations

from collections import defaultdict


class PoolExhausted(RuntimeError):
    pass


class AllocatorCorrupt(RuntimeError):
    pass


class BlockAllocator:
    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"a pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._refs = [0] * num_blocks
        self._owned: dict[str, list[int]] = defaultdict(list)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_owners(self) -> int:
        return len(self._owned)

    def blocks_of(self, owner: str) -> list[int]:
        return list(self._owned.get(owner, ()))

    def count_of(self, owner: str) -> int:
        """len(blocks_of(owner)), without copying them (a scheduler asks per request per step)."""
        return len(self._owned.get(owner, ()))

    def can_allocate(self, count: int) -> bool:
        return count <= len(self._free)

    def allocate(self, owner: str, count: int) -> list[int]:
        """All or nothing: on exhaustion nothing is taken."""
        if count > len(self._free):
            raise PoolExhausted(f"need {count} blocks, {len(self._free)} of {self.num_blocks} free")
        blocks = [self._free.pop() for _ in range(count)]
        for block in blocks:
            self._refs[block] = 1
        self._owned[owner].extend(blocks)
        return blocks

    def share(self, owner: str, blocks: list[int]) -> None:
        """Give another owner a reference to blocks already in use."""
        for block in blocks:
            if self._refs[block] == 0:
                raise ValueError(f"block {block} is free and cannot be shared")
        for block in blocks:
            self._refs[block] += 1
        self._owned[owner].extend(blocks)

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def release_blocks(self, owner: str, blocks: list[int]) -> int:
        """Drops the owner's reference to each of `blocks`; returns how many became free."""
        owned = self._owned.get(owner, [])
        if not set(blocks) <= set(owned):
            raise ValueError(f"{owner!r} holds no reference to blocks {sorted(set(blocks) - set(owned))[:4]}")
        for block in blocks:
            owned.remove(block)
        if not owned:
            self._owned.pop(owner, None)
        return self._unref(blocks)

    def release(self, owner: str) -> int:
        """Drops every reference the owner holds; returns how many blocks became free."""
        return self._unref(self._owned.pop(owner, ()))

    def _unref(self, blocks) -> int:
        freed = 0
        for block in blocks:
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free.append(block)
                freed += 1
        return freed

    def check(self) -> None:
        """Integrity: free + used == total, reference counts match the owner lists."""
        counted = [0] * self.num_blocks
        for blocks in self._owned.values():
            for block in blocks:
                counted[block] += 1
        free = set(self._free)
        problems = []
        if len(free) != len(self._free):
            problems.append("a block is on the free list twice")
        if counted != self._refs:
            problems.append("reference counts disagree with owner lists")
        used = sum(1 for r in self._refs if r > 0)
        if used + len(free) != self.num_blocks or any(self._refs[b] for b in free):
            problems.append(f"free ({len(free)}) + used ({used}) != total ({self.num_blocks})")
        if problems:
            raise AllocatorCorrupt("block allocator corrupt: " + "; ".join(problems))
