import random

import pytest

from pulseinfer.kv_store.allocator import AllocatorCorrupt, BlockAllocator, PoolExhausted


def test_allocate_release_roundtrip():
    alloc = BlockAllocator(10)
    a = alloc.allocate("a", 4)
    b = alloc.allocate("b", 6)
    assert sorted(a + b) == list(range(10))
    assert alloc.num_free == 0
    with pytest.raises(PoolExhausted):
        alloc.allocate("c", 1)
    assert alloc.blocks_of("a") == a  # a failed allocation takes nothing
    assert alloc.release("a") == 4
    alloc.check()
    assert alloc.num_free == 4


def test_shared_blocks_free_with_last_reference():
    alloc = BlockAllocator(4)
    blocks = alloc.allocate("a", 2)
    alloc.share("b", blocks)
    assert alloc.release("a") == 0
    assert alloc.num_free == 2
    assert alloc.release("b") == 2
    alloc.check()
    with pytest.raises(ValueError):
        alloc.share("c", blocks)


def test_random_workload_keeps_integrity():
    rng = random.Random(0)
    alloc = BlockAllocator(64)
    owners = []
    for i in range(2000):
        if owners and rng.random() < 0.45:
            alloc.release(owners.pop(rng.randrange(len(owners))))
        else:
            n = rng.randint(1, 8)
            if alloc.can_allocate(n):
                alloc.allocate(f"o{i}", n)
                owners.append(f"o{i}")
        alloc.check()
    for owner in owners:
        alloc.release(owner)
    alloc.check()
    assert alloc.num_free == 64


def test_check_detects_corruption():
    alloc = BlockAllocator(4)
    alloc.allocate("a", 2)
    alloc._free.append(alloc.blocks_of("a")[0])  # simulate a double free
    with pytest.raises(AllocatorCorrupt):
        alloc.check()
