"""Requests as the scheduler sees them: sampling parameters and per-sequence decode state."""

from __future__ import annotations

import enum
import random
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field

from pulseinfer.common.grammar import GRAMMAR_KINDS, GrammarMatcher
from pulseinfer.scheduler.plan import PENALTIES, Logprobs, SamplingSpec, TokenHistory, penalizes

MAX_STOP_STRINGS = 16
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
MAX_LOGPROBS = 20  # alternatives per token: OpenAI's top_logprobs limit (vLLM's default max_logprobs)
UINT32_MAX = 2**32 - 1  # max_tokens, top_k and token ids travel as proto uint32
FLOAT32_MAX = 3.4028234663852886e38  # temperature and top_p travel as proto float


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class ParamError(ValueError):
    """A request field out of range; `param` names it: a SamplingParams field, or "prompt"."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0  # 0: off
    min_tokens: int = 0  # tokens generated before eos, stop_token_ids or a stop string may end it
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    logprobs: int | None = None  # report each sampled token's log-probability, with this many alternatives
    prompt_logprobs: int | None = None  # report each prompt token's (from the second), with this many alternatives
    # the text (the gateway's detokenization): special tokens write none; a stop string ends it, itself included or not
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0  # in [-2, 2], as OpenAI's and vLLM's
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # > 0; 1: off
    # a structured output: (kind, value) with kind one of grammar.GRAMMAR_KINDS and value its text
    # (a JSON schema's JSON, a regex, a JSON array of choices, a Lark grammar; "" for json_object)
    structured: tuple[str, str] | None = None

    @property
    def penalized(self) -> bool:
        return penalizes(self)

    def validate(self, vocab_size: int) -> None:
        """Raises ParamError naming the first bad field."""
        if not isinstance(self.max_tokens, int) or not 1 <= self.max_tokens <= UINT32_MAX:
            raise ParamError(f"max_tokens must be an integer in [1, {UINT32_MAX}], got {self.max_tokens!r}", "max_tokens")
        if not 0 <= self.temperature <= FLOAT32_MAX:  # also refuses NaN
            raise ParamError(f"temperature must be a finite number >= 0, got {self.temperature!r}", "temperature")
        if not 0 < self.top_p <= 1:
            raise ParamError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not 0 <= self.top_k <= vocab_size:
            raise ParamError(f"top_k must be in [0, {vocab_size}] (0 disables it), got {self.top_k!r}", "top_k")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ParamError(f"seed must be in [0, 2**63), got {self.seed!r}", "seed")
        if len(self.stop) > MAX_STOP_STRINGS or any(not s for s in self.stop):
            raise ParamError(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings", "stop")
        check_token_ids(self.stop_token_ids, vocab_size, "stop_token_ids", "stop_token_ids")
        if not 0 <= self.min_p <= 1:
            raise ParamError(f"min_p must be in [0, 1], got {self.min_p!r}", "min_p")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ParamError(f"min_tokens must be in [0, max_tokens ({self.max_tokens})], got {self.min_tokens!r}", "min_tokens")
        if len(self.logit_bias) > MAX_LOGIT_BIAS or any(not -100 <= bias <= 100 for _, bias in self.logit_bias):
            raise ParamError(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, each with a bias in [-100, 100]", "logit_bias")
        check_token_ids([token for token, _ in self.logit_bias], vocab_size, "logit_bias token ids", "logit_bias")
        if len({token for token, _ in self.logit_bias}) < len(self.logit_bias):
            raise ParamError("logit_bias names a token twice", "logit_bias")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ParamError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}", name)
        if not 0 < self.repetition_penalty <= FLOAT32_MAX:
            raise ParamError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}", "repetition_penalty")
        if self.structured is not None and self.structured[0] not in GRAMMAR_KINDS:
            kinds = ", ".join(GRAMMAR_KINDS)
            raise ParamError(f"a structured output's kind must be one of {kinds}, got {self.structured[0]!r}", "structured")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ParamError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value!r}", name)

    def stop_ids(self, eos_id: int | None) -> frozenset[int]:
        """The tokens that end the request when sampled."""
        eos = () if eos_id is None or self.ignore_eos else (eos_id,)
        return frozenset((*self.stop_token_ids, *eos))


def check_token_ids(ids, vocab_size: int, what: str, param: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ParamError(f"{what} out of vocabulary range [0, {vocab_size}): {bad[:4]}", param)


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
