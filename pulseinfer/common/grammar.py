"""Structured outputs: a request's constraint (a JSON schema, any JSON object, a regex, a choice of
strings or a Lark grammar) as an llguidance grammar, checked by the gateway and, in the worker,
followed token by token: each step masks the tokens the grammar does not allow before sampling.

A grammar is untrusted input that llguidance compiles natively and recursively: a constraint past
the limits below is refused before llguidance sees it; the worker builds its matchers on a thread of
GRAMMAR_STACK_BYTES of stack (grammar_thread), and the gateway checks a grammar in a helper process
on half that (gateway/grammar_checks.py), so that a grammar the check compiled never overflows the
worker's stack. docs/hardening.md "Grammars" lists the limits.

The gateway imports this module without torch (it only builds and checks grammars): torch is
imported where masks are made.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
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

# Limits on a constraint, checked before llguidance compiles it. Its compiles recurse: on a thread of
# 2 MiB a chain of $refs overflows past ~300 levels (as MAX_SCHEMA_DEPTH counts them), a chain of
# Lark rules past ~600; on the gateway check's 8 MiB these limits leave a margin of ~10x (OpenAI's
# structured outputs allow 10 levels of object nesting).
MAX_GRAMMAR_BYTES = 1 << 20  # a constraint's text: a schema's JSON, a regex, a Lark grammar, the choices' JSON
MAX_SCHEMA_DEPTH = 128  # a JSON schema's objects and arrays nested, following its local $refs
MAX_CHOICES = 1000  # a choice's strings: llguidance's parser fails past 2,000 alternatives in a row
MAX_LARK_RULES = 256  # a Lark grammar's rules and terminals
GRAMMAR_STACK_BYTES = 16 << 20  # a worker's thread that compiles grammars (a thread's default is 8 MiB, or 2 MiB)
FORCED_STEPS = 16  # how far check_grammar follows a grammar's forced start
# constraints whose compiled matcher a GrammarTokenizer keeps to copy (a copy takes ~0.3 ms, a
# 500 KB schema's compile seconds): a request's n choices, the requests of one schema, compile once
MATCHER_CACHE = 8
_LARK_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_]*(\.-?[0-9]+)?[ \t]*:", re.MULTILINE)


def grammar_text(kind: str, value: Any) -> str:
    """The llguidance grammar of a request's constraint: json_schema takes the schema (a dict),
    json_object None, regex and lark a str, choice a list of non-empty strings. ValueError if the
    value cannot be one (the grammar itself is checked by GrammarTokenizer.check)."""
    if kind == "json_schema":
        if not isinstance(value, dict):
            raise ValueError(f"a json_schema must be a JSON object, got {type(value).__name__}")
        _check_depth(value)
        return _json_grammar(value)
    if kind == "json_object":
        if value is not None:
            raise ValueError("json_object takes no value")
        return _json_grammar({"type": "object"})
    if kind in ("regex", "lark"):
        if not isinstance(value, str):
            raise ValueError(f"a {kind} grammar must be a string, got {type(value).__name__}")
        if kind == "lark" and (rules := len(_LARK_RULE.findall(value))) > MAX_LARK_RULES:
            raise ValueError(f"the Lark grammar defines {rules} rules and terminals, over the limit of {MAX_LARK_RULES}")
        return LLMatcher.grammar_from_regex(value) if kind == "regex" else LLMatcher.grammar_from_lark(value)
    if kind == "choice":
        return _choice_grammar(value)
    raise ValueError(f"unknown grammar kind {kind!r}: one of {', '.join(GRAMMAR_KINDS)}")


def structured_grammar(kind: str, text: str) -> str:
    """grammar_text of a constraint as requests carry it (SamplingParams.structured): a JSON schema
    as its JSON, the choices as a JSON array, "" for json_object, a regex or Lark grammar as is."""
    if len(text) > MAX_GRAMMAR_BYTES or len(text.encode()) > MAX_GRAMMAR_BYTES:  # the first test is free
        raise ValueError(f"the {kind} is {len(text.encode())} bytes, over the limit of {MAX_GRAMMAR_BYTES}")
    if kind in ("json_schema", "choice"):
        try:
            return grammar_text(kind, json.loads(text))
        except json.JSONDecodeError as e:
            raise ValueError(f"a {kind} must be JSON text: {e}") from None
        except RecursionError:
            raise ValueError(f"the {kind} nests deeper than {MAX_SCHEMA_DEPTH} levels (the limit)") from None
    return grammar_text(kind, (text or None) if kind == "json_object" else text)


def _check_depth(schema: dict) -> None:
    """ValueError if the schema nests deeper than MAX_SCHEMA_DEPTH objects and arrays, counted
    through its local $refs (llguidance compiles a $ref's target where it is used)."""
    _height(schema, 0, schema, {})


def _height(node: Any, above: int, root: dict, heights: dict[int, int]) -> int:
    """Objects and arrays on the deepest path down from `node` (`above` of them over it). A $ref to a
    node being measured (a recursive schema) adds nothing: llguidance compiles a definition once."""
    if not isinstance(node, (dict, list)):
        return 0
    if above >= MAX_SCHEMA_DEPTH:
        raise ValueError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels (objects and arrays, through its $refs)")
    known = heights.get(id(node))
    if known is not None:
        height = max(known, 0)  # -1: on the path being measured
    else:
        heights[id(node)] = -1
        children = list(node.values()) if isinstance(node, dict) else node
        if isinstance(node, dict) and isinstance(node.get("$ref"), str):
            children = [*children, _referenced(root, node["$ref"])]
        height = 1
        for child in children:
            height = max(height, 1 + _height(child, above + 1, root, heights))
        heights[id(node)] = height
    if above + height > MAX_SCHEMA_DEPTH:
        raise ValueError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels (objects and arrays, through its $refs)")
    return height


def _referenced(root: dict, ref: str) -> Any:
    """The node a local $ref ("#" or "#/a JSON pointer") names; None for any other, which llguidance judges."""
    if ref != "#" and not ref.startswith("#/"):
        return None
    node: Any = root
    for part in ref[2:].split("/") if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


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
    if len(choices) > MAX_CHOICES:
        raise ValueError(f"a choice of {len(choices)} strings is over the limit of {MAX_CHOICES}")
    # JSON string literals are Lark's: quotes, backslashes and control characters come out escaped
    return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


def _short(message: str) -> str:
    message = message.strip()
    return message if len(message) <= _MESSAGE_CHARS else message[: _MESSAGE_CHARS - 3] + "..."


def _message(error: str) -> str:
    """An llguidance error without the parser state or backtrace it dumps after it (<state>, <backtrace>)."""
    return _short(error.split("\n<", 1)[0])


def grammar_thread(name: str, stack_bytes: int = GRAMMAR_STACK_BYTES) -> ThreadPoolExecutor:
    """An executor of one thread with `stack_bytes` of stack, started now (threading.stack_size
    applies to the threads started while it is set)."""
    previous = threading.stack_size(stack_bytes)
    try:
        pool = ThreadPoolExecutor(1, thread_name_prefix=name)
        pool.submit(int).result()
    finally:
        threading.stack_size(previous)
    return pool


def _built(llg: LLTokenizer, grammar: str) -> LLMatcher:
    """A matcher at the grammar's start, compiled now; ValueError if the grammar is invalid."""
    matcher = LLMatcher(llg, grammar, log_level=0)  # never raises: see is_error
    if matcher.is_error():
        raise ValueError(_message(matcher.get_error()))
    return matcher


def _past(matcher: LLMatcher, outputs: Sequence[int]) -> LLMatcher:
    """The matcher advanced past `outputs` (a request re-admitted after a preemption carries on from
    its tokens so far); ValueError if they do not follow the grammar."""
    if outputs and not matcher.consume_tokens(list(outputs)):
        raise ValueError(_short(f"the tokens so far do not follow the grammar: {_message(matcher.get_error())}"))
    return matcher


def check_grammar(llg: LLTokenizer, grammar: str, steps: int = FORCED_STEPS) -> int | None:
    """ValueError if the grammar cannot be followed: llguidance refuses it, or its matcher fails
    along the grammar's forced start, the tokens it allows one at a time (a schema that can only
    recurse, or a row of alternatives past llguidance's parser limits, fails there, not when
    compiled). Returns the output's length in tokens when that start is all of it (the grammar ends
    within `steps` tokens without a choice), else None."""
    matcher = _built(llg, grammar)
    taken = 0
    while not matcher.is_stopped() and taken < steps:
        allowed = int.from_bytes(matcher.compute_bitmask(), "little")
        if matcher.is_error() or allowed.bit_count() > 1:
            break
        if not allowed:
            raise ValueError(f"the grammar allows no token at token {taken + 1} of its output")
        if allowed.bit_length() - 1 in llg.eos_tokens:
            return taken
        matcher.consume_token(allowed.bit_length() - 1)
        taken += 1
    if matcher.is_error():
        why = "no finite output, or past llguidance's parser limits"
        raise ValueError(_short(f"the grammar cannot be followed ({why}): it fails at token {taken + 1}: {_message(matcher.get_error())}"))
    return taken if matcher.is_stopped() else None


@dataclass(frozen=True)
class GrammarVocab:
    """What llguidance's view of the model's tokenizer is made of, as plain data: a helper process
    (the gateway's grammar checks) builds its own from it."""

    tokenizer_json: str
    vocab_size: int
    stop_ids: tuple[int, ...]

    @classmethod
    def of(cls, tokenizer: Tokenizer, vocab_size: int, stop_ids: Sequence[int]) -> GrammarVocab:
        stops = list(stop_ids) or ([tokenizer.eos_id] if tokenizer.eos_id is not None else [])
        if not stops:
            raise ValueError("a grammar needs a stop token: the tokenizer has no eos and no stop_ids were given")
        spec = json.loads(tokenizer.backend.to_str())
        spec["padding"] = spec["truncation"] = None  # they would leak into llguidance's own tokenizing
        return cls(json.dumps(spec), vocab_size, tuple(stops))

    def llg(self) -> LLTokenizer:
        return LLTokenizer(self.tokenizer_json, n_vocab=self.vocab_size, eos_token=list(self.stop_ids))


class GrammarTokenizer:
    """The model's tokenizer as llguidance sees it; one per process (building it takes ~0.5 s for
    49k tokens, seconds for 262k). Any thread may check grammars and make matchers;
    structured_matcher makes them on a grammar thread of its own, which alone keeps its cache.

    vocab_size: the logits' width (the model's, which may exceed the tokenizer's: the ids past the
    tokenizer's are never allowed). stop_ids: the tokens that end generation (the model's eos and
    any others); a grammar allows them only where its text may end. threads: the mask executor's
    (None: llguidance's default, 80% of the CPUs up to 32)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_ids: Sequence[int], threads: int | None = None):
        vocab = GrammarVocab.of(tokenizer, vocab_size, stop_ids)
        self.vocab_size = vocab.vocab_size
        self.stop_ids = vocab.stop_ids
        self.llg = vocab.llg()
        self.executor = LLExecutor(threads)
        self._builder = grammar_thread("grammar-matcher")
        self._compiled: OrderedDict[tuple[str, str], LLMatcher] = OrderedDict()  # by constraint, least recent first

    def check(self, grammar: str, steps: int = FORCED_STEPS) -> int | None:
        """check_grammar with this tokenizer."""
        return check_grammar(self.llg, grammar, steps)

    def matcher(self, grammar: str, outputs: Sequence[int] = ()) -> GrammarMatcher:
        """A matcher at the grammar's start, or past `outputs` (a request re-admitted after a
        preemption carries on from its tokens so far), built now. ValueError if the grammar is
        invalid or the outputs do not follow it."""
        built: Future[LLMatcher] = Future()
        built.set_result(_past(_built(self.llg, grammar), outputs))
        return GrammarMatcher(self, built)

    def structured_matcher(self, kind: str, text: str, outputs: Sequence[int] = ()) -> GrammarMatcher:
        """The matcher of a request's constraint past `outputs`, made on this tokenizer's grammar
        thread: its first use waits for it, and one that cannot be made is in error
        (GrammarMatcher.error says why)."""
        outputs = list(outputs)  # the caller's list grows meanwhile
        return GrammarMatcher(self, self._builder.submit(self._copied, kind, text, outputs))

    def _copied(self, kind: str, text: str, outputs: list[int]) -> LLMatcher:
        """(On the grammar thread.) A copy of the constraint's matcher compiled lately, else of one
        compiled now (structured_grammar's limits first), past `outputs`."""
        compiled = self._compiled.pop((kind, text), None) or _built(self.llg, structured_grammar(kind, text))
        self._compiled[(kind, text)] = compiled
        if len(self._compiled) > MATCHER_CACHE:
            self._compiled.popitem(last=False)
        return _past(compiled.deep_copy(), outputs)


def grammars_built_aside(tokenizer: Tokenizer, vocab_size: int, stop_ids: Sequence[int]) -> Callable[[], GrammarTokenizer]:
    """A GrammarTokenizer built on a thread of its own (llguidance releases the GIL while it builds),
    so a process serves at once: the function returned waits for it, and raises what building raised."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-tokenizer")
    built = pool.submit(GrammarTokenizer, tokenizer, vocab_size, list(stop_ids))
    pool.shutdown(wait=False)  # the thread ends with the build
    return built.result


class GrammarMatcher:
    """One request's place in its grammar; its matcher may still be building on a grammar thread
    (GrammarTokenizer.structured_matcher), and its first use waits for it. Owned by one thread at a
    time: llguidance refuses (with RuntimeError) a matcher used by two at once."""

    def __init__(self, tokenizer: GrammarTokenizer, built: Future[LLMatcher]):
        self.tokenizer = tokenizer
        self._built = built

    def _ready(self) -> LLMatcher | None:
        """The matcher, once built; None if it could not be (see error)."""
        return None if self._built.exception() is not None else self._built.result()

    def consume(self, token: int) -> None:
        """Advance past a sampled token. A token the mask did not allow puts the matcher in an
        error state for good (done, with error set), rather than raising mid-step."""
        if (matcher := self._ready()) is not None:
            matcher.consume_token(token)

    @property
    def done(self) -> bool:
        """The request ends here: the grammar is complete and cannot be extended (the next mask
        would allow only the stop tokens), a stop token was consumed, or the matcher is in error."""
        matcher = self._ready()
        return matcher is None or matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        """The text so far is complete: the stop tokens are allowed now."""
        matcher = self._ready()
        return matcher is not None and matcher.is_accepting()

    @property
    def error(self) -> str | None:
        """Why the grammar cannot be followed (its matcher could not be built, or has failed); None while it can."""
        if (failed := self._built.exception()) is not None:
            return str(failed)
        matcher = self._built.result()
        return _message(matcher.get_error()) if matcher.is_error() else None


def fill_masks(matchers: Sequence[GrammarMatcher], vocab_size: int) -> torch.Tensor:
    """The tokens each matcher allows next: a CPU int32 bitmask [rows, ceil(vocab_size / 32)], bit j
    of word w set when token 32w + j is allowed. Computed on the tokenizer's executor threads, with
    the GIL released; a done matcher allows only the stop tokens, one that could not be built none."""
    import torch  # not at the top: the gateway never makes masks

    # Not llguidance.torch's helpers: importing that module costs 3-4 s (its torch.compile'd
    # kernel pulls in dynamo), and allocate_token_bitmask pins every step's mask under CUDA.
    bitmask = torch.zeros(len(matchers), (vocab_size + 31) // 32, dtype=torch.int32)
    if matchers:
        tokenizer = matchers[0].tokenizer
        if vocab_size != tokenizer.vocab_size:
            raise ValueError(f"masks of {vocab_size} tokens asked of a grammar tokenizer of {tokenizer.vocab_size}")
        pairs = [(built, row) for row, m in enumerate(matchers) if (built := m._ready()) is not None]
        tokenizer.executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, len(matchers))
    return bitmask


def allows_any(mask_row: torch.Tensor, excluding: Sequence[int] = ()) -> bool:
    """Whether a fill_masks row allows some token not in `excluding`."""
    if not excluding:
        return bool(mask_row.any())
    words = [word & 0xFFFFFFFF for word in mask_row.tolist()]  # int32 words as unsigned bits
    for token in excluding:
        if token < 32 * len(words):
            words[token // 32] &= ~(1 << token % 32)
    return any(words)


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
