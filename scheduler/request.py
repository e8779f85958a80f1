"""Requests as the scheduler sees them: per-sequence decode state."""

from __future__ import annotations

import enum
import random
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field

from pulseinfer.common.grammar import GrammarMatcher
from pulseinfer.messages.plan import PENALTIES, Logprobs, SamplingSpec, TokenHistory
from pulseinfer.messages.sampling import FinishReason, SamplingParams, check_token_ids


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    seq_id: str
    # Token ids and block names live in containers the garbage collector does not scan (a tuple of
    # ints or bytes it untracks, an array): as lists, 256 requests of 32k gave every full collection
    # millions of items to scan, a late plan every few steps (docs/control_plane.md)
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    seed: int  # params.seed, or one drawn at admission so retries stay reproducible
    output_ids: array[int] = field(default_factory=lambda: array("q"))
    num_cached: int = 0  # tokens whose KV is in the device pool once the steps sent to its worker have run
    num_computed: int = 0  # of those, the tokens its worker has reported computed
    num_pending: int = 0  # tokens sampled by steps sent whose results have not come back (overlapped scheduling)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    offloaded: bool = False  # most of its KV in the host pool; decided each time it is (re)admitted
    cached_tokens: int | None = None  # prompt tokens whose KV the prefix cache had at its first placement
    block_names: tuple[bytes, ...] = ()  # prefix-cache names of its leading full blocks
    num_named: int = 0  # leading blocks the prefix cache has been given since it last started
    num_prompt_scored: int = 0  # prompt tokens (from the second) whose logprobs have been reported, with prompt_logprobs
    history: TokenHistory | None = None  # with a penalty or a structured output: what its sampling specs share
    grammar: GrammarMatcher | None = None  # in process (pulseinfer.engine), its structured output's matcher
    host_cached_blocks: int | None = None  # of its prefix, cached in the host tier when admission first asked
    # while it runs: its admission's handle on its worker, the blocks of its table the worker has, and
    # (offloaded, host prefix cache on) its leading blocks whose names the worker has been given
    handle: int = -1
    admitted_length: int = 0  # its tokens when admitted: those after were sampled by its worker
    known_blocks: int = 0
    num_host_named: int = 0
    block_table: tuple[int, ...] = ()  # its device blocks as last sent (rebuilt only when they change)

    @classmethod
    def admit(cls, seq_id: str, prompt_ids: Iterable[int], params: SamplingParams, vocab_size: int) -> Sequence:
        """Checks a request (ValueError naming the problem) and draws its seed when it has none."""
        params.validate(vocab_size)
        prompt_ids = tuple(prompt_ids)
        check_token_ids(prompt_ids, vocab_size, "prompt token ids", "prompt")
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        return cls(seq_id, prompt_ids, params, seed)

    @property
    def all_ids(self) -> list[int]:
        """The tokens known so far (not those of steps in flight)."""
        return [*self.prompt_ids, *self.output_ids]

    def ids(self, start: int, end: int) -> tuple[int, ...]:
        """Known tokens start..end-1, without copying the whole context."""
        prompt = len(self.prompt_ids)
        if end <= prompt:
            return tuple(self.prompt_ids[start:end])
        return tuple(self.prompt_ids[start:prompt]) + tuple(self.output_ids[max(0, start - prompt) : end - prompt])

    @property
    def num_known(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def length(self) -> int:
        """Its tokens once the steps in flight have sampled theirs."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    @property
    def num_outputs(self) -> int:
        return len(self.output_ids) + self.num_pending

    @property
    def in_prefill(self) -> bool:
        return self.num_cached < self.length - 1

    @property
    def scores_prompt(self) -> bool:
        """It wants its prompt's logprobs and has not had them all: its prompt is computed whole."""
        return self.params.prompt_logprobs is not None and self.num_prompt_scored < len(self.prompt_ids) - 1

    def take_prompt_logprobs(self, start: int, scored: Logprobs) -> Logprobs:
        """Of what a chunk at `start` scored (positions start + 1 on), the prompt positions not reported
        yet, counted reported now. A scoring admission's chunks start at position 0 (no cached prefix)
        and run in order, so the first position not reported is never past the chunk's first."""
        first_new = self.num_prompt_scored + 1 - (start + 1)
        new = scored.slice(first_new, len(self.prompt_ids) - 1 - start)
        self.num_prompt_scored += len(new)
        return new

    def sampling_spec(self, eos_id: int | None) -> SamplingSpec:
        """Made for every chunk that samples: what few requests ask for is filled in only for them."""
        p = self.params
        spec = SamplingSpec(p.temperature, p.top_p, p.top_k, self.seed, self.num_outputs, p.min_p)
        if p.min_tokens:
            spec.min_tokens, spec.stop_ids = p.min_tokens, tuple(sorted(p.stop_ids(eos_id)))
        if p.logit_bias:
            spec.bias_ids, spec.bias_values = map(tuple, zip(*p.logit_bias))
        if p.logprobs is not None:
            spec.logprobs, spec.top_logprobs = True, p.logprobs
        if p.penalized:
            for name in PENALTIES:
                setattr(spec, name, getattr(p, name))
        if p.structured is not None:
            spec.structured, spec.grammar = p.structured, self.grammar
        if p.penalized or p.structured is not None:  # a re-admitted request's grammar is advanced past its outputs
            spec.history = self.token_history()
        return spec

    def token_history(self) -> TokenHistory:
        """Its sampling history, made once: the outputs are its own array, appended as tokens come back."""
        if self.history is None:
            prompt = tuple(self.prompt_ids) if self.params.repetition_penalty != 1 else ()
            self.history = TokenHistory(prompt, self.output_ids)
        return self.history
