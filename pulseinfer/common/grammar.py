"""Structured outputs: a request's constraint (a JSON schema, any JSON object, a regex, a choice of
strings or a Lark grammar) as an llguidance grammar, checked by the gateway and, in the worker,
followed token by token: each step masks the tokens the grammar does not allow before sampling.

The gateway imports this module without torch (it only builds and checks grammars): torch is
imported where masks are made.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from llguidance import LLExecutor, LLMatcher, LLTokenizer

from pulseinfer.common.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice", "lark")
# Compact JSON (no free whitespace): a model cannot spend its tokens on spaces and newlines, and the
# output is what OpenAI's structured outputs write. A schema's own "x-guidance" settings come after.
_JSON_DEFAULTS = {"whitespace_flexible": False}
_NEG_INF_BITS = -8388608  # 0xFF800000 as an int32: float32 -inf
_MESSAGE_CHARS = 300  # an error message's length in a response: llguidance's can quote a whole grammar


def grammar_text(kind: str, value: Any) -> str:
    """The llguidance grammar of a request's constraint: json_schema takes the schema (a dict),
    json_object None, regex and lark a str, choice a list of non-empty strings. ValueError if the
    value cannot be one (the grammar itself is checked by GrammarTokenizer.check)."""
    if kind == "json_schema":
        if not isinstance(value, dict):
            raise ValueError(f"a json_schema must be a JSON object, got {type(value).__name__}")
        return _json_grammar(value)
    if kind == "json_object":
        if value is not None:
            raise ValueError("json_object takes no value")
        return _json_grammar({"type": "object"})
    if kind in ("regex", "lark"):
        if not isinstance(value, str):
            raise ValueError(f"a {kind} grammar must be a string, got {type(value).__name__}")
        return LLMatcher.grammar_from_regex(value) if kind == "regex" else LLMatcher.grammar_from_lark(value)
    if kind == "choice":
        return _choice_grammar(value)
    raise ValueError(f"unknown grammar kind {kind!r}: one of {', '.join(GRAMMAR_KINDS)}")


def structured_grammar(kind: str, text: str) -> str:
    """grammar_text of a constraint as requests carry it (SamplingParams.structured): a JSON schema
    as its JSON, the choices as a JSON array, "" for json_object, a regex or Lark grammar as is."""
    if kind in ("json_schema", "choice"):
        try:
            return grammar_text(kind, json.loads(text))
        except json.JSONDecodeError as e:
            raise ValueError(f"a {kind} must be JSON text: {e}") from None
    return grammar_text(kind, (text or None) if kind == "json_object" else text)


def _json_grammar(schema: dict) -> str:
    try:
        return LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_DEFAULTS)
    except (ValueError, TypeError) as e:  # not JSON-serializable, or a malformed "x-guidance"
        raise ValueError(_short(f"invalid JSON schema: {e}")) from None


def _choice_grammar(choices: Any) -> str:
    if not isinstance(choices, list) or not choices:
        raise ValueError("a choice must be a non-empty list of strings")  # llguidance takes [] (and matches nothing)
    if not all(isinstance(c, str) and c for c in choices):
        raise ValueError("every choice must be a non-empty string")
    # JSON string literals are Lark's: quotes, backslashes and control characters come out escaped
    return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


def _short(message: str) -> str:
    message = message.strip()
    return message if len(message) <= _MESSAGE_CHARS else message[: _MESSAGE_CHARS - 3] + "..."


class GrammarTokenizer:
    """The model's tokenizer as llguidance sees it; one per process (building it takes ~0.5 s for
    49k tokens, seconds for 262k). Immutable: any thread may check grammars and make matchers.

    vocab_size: the logits' width (the model's, which may exceed the tokenizer's: the ids past the
    tokenizer's are never allowed). stop_ids: the tokens that end generation (the model's eos and
    any others); a grammar allows them only where its text may end. threads: the mask executor's
    (None: llguidance's default, 80% of the CPUs up to 32)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_ids: Sequence[int], threads: int | None = None):
        stops = list(stop_ids) or ([tokenizer.eos_id] if tokenizer.eos_id is not None else [])
        if not stops:
            raise ValueError("a grammar needs a stop token: the tokenizer has no eos and no stop_ids were given")
        spec = json.loads(tokenizer.backend.to_str())
        spec["padding"] = spec["truncation"] = None  # they would leak into llguidance's own tokenizing
        self.vocab_size = vocab_size
        self.stop_ids = tuple(stops)
        self.llg = LLTokenizer(json.dumps(spec), n_vocab=vocab_size, eos_token=stops)
        self.executor = LLExecutor(threads)

    def check(self, grammar: str) -> None:
        """ValueError with llguidance's message (shortened) if the grammar cannot be followed."""
        error = LLMatcher.validate_grammar(grammar, self.llg)
        if error:
            raise ValueError(_short(error))

    def matcher(self, grammar: str, outputs: Sequence[int] = ()) -> GrammarMatcher:
        """A matcher at the grammar's start, or past `outputs` (a request re-admitted after a
        preemption carries on from its tokens so far). ValueError if the grammar is invalid or the
        outputs do not follow it."""
        matcher = GrammarMatcher(self, grammar)
        if matcher.error is not None:
            raise ValueError(matcher.error)
        if outputs and not matcher._matcher.consume_tokens(list(outputs)):
            raise ValueError(_short(f"the tokens so far do not follow the grammar: {matcher.error}"))
        return matcher


def grammars_built_aside(tokenizer: Tokenizer, vocab_size: int, stop_ids: Sequence[int]) -> Callable[[], GrammarTokenizer]:
    """A GrammarTokenizer built on a thread of its own (llguidance releases the GIL while it builds),
    so a process serves at once: the function returned waits for it, and raises what building raised."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-tokenizer")
    built = pool.submit(GrammarTokenizer, tokenizer, vocab_size, list(stop_ids))
    pool.shutdown(wait=False)  # the thread ends with the build
    return built.result


class GrammarMatcher:
    """One request's place in its grammar. Owned by one thread at a time: llguidance refuses (with
    RuntimeError) a matcher used by two at once."""

    def __init__(self, tokenizer: GrammarTokenizer, grammar: str):
        self.tokenizer = tokenizer
        self._matcher = LLMatcher(tokenizer.llg, grammar, log_level=0)  # never raises: see error

    def consume(self, token: int) -> None:
        """Advance past a sampled token. A token the mask did not allow puts the matcher in an
        error state for good (done, with error set), rather than raising mid-step."""
        self._matcher.consume_token(token)

    @property
    def done(self) -> bool:
        """The request ends here: the grammar is complete and cannot be extended (the next mask
        would allow only the stop tokens), a stop token was consumed, or the matcher is in error."""
        return self._matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        """The text so far is complete: the stop tokens are allowed now."""
        return self._matcher.is_accepting()

    @property
    def error(self) -> str | None:
        return _short(self._matcher.get_error()) if self._matcher.is_error() else None


def fill_masks(matchers: Sequence[GrammarMatcher], vocab_size: int) -> torch.Tensor:
    """The tokens each matcher allows next: a CPU int32 bitmask [rows, ceil(vocab_size / 32)], bit j
    of word w set when token 32w + j is allowed. Computed on the tokenizer's executor threads, with
    the GIL released; a done matcher allows only the stop tokens."""
    import torch  # not at the top: the gateway never makes masks

    # Not llguidance.torch's helpers: importing that module costs 3-4 s (its torch.compile'd
    # kernel pulls in dynamo), and allocate_token_bitmask pins every step's mask under CUDA.
    bitmask = torch.zeros(len(matchers), (vocab_size + 31) // 32, dtype=torch.int32)
    if matchers:
        tokenizer = matchers[0].tokenizer
        if vocab_size != tokenizer.vocab_size:
            raise ValueError(f"masks of {vocab_size} tokens asked of a grammar tokenizer of {tokenizer.vocab_size}")
        pairs = [(m._matcher, row) for row, m in enumerate(matchers)]
        tokenizer.executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, len(matchers))
    return bitmask


def masked(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """The logits with each listed row's disallowed tokens at -inf: bitmask row i (fill_masks') is
    logits row rows[i] (a host tensor). Columns past the bitmask are disallowed. Eager torch on the
    logits' device, batched over the rows; returns a new tensor and leaves `logits` as it was."""
    import torch

    from pulseinfer.common.syncs import to_device

    if len(rows) == 0:
        return logits.clone()
    index, words = to_device([rows.to(torch.long), bitmask.contiguous()], logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    # per token 0.0 if allowed, else -inf's bits: one add masks the rows (masked_fill is 4x slower on a CPU)
    bias = ((((words.unsqueeze(-1) >> shifts) & 1) - 1) & _NEG_INF_BITS).view(len(rows), -1).view(torch.float32)
    vocab = logits.shape[-1]
    if bias.shape[1] < vocab:
        bias = torch.nn.functional.pad(bias, (0, vocab - bias.shape[1]), value=float("-inf"))
    return logits.index_add(0, index, bias[:, :vocab].to(logits.dtype))  # a copy: 4x faster than gather, add, scatter
