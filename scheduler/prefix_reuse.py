"""The batcher's use of the prefix cache (kv_store/prefix_cache.py): the names of a request's full
blocks, the cached prefix a placement reuses (device blocks, and host blocks an offloaded request
starts from or a resident one promotes), the hits it counts, the blocks a step computed given to
the cache, and evictions (demoted to the host tier where the tiers are one hierarchy)."""

from __future__ import annotations

from pulseinfer.kv_store.prefix_cache import ROOT, chain_hashes, promotion_owner
from pulseinfer.scheduler.request import Sequence


class PrefixReuse:
    """Mixed into Batcher (scheduler/batcher.py), whose __init__ sets the state these methods use:
    limits, allocator, prefix (the device tier's cache, None when off), host (the host tier's),
    hierarchy, and the demotions and releases in flight (_demote, _demoting, _releasing)."""

    def _names(self, seq: Sequence, count: int, first: int = 0) -> tuple[bytes, ...]:
        """The prefix-cache names of the sequence's full blocks first..count-1 (computed once; a
        caller that wants only the new ones says so: at 32k tokens there are 2048)."""
        have, size = len(seq.block_names), self.limits.block_size
        if count > have:
            parent = seq.block_names[-1] if have else ROOT
            seq.block_names += tuple(chain_hashes(list(seq.ids(have * size, count * size)), size, 0, count - have, parent))
        return seq.block_names[first:count]

    def cached_prefix_blocks(self, seq: Sequence) -> int:
        """Full blocks of the request's longest cached prefix a resident placement would reuse.
        Placement across workers prefers the most."""
        if self.prefix is None:
            return 0
        return len(self.prefix.match(self._reusable_names(seq)))

    def _reusable_names(self, seq: Sequence) -> tuple[bytes, ...]:
        """Names of the full blocks a placement may reuse: all but the last token's (its logits
        sample the first output token, so it is always computed); none while it scores its prompt
        (every prompt row's logits are taken: the prompt is computed whole)."""
        if seq.scores_prompt:
            return ()
        return self._names(seq, (seq.length - 1) // self.limits.block_size)

    def _reuse_prefix(self, seq: Sequence, budget: int) -> tuple[int, ...]:
        """A request placed resident starts from the device blocks of its longest cached prefix, and
        the host blocks it goes on with (returned), which its worker promotes into its next device
        blocks: a host hit costs their bytes over the link, far less than computing them
        (docs/prefix_cache.md). The host tier is asked only once the device has room for a first chunk."""
        if self.prefix is None:
            return ()
        names = self._reusable_names(seq)
        count = len(self.prefix.acquire(seq.seq_id, names))
        room = self._grow(seq, min(seq.length, count * self.limits.block_size + budget))
        promoted = self._promote(seq, names[count:]) if room else ()
        seq.num_cached = seq.num_computed = (count + len(promoted)) * self.limits.block_size
        seq.num_named = count  # the promoted blocks are named in the device tier once copied (at the step's result)
        return promoted

    def _promote(self, seq: Sequence, names: tuple[bytes, ...]) -> tuple[int, ...]:
        """Host blocks of the longest prefix of `names` the host tier caches, held for the promotion."""
        if not self.hierarchy or not names or seq.seq_id in self._releasing:  # an earlier promotion of it is in flight
            return ()
        return tuple(self.host.acquire(promotion_owner(seq.seq_id), list(names)))

    def _awaits_demotion(self, seq: Sequence) -> bool:
        """Whether the block its cached prefix goes on with, past the device tier's, is being demoted:
        it waits a step or two for the host tier to have it rather than compute it (FCFS: the
        requests behind it wait too)."""
        if not self._demoting:
            return False
        names = self._reusable_names(seq)
        device = len(self.prefix.match(names))
        return device < len(names) and names[device] in self._demoting

    def _reuse_host_prefix(self, seq: Sequence) -> tuple[int, ...]:
        """A request placed offloaded starts from the host blocks of its longest cached prefix, held
        for it from now on (the worker frees them with the request's own)."""
        if self.host is None or seq.seq_id in self._releasing:  # its worker frees what it held first: nothing may be taken before
            return ()
        blocks = tuple(self.host.acquire(seq.seq_id, self._reusable_names(seq)))
        seq.num_cached = seq.num_computed = len(blocks) * self.limits.block_size
        return blocks

    def _host_cached_blocks(self, seq: Sequence) -> int:
        """Blocks of the request's prefix the host tier had cached when first asked (an estimate for
        admission: asked once per request, not at every step it waits)."""
        if self.host is None:
            return 0
        if seq.host_cached_blocks is None:
            seq.host_cached_blocks = self.host.match(self._reusable_names(seq))
        return seq.host_cached_blocks

    def _record_prefix_hit(self, seq: Sequence, cached: int, from_host: int) -> None:
        """The prompt tokens a request found cached (either tier; `from_host` of them in the host
        tier's) when it was first placed, as reported and counted."""
        if self.prefix is None or seq.cached_tokens is not None:
            return
        seq.cached_tokens = min(cached, len(seq.prompt_ids))
        self.prefix.stats.queried_tokens += len(seq.prompt_ids)
        self.prefix.stats.hit_tokens += seq.cached_tokens
        self.prefix.stats.host_hit_tokens += min(from_host, seq.cached_tokens)

    def _name_blocks(self, seq: Sequence) -> None:
        """Gives the cache the resident sequence's full blocks computed since the last step."""
        if self.prefix is None or seq.offloaded:
            return
        full = seq.num_computed // self.limits.block_size
        if full > seq.num_named:
            names = self._names(seq, full, seq.num_named)
            self.prefix.insert(names, self.allocator.blocks_of(seq.seq_id)[seq.num_named : full])
            seq.num_named = full

    def _evict(self, count: int) -> None:
        """Evicts cached device blocks no request holds; with the hierarchy they are demoted, by the
        next plan's worker before its step writes (the blocks may be granted in that very plan)."""
        evicted = self.prefix.evict(count)
        if self.hierarchy:
            self._demote += [(block, name) for name, block in evicted]
            self._demoting.update((name, None) for name, _ in evicted)
            self.prefix.stats.demoted_blocks += len(evicted)

    def _free_blocks(self) -> int:
        """Device blocks an allocation can have: the free ones and those only the prefix cache holds."""
        return self.allocator.num_free + (self.prefix.evictable() if self.prefix is not None else 0)

    def drop_prefix_cache(self) -> int:
        """Forgets every cached block; returns the blocks freed (those no request holds)."""
        return self.prefix.clear() if self.prefix is not None else 0
