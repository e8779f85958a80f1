"""Continuous batching: every step decodes all running sequences and fills the rest of the
token budget with prefill chunks (of running sequences first, then of waiting ones, FCFS).

Pure Python, no I/O: the scheduler process and the in-process engine drive the same code.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

from pulseinfer.kv_store.allocator import BlockAllocator
from pulseinfer.kv_store.prefix_cache import HostPrefix, Observer, PrefixCache, promotion_owner
from pulseinfer.messages.limits import PREFILL_CHUNK
from pulseinfer.messages.plan import PENDING_TOKEN, Admission, BlockNames, Chunk, RecallStats, SampledToken, StepPlan
from pulseinfer.messages.sampling import FinishReason
from pulseinfer.scheduler.admission import LinkModel
from pulseinfer.scheduler.handles import Handles
from pulseinfer.scheduler.placement import Placement
from pulseinfer.scheduler.prefix_reuse import PrefixReuse
from pulseinfer.scheduler.request import SeqStatus, Sequence

OFFLOAD_POLICIES = ("never", "auto", "always")
PREFIX_CACHE = ("on", "off")


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
    # measures the sparse path; a step per token (docs/api.md "Logprobs")
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


class Batcher(PrefixReuse, Placement):
    """Admission, each step's plan and the results that come back; the prefix cache's side
    (scheduler/prefix_reuse.py) and where a request runs and the blocks it holds
    (scheduler/placement.py) are mixed in."""

    def __init__(
        self,
        config: BatcherConfig,
        limits: ModelLimits,
        allocator: BlockAllocator,
        host: HostPrefix | None = None,
        observer: Observer | None = None,
    ):
        """`host`: the host tier's prefix cache, which offloaded requests reuse (None: they do not).
        `observer`: told each block name the device prefix cache stores or drops (the node's block events)."""
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
