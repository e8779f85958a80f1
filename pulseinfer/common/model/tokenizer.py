"""Tokenizer and chat template, loaded from GGUF metadata or a Hugging Face directory.

Kept free of torch so the gateway can tokenize without loading the model stack.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

GGUF_TOKEN_TYPE_UNKNOWN = 2
GGUF_TOKEN_TYPE_CONTROL = 3
GGUF_TOKEN_TYPE_USER_DEFINED = 4

SPIECE_SPACE = "\u2581"  # SentencePiece's visible space, '▁'
# transformers builds these architectures' SentencePiece vocabularies Gemma's way (see _sentencepiece_vocab)
_GEMMA_ARCHITECTURES = frozenset({"gemma", "gemma2", "gemma3"})


class TokenizerError(ValueError):
    pass


@dataclass(frozen=True)
class SpecialTokens:
    bos_id: int | None
    eos_id: int | None
    add_bos: bool


class Tokenizer:
    def __init__(self, backend: HFTokenizer, special: SpecialTokens, chat_template: str | None):
        self.backend = backend
        self.special = special
        self.chat_template = chat_template
        self._template = _compile_template(chat_template) if chat_template else None

    @property
    def eos_id(self) -> int | None:
        return self.special.eos_id

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest token's text: a text of n characters has at least n / this many tokens."""
        return max(map(len, self.backend.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        # encode_batch releases the GIL (encode does not): a long prompt tokenized on a thread
        # leaves the gateway's event loop running
        ids = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special and self.special.add_bos and self.special.bos_id is not None:
            ids = [self.special.bos_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The template's text, as transformers' apply_chat_template renders it: `tools` as given
        (OpenAI's tool objects), `template_kwargs` (e.g. enable_thinking) as more variables."""
        if self._template is None:
            raise TokenizerError("this model has no chat template; send a plain prompt instead")
        for message in messages:
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise TokenizerError("each chat message needs a 'role' and a 'content'")
        try:
            return self._template.render(
                **(template_kwargs or {}),
                messages=messages,
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._token_text(self.special.bos_id),
                eos_token=self._token_text(self.special.eos_id),
            )
        except (jinja2.TemplateError, TypeError) as e:  # the template cannot render what the request holds
            raise TokenizerError(f"the chat template cannot render these messages: {e}") from None

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        # The template already writes any BOS it wants.
        return self.encode(self.render_chat(messages), add_special=False)

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.backend.id_to_token(token_id) or "")

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any]) -> Tokenizer:
        kind = fields.get("tokenizer.ggml.model")
        if kind == "gpt2":
            backend, add_bos_default = _byte_level_backend(fields), False
        elif kind == "llama":
            # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise
            backend, add_bos_default = _sentencepiece_backend(fields), True
        else:
            raise TokenizerError(f"unsupported GGUF tokenizer model {kind!r} (supported: 'gpt2' byte-level BPE, 'llama' SentencePiece BPE)")
        return cls(
            backend,
            SpecialTokens(
                bos_id=fields.get("tokenizer.ggml.bos_token_id"),
                eos_id=fields.get("tokenizer.ggml.eos_token_id"),
                add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", add_bos_default)),
            ),
            fields.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_hf_dir(cls, path: Path) -> Tokenizer:
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerError(f"{path} has no tokenizer.json")
        backend = HFTokenizer.from_file(str(tok_file))
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}

        def token_id(name: str) -> int | None:
            value = config.get(name)
            if isinstance(value, dict):
                value = value.get("content")
            return backend.token_to_id(value) if value else None

        return cls(
            backend,
            SpecialTokens(bos_id=token_id("bos_token"), eos_id=token_id("eos_token"), add_bos=bool(config.get("add_bos_token", False))),
            config.get("chat_template"),
        )

    def config(self) -> dict[str, Any]:
        """Its special tokens and chat template, as Hugging Face's tokenizer_config.json writes them."""
        return {
            "bos_token": self._token_text(self.special.bos_id) or None,
            "eos_token": self._token_text(self.special.eos_id) or None,
            "add_bos_token": self.special.add_bos,
            "chat_template": self.chat_template,
        }

    def save_hf_dir(self, path: Path) -> None:
        """Write tokenizer.json and tokenizer_config.json (used to build HF-format model dirs)."""
        self.backend.save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(json.dumps(self.config(), indent=1))


def _byte_level_backend(fields: dict[str, Any]) -> HFTokenizer:
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    types = _token_types(fields)
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
    backend = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    special = [t for t, ty in zip(tokens, types) if ty == GGUF_TOKEN_TYPE_CONTROL]
    user = [t for t, ty in zip(tokens, types) if ty == GGUF_TOKEN_TYPE_USER_DEFINED]
    _add_whole_tokens(backend, special, user)
    return backend


def _sentencepiece_backend(fields: dict[str, Any]) -> HFTokenizer:
    """SentencePiece BPE with byte fallback, built as transformers builds it from the same GGUF
    (integrations/gguf/gguf_tokenizer_mapping.py with GemmaTokenizer / LlamaTokenizer)."""
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    types = _token_types(fields)
    vocab, merges = _sentencepiece_vocab(fields)
    unk = _token_at(tokens, fields.get("tokenizer.ggml.unknown_token_id"))
    if unk is None:
        unk = next((t for t, ty in zip(tokens, types) if ty == GGUF_TOKEN_TYPE_UNKNOWN), None)
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    _set_sentencepiece_pipeline(backend, add_space_prefix=bool(fields.get("tokenizer.ggml.add_space_prefix", True)))
    # The named tokens count as special even when the file does not mark them control (a
    # llama vocabulary marks <unk> 'unknown'), as transformers makes them.
    named = [_token_at(tokens, fields.get(f"tokenizer.ggml.{key}_token_id")) for key in ("bos", "eos", "unknown", "padding")]
    special = [t for t, ty in zip(tokens, types) if ty in (GGUF_TOKEN_TYPE_CONTROL, GGUF_TOKEN_TYPE_UNKNOWN)]
    special += [t for t in named if t is not None and t not in special]
    # A user-defined token is only kept whole if the vocabulary spells it as the file does; Gemma's
    # runs of spaces, respelled in _sentencepiece_vocab, are reached through merges instead.
    user = [t for t, ty in zip(tokens, types) if ty == GGUF_TOKEN_TYPE_USER_DEFINED and t in vocab]
    _add_whole_tokens(backend, special, user)
    return backend


def _sentencepiece_vocab(fields: dict[str, Any]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The vocabulary and its merges: the file's merges if it has them, else derived from the tokens.

    Gemma needs two fixes (as in transformers): its runs of two or more spaces are stored as real
    spaces but looked up as '▁' runs (the normalizer turns spaces into '▁'), so they are respelled;
    and its scores do not follow its merge order -- the order of the tokens in the file does.
    """
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    gemma = fields.get("general.architecture") in _GEMMA_ARCHITECTURES
    if gemma:
        tokens = [SPIECE_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}  # a repeated token keeps its last id, as in tokenizers
    if "tokenizer.ggml.merges" in fields:
        return vocab, [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
    scores = fields.get("tokenizer.ggml.scores")
    if gemma or scores is None:
        ranks = list(vocab.values())
    else:
        ranks = [-scores[i] for i in vocab.values()]  # a higher score merges first
    return vocab, _derived_merges(list(vocab), ranks)


def _derived_merges(tokens: list[str], ranks: list[float]) -> list[tuple[str, str]]:
    """The merges a vocabulary implies: every split of a token into two tokens, ordered by the
    token's rank (lowest first), then longer left half, then longer token -- the order of
    transformers' generate_merges. One pass in rank order, so only tied ranks need a sort
    (under a second for Gemma's 262k tokens)."""
    rank = dict(zip(tokens, ranks))
    by_rank = sorted(tokens, key=rank.__getitem__)  # stable: tied tokens keep file order
    merges = [
        (left, right)
        for token in by_rank
        for k in range(len(token) - 1, 0, -1)
        if (left := token[:k]) in rank and (right := token[k:]) in rank
    ]
    if len(set(ranks)) < len(ranks):  # only tied tokens' merges can be out of order
        merges.sort(key=lambda m: (rank[m[0] + m[1]], -len(m[0]), -len(m[1])))
    return merges


def _set_sentencepiece_pipeline(backend: HFTokenizer, add_space_prefix: bool) -> None:
    steps = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        # LlamaTokenizer's way: '▁' before the text's first piece only, taken off again on decode
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPIECE_SPACE, prepend_scheme="first", split=False)
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    else:
        # GemmaTokenizer's way. No pre-tokenizer: BPE sees each stretch between added tokens
        # whole, as SentencePiece does (GemmaTokenizer's Split(" ") finds no space left to split on).
        backend.normalizer = normalizers.Replace(" ", SPIECE_SPACE)
    backend.decoder = decoders.Sequence(steps)


def _add_whole_tokens(backend: HFTokenizer, special: list[str], user: list[str]) -> None:
    """Control tokens become special (matched whole, dropped by decode(skip_special)); user-defined
    ones plain added tokens (matched whole, kept on decode)."""
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    backend.add_tokens([AddedToken(t, normalized=False) for t in user])


def _token_types(fields: dict[str, Any]) -> list[int]:
    return fields.get("tokenizer.ggml.token_type", [1] * len(fields["tokenizer.ggml.tokens"]))


def _token_at(tokens: list[str], token_id: int | None) -> str | None:
    return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None


def _compile_template(source: str) -> jinja2.Template:
    # transformers' environment (apply_chat_template), so that templates render identically: its
    # flags and loop controls, its tojson (JSON as json.dumps writes it: no HTML escapes, keys in
    # order, where Jinja's sorts and escapes), strftime_now, and a {% generation %} block that
    # renders its body (transformers tracks assistant tokens with it)
    extensions = [_Generation, jinja2.ext.loopcontrols]
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=extensions)

    def raise_exception(message: str) -> None:
        raise TokenizerError(f"chat template error: {message}")

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return env.from_string(source)


class _Generation(jinja2.ext.Extension):
    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without splitting UTF-8 characters.

    Decodes only a short window per token (the tokens since the last emitted text plus the
    few before them, which fix spacing), so a long output costs O(n), not O(n^2).
    """

    _CONTEXT = 4

    def __init__(self, tokenizer: Tokenizer, context_ids: list[int] | None = None, skip_special: bool = True):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._ids = list(context_ids[-self._CONTEXT :]) if context_ids else []
        self._num_context = len(self._ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""

    @property
    def num_tokens(self) -> int:
        return len(self._ids) - self._num_context

    def add(self, token_ids: list[int]) -> str:
        self._ids.extend(token_ids)
        before = self.tokenizer.decode(self._ids[self._prefix_offset : self._read_offset], self.skip_special)
        after = self.tokenizer.decode(self._ids[self._prefix_offset :], self.skip_special)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # nothing printable yet, or an incomplete multi-byte character
        delta = after[len(before) :]
        self._prefix_offset = max(self._prefix_offset, len(self._ids) - self._CONTEXT)
        self._read_offset = len(self._ids)
        self.text += delta
        return delta


class TextStream:
    """Incremental detokenization with stop strings: text is emitted only once it can no
    longer turn out to be the start of a stop string, and ends before the first stop string
    (`include_stop`: after it). The text of the first `min_tokens` tokens is never searched
    (vLLM's min_tokens). `skip_special`: special tokens (end of turn, ...) write no text."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: tuple[str, ...] = (),
        context_ids: list[int] | None = None,
        min_tokens: int = 0,
        skip_special: bool = True,
        include_stop: bool = False,
    ):
        self._detok = IncrementalDetokenizer(tokenizer, context_ids, skip_special)
        self.stops = stop
        self.include_stop = include_stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.min_tokens = min_tokens
        self._searched_from: int | None = 0 if min_tokens == 0 else None  # None: short of min_tokens
        self.emitted = ""
        self.stopped = False

    def update(self, output_ids: list[int]) -> str:
        """Takes the whole output so far; returns the text it newly releases."""
        if self.stopped:
            return ""
        if self._searched_from is None:
            self._detok.add(output_ids[self._detok.num_tokens : self.min_tokens])
            if self._detok.num_tokens < self.min_tokens:
                return self._emit(self._detok.text)
            self._searched_from = len(self._detok.text)
        self._detok.add(output_ids[self._detok.num_tokens :])
        text = self._detok.text
        start = max(self._searched_from, len(self.emitted) - self._hold)
        hits = [(i, i + len(s) if self.include_stop else i) for s in self.stops if (i := text.find(s, start)) >= 0]
        if hits:
            self.stopped = True
            return self._emit(text[: min(hits)[1]])
        return self._emit(text[: len(text) - self._hold] if self._hold else text)

    def flush(self) -> str:
        """At the end of generation: release the held-back tail."""
        return "" if self.stopped else self._emit(self._detok.text)

    def _emit(self, upto: str) -> str:
        if len(upto) <= len(self.emitted):
            return ""
        delta, self.emitted = upto[len(self.emitted) :], upto
        return delta
