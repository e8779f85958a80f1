"""A worker's running requests, kept from their admission (docs/architecture.md).

A step plan carries only what changed (worker.proto StepPlan): new admissions, new blocks, prefill
tokens, the handles that decode, releases. The table turns each plan back into the chunks the model
runner runs, feeding every decode row the token this worker sampled for it last, and records what the
runner sampled. A request that sampled a stop token is dropped from the plan already queued behind it
(overlapped scheduling planned it a step ahead); its scheduler ends it when that token comes back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pulseinfer.common.grammar import GrammarTokenizer
from pulseinfer.kv_store.prefix_cache import promotion_owner
from pulseinfer.messages.plan import BlockNames, Chunk, SamplingSpec, StepOutcome, StepPlan
from pulseinfer.messages.wire import logprobs_to_proto, sampling_from_proto
from pulseinfer.proto.pulseinfer.v1 import worker_pb2


@dataclass
class Running:
    """One admission as its worker keeps it."""

    seq_id: str
    base: int  # its first position with a token here: the KV before it came from a cached prefix
    length: int  # tokens it had at admission: its prefill ends here and samples
    sampling: SamplingSpec  # step: the index of the next token it samples
    offloaded: bool
    host_prefix: tuple[int, ...]
    stops: frozenset[int]
    known: int  # positions with a token: those sent for its prefill, then those it sampled
    last: int  # the token at position known - 1 (a decode row's input); no other is kept
    fed: int  # positions that have been run (or run in the step being built)
    table: tuple[int, ...] = ()
    ended: bool = False  # it sampled a stop token, or this worker failed it: later chunks of it are dropped
    prompt_top: int = -1  # its prefill chunks score their tokens, with this many alternatives; -1: they do not
    refused: str | None = None  # why it cannot run here (no grammar tokenizer for its structured output): its first chunk fails


@dataclass
class Staged:
    """A plan taken in but for its decode rows, which wait for the tokens of the step before it."""

    step_id: int
    decode: list[int]  # handles
    released: tuple[str, ...]  # requests whose runner state the step frees
    prefill: list[Chunk] = field(default_factory=list)
    names: tuple[BlockNames, ...] = ()
    demote: tuple[tuple[int, bytes], ...] = ()
    handles: dict[str, int] = field(default_factory=dict)  # seq_id -> handle, of the step's chunks
    failed: dict[int, str] = field(default_factory=dict)  # chunks that cannot run here, by handle, with why


class RequestTable:
    def __init__(self, eos_id: int | None, windowed: bool, grammars: Callable[[], GrammarTokenizer] | None = None):
        """`windowed`: the model keeps a sliding-window ring per running request, which every release
        frees (otherwise only offloaded requests have state the runner frees). `grammars`: the
        tokenizer structured outputs are matched with (None: this worker has none)."""
        self.eos_id = eos_id
        self.windowed = windowed
        self.grammars = grammars
        self.running: dict[int, Running] = {}
        self._step_handles: dict[str, int] = {}  # seq_id -> handle, for the step being run

    def clear(self) -> None:
        self.running.clear()

    def host_owners(self) -> list[str]:
        """Who may hold host blocks for the running admissions: an offloaded one itself (its cached
        prefix and its blocks), a resident one's promotion (released once copied, or never run)."""
        return [e.seq_id if e.offloaded else promotion_owner(e.seq_id) for e in self.running.values() if e.offloaded or e.host_prefix]

    def stage(self, plan: worker_pb2.StepPlan) -> Staged:
        """What of a plan does not wait for the step before it: releases, admissions, new blocks,
        prefill chunks, names. It may run while that step's forward does (overlapped scheduling)."""
        released = self._release(plan.released)
        for admission in plan.admitted:
            self.running[admission.handle] = self._admit(admission)
        self._grant(plan.grant_handles, plan.grant_blocks)
        staged = Staged(plan.step_id, list(plan.decode), tuple(released))
        score_next = dict(zip(plan.score_handles, plan.score_next))
        offset = 0
        for handle, count in zip(plan.prefill_handles, plan.prefill_lengths):
            chunk = self._prefill(handle, list(plan.prefill_tokens[offset : offset + count]), staged, score_next.get(handle, -1))
            offset += count
            if chunk is not None:
                staged.prefill.append(chunk)
        staged.names = self._names(plan.name_handles, plan.name_blocks, plan.names)
        staged.demote = tuple(zip(plan.demote_blocks, plan.demote_names))
        return staged

    def build(self, staged: Staged) -> tuple[StepPlan, dict[int, str]]:
        """The step's chunks once the step before it is recorded: its decode rows, each fed the token
        its request sampled last, then its prefill chunks; and the handles of chunks that cannot
        run here, with why."""
        self._step_handles = staged.handles
        chunks = [c for h in staged.decode if (c := self._decode(h, staged)) is not None]
        names = tuple(n for n in staged.names if n.handle not in staged.failed)  # a failed chunk's blocks are not written
        plan = StepPlan(staged.step_id, tuple(chunks + staged.prefill), staged.released, names, demote=staged.demote)
        return plan, staged.failed

    def record(self, outcome: StepOutcome) -> tuple[list[int], list[int], dict[int, str]]:
        """Takes the sampled tokens in; the tokens as (handles, token ids) and the failed requests by handle."""
        handles, tokens = [], []
        for sampled in outcome.tokens:
            handle = self._step_handles[sampled.seq_id]
            entry = self.running.get(handle)
            if entry is None:
                continue
            entry.known += 1
            entry.last = sampled.token_id
            if entry.sampling.history is not None:
                entry.sampling.history.outputs.append(sampled.token_id)
            entry.sampling = entry.sampling.next()
            entry.ended = sampled.token_id in entry.stops
            handles.append(handle)
            tokens.append(sampled.token_id)
        failed = {}
        for seq_id, error in outcome.failed.items():
            handle = self._step_handles[seq_id]
            failed[handle] = error
            if (entry := self.running.get(handle)) is not None:
                entry.ended = True
        return handles, tokens, failed

    def report_logprobs(self, outcome: StepOutcome, result: worker_pb2.StepResult) -> None:
        """The step's log-probabilities (of sampled tokens, of prompt tokens) into its result, by handle."""
        for sampled in outcome.tokens:
            if sampled.logprobs is not None:
                result.logprob_handles.append(self._step_handles[sampled.seq_id])
                logprobs_to_proto(sampled.logprobs, result.logprobs.add())
        for seq_id, logprobs in outcome.prompt_logprobs.items():
            result.prompt_handles.append(self._step_handles[seq_id])
            logprobs_to_proto(logprobs, result.prompt_logprobs.add())

    def fail_step(self) -> None:
        """The whole step failed: its requests are ended here (the scheduler fails them)."""
        for handle in self._step_handles.values():
            if (entry := self.running.get(handle)) is not None:
                entry.ended = True

    # ------------------------------------------------------------ internals

    def _release(self, handles) -> list[str]:
        """Drops the ended admissions; the ids of those whose runner state (host blocks, window rings) must be freed."""
        released = []
        for handle in handles:
            entry = self.running.pop(handle, None)
            if entry is not None and (entry.offloaded or self.windowed):
                released.append(entry.seq_id)
        return released

    def _admit(self, a: worker_pb2.Admission) -> Running:
        stops = set(a.stop_token_ids)
        if self.eos_id is not None and not a.ignore_eos:
            stops.add(self.eos_id)
        sampling = sampling_from_proto(a.sampling)
        start, prompt_top = a.start_pos, a.prompt_top if a.score_prompt else -1
        refused = self._match_grammar(sampling) if sampling.structured is not None else None
        return Running(
            a.seq_id,
            start,
            a.length,
            sampling,
            a.offloaded,
            tuple(a.host_prefix),
            frozenset(stops),
            start,
            -1,
            start,
            prompt_top=prompt_top,
            refused=refused,
        )

    def _match_grammar(self, sampling: SamplingSpec) -> str | None:
        """Gives a structured spec its grammar's matcher, advanced past the request's outputs so far
        and built on a grammar thread, off the step loop: its first mask waits for it, and a grammar
        it cannot follow fails the request there (the sampler). Why it cannot, if it cannot."""
        if self.grammars is None:
            return "this worker has no tokenizer to follow a structured output's grammar with"
        outputs = sampling.history.outputs if sampling.history else ()
        sampling.grammar = self.grammars().structured_matcher(*sampling.structured, outputs)
        return None

    def _grant(self, handles, blocks) -> None:
        grants: dict[int, list[int]] = {}
        for handle, block in zip(handles, blocks):
            grants.setdefault(handle, []).append(block)
        for handle, new in grants.items():
            if (entry := self.running.get(handle)) is not None:
                entry.table += tuple(new)

    def _decode(self, handle: int, staged: Staged) -> Chunk | None:
        entry = self.running.get(handle)
        if entry is None:
            staged.failed[handle] = f"admission {handle} is not running on this worker"
            return None
        if entry.ended:
            return None
        if entry.fed != entry.known - 1:
            known = entry.known
            staged.failed[handle] = f"request {entry.seq_id}: the plan decodes position {entry.fed}, this worker has tokens to {known}"
            entry.ended = True
            return None
        entry.fed += 1
        staged.handles[entry.seq_id] = handle
        return Chunk(entry.seq_id, (entry.last,), entry.fed - 1, entry.table, entry.sampling, entry.offloaded)

    def _prefill(self, handle: int, tokens: list[int], staged: Staged, score_next: int) -> Chunk | None:
        """`score_next`: the token after the chunk, for a request that scores its prompt (-1: not sent)."""
        entry = self.running.get(handle)
        if entry is None:
            staged.failed[handle] = f"admission {handle} is not running on this worker"
            return None
        start, end = entry.fed, entry.fed + len(tokens)
        sampling = entry.sampling if end == entry.length else None
        problem = entry.refused
        if problem is None and (not tokens or end > entry.length):
            problem = f"a prefill chunk of {len(tokens)} tokens to position {end} (it has {entry.length})"
        elif problem is None and entry.prompt_top >= 0 and sampling is None and score_next < 0:
            problem = f"a prefill chunk to position {end} without the token after it, which its prompt scoring needs"
        if problem is not None:
            staged.failed[handle] = f"request {entry.seq_id}: {problem}"
            entry.ended = True
            return None
        entry.known = entry.fed = end
        entry.last = tokens[-1]
        staged.handles[entry.seq_id] = handle
        host_prefix = entry.host_prefix if start == entry.base else ()
        return Chunk(
            entry.seq_id, tuple(tokens), start, entry.table, sampling, entry.offloaded, host_prefix,
            prompt_top=entry.prompt_top, score_next=score_next,
        )  # fmt: skip

    def _names(self, handles, blocks, names) -> tuple[BlockNames, ...]:
        out: list[BlockNames] = []
        for handle, block, name in zip(handles, blocks, names):
            entry = self.running.get(handle)
            if entry is None:
                continue
            last = out[-1] if out else None
            if last is not None and last.handle == handle and last.first + len(last.names) == block:
                out[-1] = BlockNames(last.seq_id, handle, last.first, last.names + (name,))
            else:
                out.append(BlockNames(entry.seq_id, handle, block, (name,)))
        return tuple(out)
