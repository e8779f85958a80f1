"""Continuous batching: every step decodes all running sequences and fills the rest of the
token budget with prefill chunks (of running sequences first, then of waiting ones, FCFS).

Pure Python, no I/O: the scheduler process and the in-process engine drive the same code.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass

from pulseinfer.kv_store.allocator import BlockAllocator
from pulseinfer.kv_store.prefix_cache import ROOT, HostPrefix, Observer, PrefixCache, chain_hashes, promotion_owner
from pulseinfer.messages.limits import PREFILL_CHUNK
from pulseinfer.messages.plan import PENDING_TOKEN, Admission, BlockNames, Chunk, RecallStats, SampledToken, StepPlan
from pulseinfer.messages.sampling import FinishReason
from pulseinfer.scheduler.admission import LinkModel
from pulseinfer.scheduler.handles import Handles
from pulseinfer.scheduler.request import SeqStatus, Sequence

OFFLOAD_POLICIES = ("never", "auto", "always")
PREFIX_CACHE = ("on", "off")

log = logging.getLogger("scheduler")


class QueueFull(RuntimeError):
    pass


SCORE_PROMPT_WITH = ("prefill", "decode")


class RequestTooLarge(ValueError):
    pass


@dataclass(frozen=True)
class BatcherConfig:
    max_batch_size: int = 64  # sequences decoded together
    prefill_chunk: int = PREFILL_CHUNK
    max_waiting: int = 1024  # bounded queue: beyond this, new requests are refused
    # never | auto (IO-adaptive admission, scheduler/admission.py) | always (every request, where the
    # worker has a host pool and its device pool holds an offloaded request's footprint)
    offload: str = "auto"
    # decode rows ride along with prefill chunks (chunked prefill); off: a step prefills or decodes,
    # prefill first (SGLang's default), so every admitted request is decoding before decode resumes
    mixed_steps: bool = True
    # on: a request reuses the blocks of its longest cached prefix (kv_store/prefix_cache.py): device
    # blocks resident, host blocks offloaded. A model with sliding-window layers reuses device blocks
    # only, where its worker keeps those layers' KV of them (--window-history; the host tier has none)
    prefix_cache: str = "on"
    # on (with the prefix cache, on a worker that maps the kv_store's pool): the tiers are one
    # hierarchy: cached device blocks evicted are demoted to the host tier, and a resident request
    # promotes the host blocks its cached prefix goes on with. off: each tier serves its own
    # placements only (device evictions are dropped; offloaded requests still reuse host blocks)
    host_prefix_cache: str = "on"
    # prefill: a request's prompt logprobs come from its prefill chunks (dense attention, as the anchors
    # compute them). decode: its prompt tokens from position --score-from on run one per step as decode
    # rows of the serving mode (sparse selection, offloaded KV), teacher-forced, so a loglikelihood eval
    # measures the sparse path; a step per token (README "Logprobs")
    score_prompt_with: str = "prefill"
    score_from: int = 0

    def __post_init__(self) -> None:
        if self.score_prompt_with not in SCORE_PROMPT_WITH:
            raise ValueError(f"--score-prompt-with must be one of {', '.join(SCORE_PROMPT_WITH)}, got {self.score_prompt_with!r}")
        if self.score_from < 0:
            raise ValueError(f"--score-from must be >= 0, got {self.score_from}")
        if self.offload not in OFFLOAD_POLICIES:
            raise ValueError(f"--offload must be one of {', '.join(OFFLOAD_POLICIES)}, got {self.offload!r}")
        for flag, value in (("--prefix-cache", self.prefix_cache), ("--host-prefix-cache", self.host_prefix_cache)):
            if value not in PREFIX_CACHE:
                raise ValueError(f"{flag} must be one of {', '.join(PREFIX_CACHE)}, got {value!r}")


@dataclass(frozen=True)
class ModelLimits:
    max_position: int
    eos_id: int | None
    block_size: int
    offload_blocks: int = 0  # device blocks an offloaded request holds; 0: the worker cannot offload
    max_running: int = 0  # requests the worker runs at once (its sliding-window rings); 0: no cap of its own
    host_tier: bool = False  # the worker maps the host pool: it can demote device blocks and promote host ones
    # on a model with sliding-window layers (max_running > 0): the worker keeps their KV of its device
    # blocks, so a request can start from a cached device prefix (its rings rebuilt from it)
    window_history: bool = False


class Batcher:
    def __init__(
        self,
        config: BatcherConfig,
        limits: ModelLimits,
        allocator: BlockAllocator,
        host: HostPrefix | None = None,
        observer: Observer | None = None,
    ):
        """`observer`: told each block name the device prefix cache stores or drops (the node's block events)."""
        """`host`: the host tier's prefix cache, which offloaded requests reuse (None: they do not)."""
        self.config = config
        self.limits = limits
        self.allocator = allocator
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._step_ids = itertools.count()
        self.num_preemptions = 0
        self.num_offloaded = 0  # admissions as offloaded
        self.link = LinkModel()
        self.num_held_for_link = 0  # requests that waited because their recall would not hide behind compute
        self._held: set[str] = set()
        # requests that ended whose worker holds state of its own (host blocks, window rings), for the next plan
        self.released: list[str] = []
        self.handles = Handles()
        self._admitted: list[Admission] = []  # for the next plan
        # requests whose worker has not yet freed what it held for them (the plan releasing them has
        # not come back): the host tier's blocks of such a request's id are not taken again until it has
        self._releasing: dict[str, int | None] = {}  # seq_id -> the step that releases it (None: the next)
        windowed = limits.max_running > 0  # its sliding layers' KV is on the device only
        cached = config.prefix_cache == "on" and (not windowed or limits.window_history)
        self.prefix = PrefixCache(allocator, observer) if cached else None
        # the tiers as one hierarchy (kv_store/prefix_cache.py): evicted device blocks to demote, in the next plan
        self.hierarchy = cached and config.host_prefix_cache == "on" and limits.host_tier and host is not None and not windowed
        self.host = host if cached and not windowed and (limits.offload_blocks or self.hierarchy) else None
        self._demote: list[tuple[int, bytes]] = []
        # names evicted whose demotion has not come back (None: not planned yet) -> the step demoting them
        self._demoting: dict[bytes, int | None] = {}

    # ------------------------------------------------------------ admission

    def check_fits(self, prompt_len: int) -> None:
        if prompt_len < 1:
            raise RequestTooLarge("the prompt is empty")
        if prompt_len >= self.limits.max_position:
            raise RequestTooLarge(f"prompt of {prompt_len} tokens leaves no room in the model's context of {self.limits.max_position}")
        capacity = self.allocator.num_blocks * self.limits.block_size
        if prompt_len + 1 > capacity and not self._can_offload:
            raise RequestTooLarge(f"prompt of {prompt_len} tokens exceeds the device KV pool of {capacity} tokens")

    @property
    def max_running(self) -> int:
        cap = self.limits.max_running
        return min(self.config.max_batch_size, cap) if cap else self.config.max_batch_size

    @property
    def _can_offload(self) -> bool:
        return self.config.offload != "never" and 0 < self.limits.offload_blocks <= self.allocator.num_blocks

    def add(self, seq: Sequence) -> None:
        self.check_fits(len(seq.prompt_ids))
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests already waiting")
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def abort(self, seq_id: str, reason: FinishReason = FinishReason.ABORT) -> Sequence | None:
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.seq_id == seq_id:
                    queue.remove(seq)
                    self._finish(seq, reason)
                    return seq
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.released or self.handles.ended)

    # ------------------------------------------------------------ one step

    def schedule(self) -> StepPlan | None:
        """The next step. It may be planned while earlier ones run (overlapped scheduling): a decode
        row then feeds the token its worker samples in the step before (PENDING_TOKEN here)."""
        if self.config.mixed_steps:
            chunks = self._decode_chunks()
            chunks += self._prefill_chunks()
        else:
            chunks = self._prefill_chunks() or self._decode_chunks()
        if not chunks and not self.released and not self.handles.ended and not self._demote:
            return None
        step_id = next(self._step_ids)
        released, self.released = tuple(self.released), []
        for seq_id in released:
            self._releasing[seq_id] = step_id
        admitted, self._admitted = tuple(self._admitted), []
        for admission in admitted:  # its promotion's host blocks are held until the step has copied them
            if admission.host_prefix and not admission.offloaded:
                self._releasing[admission.seq_id] = step_id
        names = self._host_names()
        demote, self._demote = tuple(self._demote), []
        for _, name in demote:
            self._demoting[name] = step_id
        return StepPlan(step_id, tuple(chunks), released, names, self.handles.send_ended(step_id), admitted, demote)

    def step_done(self, step_id: int) -> None:
        """A step's result came back (whatever it says): its worker ran everything planned up to it."""
        self.handles.step_done(step_id)
        for seq_id in [s for s, step in self._releasing.items() if step is not None and step <= step_id]:
            del self._releasing[seq_id]
        for name in [n for n, step in self._demoting.items() if step is not None and step <= step_id]:
            del self._demoting[name]

    def _prefill_chunks(self) -> list[Chunk]:
        """Up to the prefill budget: chunks of running requests still in prefill, then of waiting ones (FCFS)."""
        chunks = []
        budget = self.config.prefill_chunk
        for seq in [s for s in self.running if s.in_prefill]:
            if budget <= 0:
                break
            chunk = self._prefill_chunk(seq, budget)
            if chunk is None:
                break
            chunks.append(chunk)
            budget -= len(chunk.token_ids)
        while budget > 0 and self.waiting and len(self.running) < self.max_running:
            seq = self.waiting[0]
            if self._awaits_demotion(seq) or not self._place(seq):
                break
            chunk = self._first_chunk(seq, budget)
            if chunk is None:
                break
            self._admitted.append(self._admission(seq, chunk))
            self._record_prefix_hit(seq, chunk.start_pos, len(chunk.host_prefix) * self.limits.block_size)
            if chunk.host_prefix and not seq.offloaded:
                self.prefix.stats.promoted_blocks += len(chunk.host_prefix)
            self.num_offloaded += seq.offloaded
            self._held.discard(seq.seq_id)
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            chunks.append(chunk)
            budget -= len(chunk.token_ids)
        return chunks

    def observe(self, plan: StepPlan, recall: RecallStats, compute_s: float) -> None:
        """A step's measurements, for the admission of offloaded requests."""
        self.link.observe(plan, recall, compute_s)

    def commit(self, plan: StepPlan, sampled: list[SampledToken]) -> list[Sequence]:
        """Applies a step's results; returns the sequences that finished in it. A chunk of an admission
        that has ended since (finished, aborted, preempted: its handle is gone) changes nothing."""
        self.step_done(plan.step_id)
        by_id = {}
        for chunk in plan.chunks:
            seq = self.handles.running.get(chunk.handle)
            if seq is not None:
                by_id[chunk.seq_id] = seq
                seq.num_computed = max(seq.num_computed, chunk.end_pos)
                self._name_blocks(seq)
        finished = []
        for token in sampled:
            seq = by_id.get(token.seq_id)
            if seq is None or seq.status is not SeqStatus.RUNNING:
                continue
            seq.num_pending -= 1
            seq.output_ids.append(token.token_id)
            reason = self._finish_reason(seq, token.token_id)
            if reason is not None:
                self.running.remove(seq)
                self._finish(seq, reason)
                finished.append(seq)
        return finished

    # ------------------------------------------------------------ internals

    def _decode_chunks(self) -> list[Chunk]:
        chunks = []
        for seq in list(self.running):
            if seq.in_prefill or seq.status is not SeqStatus.RUNNING or self._last_planned(seq):
                continue
            if not self._reserve(seq, seq.length):
                continue  # seq itself was preempted
            chunks.append(self._decode_chunk(seq))
        return chunks

    def _decode_chunk(self, seq: Sequence) -> Chunk:
        """Its last token: one its worker sampled (fed back: PENDING_TOKEN while a step in flight samples
        it), or, after a prefill that stopped one short, a known one sent as a one-token prefill chunk."""
        position = seq.length - 1
        if position < seq.admitted_length:
            return self._chunk(seq, position, seq.length, seq.ids(position, seq.length))
        last = seq.output_ids[-1] if seq.num_pending == 0 else PENDING_TOKEN
        return self._chunk(seq, position, seq.length, (last,), fed_back=True)

    def _last_planned(self, seq: Sequence) -> bool:
        """Its last token is sampled by a step in flight (max_tokens or the context reached)."""
        return seq.num_outputs >= seq.params.max_tokens or seq.length >= self.limits.max_position

    def _first_chunk(self, seq: Sequence, budget: int) -> Chunk | None:
        """A placed request's first chunk, after the blocks of its longest cached prefix; None when
        the device pool has no room for it (it waits holding nothing, cached blocks included)."""
        if seq.offloaded:
            if not self._grow(seq, 0):  # its footprint first: host blocks are taken only for a request that runs
                return None
            host_prefix = self._reuse_host_prefix(seq)
        else:
            host_prefix = self._reuse_prefix(seq, budget)
        seq.handle, seq.known_blocks, seq.admitted_length = self.handles.new(seq), 0, seq.num_known
        seq.num_host_named = len(host_prefix) if seq.offloaded else 0
        chunk = self._prefill_chunk(seq, budget, host_prefix)
        if chunk is None:
            self.handles.unused(seq)
            self._release_blocks(seq)
            if host_prefix and not seq.offloaded:
                self.host.release(promotion_owner(seq.seq_id))
            return None
        return chunk

    def _admission(self, seq: Sequence, first: Chunk) -> Admission:
        """Sampling as of its next token: a first chunk that samples has counted that token pending already."""
        p = seq.params
        sampling = first.sampling or seq.sampling_spec(self.limits.eos_id)
        return Admission(
            seq.handle, seq.seq_id, first.start_pos, seq.num_known, sampling, seq.offloaded, first.host_prefix,
            p.stop_token_ids, p.ignore_eos, first.prompt_top,
        )  # fmt: skip

    def _prefill_chunk(self, seq: Sequence, budget: int, host_prefix: tuple[int, ...] = ()) -> Chunk | None:
        start = seq.num_cached
        end = min(seq.length, start + budget)
        if seq.scores_prompt and self.config.score_prompt_with == "decode":  # one token a step from --score-from: a decode row
            end = start + 1 if start >= self.config.score_from else min(end, self.config.score_from)
        if not self._grow(seq, end):
            return None
        return self._chunk(seq, seq.num_cached, end, seq.ids(seq.num_cached, end), host_prefix=host_prefix)

    def _chunk(
        self, seq: Sequence, start: int, end: int, token_ids: tuple[int, ...], fed_back: bool = False, host_prefix: tuple[int, ...] = ()
    ) -> Chunk:
        """A chunk of positions start..end-1; the KV it writes counts as cached from now on (the worker
        runs a request's chunks in the order they are sent)."""
        sampled = end == seq.length
        chunk = Chunk(
            seq.seq_id,
            token_ids,
            start,
            self._table(seq),
            seq.sampling_spec(self.limits.eos_id) if sampled else None,
            seq.offloaded,
            host_prefix,
            seq.handle,
            fed_back,
            seq.known_blocks,
        )
        if seq.scores_prompt and not fed_back:  # every row scored against the token after it (the last one samples)
            chunk.prompt_top = seq.params.prompt_logprobs
            chunk.score_next = -1 if sampled else seq.ids(end, end + 1)[0]
        seq.known_blocks = len(chunk.block_table)
        seq.num_cached = end
        seq.num_pending += sampled
        return chunk

    def _table(self, seq: Sequence) -> tuple[int, ...]:
        """Its device blocks; a table only grows while it runs, so the tuple is rebuilt when it has."""
        if self.allocator.count_of(seq.seq_id) != len(seq.block_table):
            seq.block_table = tuple(self.allocator.blocks_of(seq.seq_id))
        return seq.block_table

    def _host_names(self) -> tuple[BlockNames, ...]:
        """Offloaded requests: the names of their full blocks planned and whose tokens are known (a block
        a decode row completes a step ahead is named in the plan after its token comes back)."""
        if self.host is None:
            return ()
        out = []
        for seq in self.running:
            full = min(seq.num_cached, seq.num_known) // self.limits.block_size
            if seq.offloaded and full > seq.num_host_named:
                names = self._names(seq, full, seq.num_host_named)
                out.append(BlockNames(seq.seq_id, seq.handle, seq.num_host_named, tuple(names)))
                seq.num_host_named = full
        return tuple(out)

    # ------------------------------------------------------------ prefix cache

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
        blocks: a host hit costs their bytes over the link, far less than computing them (README
        "Prefix caching"). The host tier is asked only once the device has room for a first chunk."""
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

    # ------------------------------------------------------------ placement

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

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.params
        if token in p.stop_token_ids or (token == self.limits.eos_id and not p.ignore_eos):
            return FinishReason.STOP
        if len(seq.output_ids) >= p.max_tokens or seq.length >= self.limits.max_position:
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self._release(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
