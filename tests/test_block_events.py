"""Block events (docs/deployment.md, several nodes): a tier's journal read from where a reader left off or as a
snapshot, a node's union of its workers' device caches and its host tier, and the batches the
scheduler streams to gateways."""

from __future__ import annotations

from pulseinfer.kv_store.allocator import BlockAllocator
from pulseinfer.kv_store.prefix_cache import BlockJournal, PrefixCache
from pulseinfer.proto.pulseinfer.v1 import kv_store_pb2
from pulseinfer.scheduler.node_blocks import NodeBlocks
from pulseinfer.scheduler.server import event_batches

A, B, C, D = (bytes([i]) * 16 for i in range(4))


def test_a_reader_gets_what_changed_since_it_read_and_a_snapshot_otherwise():
    journal = BlockJournal(capacity=4)
    held = {A, B}
    journal.record([A, B], True)
    first = journal.since(0, 0, lambda: held)
    assert first.snapshot and set(first.stored) == {A, B}  # a new reader (no epoch): a snapshot
    journal.record([A], False)
    journal.record([A, C], True)  # removed, then stored again: its last event counts
    journal.record([B], False)
    changed = journal.since(first.epoch, first.next, lambda: held)
    assert not changed.snapshot and set(changed.stored) == {A, C} and changed.removed == [B]
    journal.record([D, D, D], True)  # the reader's position falls out of the bounded journal
    assert journal.since(changed.epoch, changed.next - 2, lambda: {A, C, D}).snapshot  # 9 recorded, 4 kept: 4 is gone
    assert journal.since(changed.epoch + 1, changed.next, lambda: set()).snapshot  # another journal (a restart)


def test_a_prefix_cache_tells_its_observer_what_it_stores_and_drops():
    heard = []
    cache = PrefixCache(BlockAllocator(8), lambda names, stored: heard.append((names, stored)))
    blocks = cache.allocator.allocate("r", 3)
    cache.insert([A, B, C], blocks)
    cache.insert([A], blocks[:1])  # already held: no event, but used now (B is the least recent)
    cache.allocator.release("r")
    cache.evict(1)
    cache.clear()
    assert heard == [([A, B, C], True), ([B], False), ([C, A], False)]


def test_a_node_holds_a_name_while_any_worker_or_the_host_tier_does():
    node = NodeBlocks()
    node.device([A, B], True)  # worker 0
    node.device([B], True)  # worker 1
    node.host_events(kv_store_pb2.PrefixEvents(epoch=5, next=2, snapshot=True, stored=[B, C]))
    node.device([B], False)
    node.host_events(kv_store_pb2.PrefixEvents(epoch=5, next=3, removed=[C], stored=[D]))
    assert set(node.holders) == {A, B, D} and node.host == {B, D}
    node.host_lost()
    assert set(node.holders) == {A, B}
    events = node.journal.since(0, 0, lambda: node.holders)
    assert events.snapshot and set(events.stored) == {A, B}
    replay = node.journal.since(node.journal.epoch, 0, lambda: node.holders)  # everything, in order
    assert set(replay.stored) == {A, B} and set(replay.removed) == {C, D}


def test_a_large_snapshot_streams_in_batches_only_the_first_clearing():
    journal = BlockJournal()
    names = [i.to_bytes(16, "little") for i in range(150_000)]
    batches = event_batches(journal.since(1, 0, lambda: names))
    assert [b.snapshot for b in batches] == [True, False, False]
    assert [n for b in batches for n in b.stored] == names and all(b.ByteSize() < 4 << 20 for b in batches)
