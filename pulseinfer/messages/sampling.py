"""A request's sampling parameters as clients give them (HTTP, gRPC, the in-process engine), their checks,
and the reasons a request finishes."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pulseinfer.common.grammar import GRAMMAR_KINDS
from pulseinfer.messages.limits import DEFAULT_MAX_TOKENS, FLOAT32_MAX, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_STRINGS, UINT32_MAX
from pulseinfer.messages.plan import penalizes


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
    max_tokens: int = DEFAULT_MAX_TOKENS
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
