"""Where a request runs and the device blocks it holds: resident or offloaded (IO-adaptive
admission under pressure, scheduler/admission.py), its blocks grown as it goes (cached blocks
evicted, the newest requests preempted where the pool is full), and released when it is
preempted or ends."""

from __future__ import annotations

import logging

from pulseinfer.scheduler.request import SeqStatus, Sequence

log = logging.getLogger("scheduler")


class Placement:
    """Mixed into Batcher (scheduler/batcher.py), whose __init__ sets the state these methods use:
    config, limits, allocator, link (the admission's model of the recall link), the queues
    (waiting, running) and the requests held for the link (_held); the prefix cache's side
    (scheduler/prefix_reuse.py) counts the cached blocks a request would reuse and evicts."""

    def _place(self, seq: Sequence) -> bool:
        """Decides whether the request at the head of the queue runs resident or offloaded; False
        when it must wait because its recall would not hide behind compute (and it cannot be resident)."""
        seq.offloaded = self._should_offload(seq)
        if not seq.offloaded or self.config.offload != "auto":
            return True
        running = sum(1 for s in self.running if s.offloaded)
        if running == 0 or self.link.hides(running + 1, len(self.running) + 1):
            return True
        if self._new_blocks(seq) <= self._free_blocks():
            seq.offloaded = False
            return True
        if seq.seq_id not in self._held:
            self._held.add(seq.seq_id)
            self.num_held_for_link += 1
            log.info("request %s waits: %d offloaded requests' recall would not hide behind compute", seq.seq_id, running + 1)
        return False

    def _should_offload(self, seq: Sequence) -> bool:
        """Resident while the device pool holds the request; offloaded when it cannot, or (auto) when
        the waiting requests do not all fit and it is among the longest, which free the most blocks."""
        if not self._can_offload:
            return False
        if self.config.offload == "always":
            return True
        new = self._new_blocks(seq)
        if new <= self.limits.offload_blocks:
            return False  # offloading would not save a block (a long cached prefix costs a resident request none)
        return new > self._free_blocks() or seq.seq_id in self._longest_under_pressure()

    def _longest_under_pressure(self) -> set[str]:
        """The longest waiting requests, just enough of them that the others fit resident in the
        free device pool when these hold only their offloaded footprint; empty without pressure.
        Those whose prefix the host tier caches beyond the device's go first: offloaded, they
        compute only the rest."""
        demand = sum(self._new_blocks(s) for s in self.waiting)
        free = self._free_blocks()
        if demand <= free:
            return set()
        chosen: set[str] = set()

        def cheap_then_longest(seq: Sequence) -> tuple[bool, int]:
            return self._host_cached_blocks(seq) > self.cached_prefix_blocks(seq), self._new_blocks(seq)

        for seq in sorted(self.waiting, key=cheap_then_longest, reverse=True):
            if demand <= free:
                break
            if self._new_blocks(seq) <= self.limits.offload_blocks:
                continue  # offloading it would not save a block
            demand -= self._new_blocks(seq) - self.limits.offload_blocks
            chosen.add(seq.seq_id)
        return chosen

    def _whole_blocks(self, seq: Sequence) -> int:
        """Device blocks the request needs to run resident to its end."""
        final = min(len(seq.prompt_ids) + seq.params.max_tokens, self.limits.max_position)
        return -(-final // self.limits.block_size)

    def _new_blocks(self, seq: Sequence) -> int:
        """Device blocks the request needs to run resident to its end beyond those it would reuse."""
        return self._whole_blocks(seq) - self.cached_prefix_blocks(seq)

    def _blocks_needed(self, seq: Sequence, tokens: int) -> int:
        have = self.allocator.count_of(seq.seq_id)
        if seq.offloaded:  # a fixed footprint, whatever the length
            return self.limits.offload_blocks - have
        return max(0, -(-tokens // self.limits.block_size) - have)

    def _grow(self, seq: Sequence, tokens: int) -> bool:
        need = self._blocks_needed(seq, tokens)
        if need <= 0:
            return True
        if need > self.allocator.num_free and self.prefix is not None:
            self._evict(need - self.allocator.num_free)
        if not self.allocator.can_allocate(need):
            return False
        self.allocator.allocate(seq.seq_id, need)
        return True

    def _reserve(self, seq: Sequence, tokens: int) -> bool:
        """Grows a decoding sequence, preempting the newest others (recompute later) if needed."""
        while not self._grow(seq, tokens):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _release_blocks(self, seq: Sequence) -> None:
        self.allocator.release(seq.seq_id)
        seq.num_cached = seq.num_computed = seq.num_named = 0
        seq.block_table = ()

    def _release(self, seq: Sequence) -> None:
        """Frees its blocks and ends its admission on its worker; tokens of its steps in flight are dropped."""
        self.allocator.release(seq.seq_id)
        if self.prefix is not None:  # what it leaves cached ages from now, its tail first
            self.prefix.touch(seq.block_names[: seq.num_named])
        if seq.handle >= 0:
            self.handles.end(seq)
            if seq.offloaded or self.limits.max_running:  # the worker holds state of its own for it
                self.released.append(seq.seq_id)
                self._releasing[seq.seq_id] = None
        seq.num_pending, seq.block_table = 0, ()

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_cached = seq.num_computed = seq.num_named = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
