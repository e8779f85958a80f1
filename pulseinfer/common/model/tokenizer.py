"""Tokenizer and chat template, loaded from GGUF metadata or a Hugging Face directory.

Kept free of torch so the gateway can tokenize without loading the model stack.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

GGUF_TOKEN_TYPE_CONTROL = 3
GGUF_TOKEN_TYPE_USER_DEFINED = 4


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

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise TokenizerError("this model has no chat template; send a plain prompt instead")
        for message in messages:
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise TokenizerError("each chat message needs a 'role' and a 'content'")
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._token_text(self.special.bos_id),
            eos_token=self._token_text(self.special.eos_id),
        )

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        # The template already writes any BOS it wants.
        return self.encode(self.render_chat(messages), add_special=False)

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.backend.id_to_token(token_id) or "")

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any]) -> Tokenizer:
        kind = fields.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise TokenizerError(f"unsupported GGUF tokenizer model {kind!r} (supported: 'gpt2' byte-level BPE)")
        tokens: list[str] = fields["tokenizer.ggml.tokens"]
        types: list[int] = fields.get("tokenizer.ggml.token_type", [1] * len(tokens))
        merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
        backend = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        backend.decoder = decoders.ByteLevel()
        special = [t for t, ty in zip(tokens, types) if ty == GGUF_TOKEN_TYPE_CONTROL]
        user = [t for t, ty in zip(tokens, types) if ty == GGUF_TOKEN_TYPE_USER_DEFINED]
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
        backend.add_tokens([AddedToken(t, normalized=False) for t in user])
        return cls(
            backend,
            SpecialTokens(
                bos_id=fields.get("tokenizer.ggml.bos_token_id"),
                eos_id=fields.get("tokenizer.ggml.eos_token_id"),
                add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
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

    def save_hf_dir(self, path: Path) -> None:
        """Write tokenizer.json and tokenizer_config.json (used to build HF-format model dirs)."""
        self.backend.save(str(path / "tokenizer.json"))
        config = {
            "bos_token": self._token_text(self.special.bos_id) or None,
            "eos_token": self._token_text(self.special.eos_id) or None,
            "add_bos_token": self.special.add_bos,
            "chat_template": self.chat_template,
        }
        (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def _compile_template(source: str) -> jinja2.Template:
    # Same environment flags as HF transformers so templates render identically.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message: str) -> None:
        raise TokenizerError(f"chat template error: {message}")

    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without splitting UTF-8 characters.

    Decodes only a short window per token (the tokens since the last emitted text plus the
    few before them, which fix spacing), so a long output costs O(n), not O(n^2).
    """

    _CONTEXT = 4

    def __init__(self, tokenizer: Tokenizer, context_ids: list[int] | None = None):
        self.tokenizer = tokenizer
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
        before = self.tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
        after = self.tokenizer.decode(self._ids[self._prefix_offset :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # nothing printable yet, or an incomplete multi-byte character
        delta = after[len(before) :]
        self._prefix_offset = max(self._prefix_offset, len(self._ids) - self._CONTEXT)
        self._read_offset = len(self._ids)
        self.text += delta
        return delta


class TextStream:
    """Incremental detokenization with stop strings: text is emitted only once it can no
    longer turn out to be the start of a stop string, and ends before the first stop string."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = (), context_ids: list[int] | None = None):
        self._detok = IncrementalDetokenizer(tokenizer, context_ids)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.emitted = ""
        self.stopped = False

    def update(self, output_ids: list[int]) -> str:
        """Takes the whole output so far; returns the text it newly releases."""
        if self.stopped:
            return ""
        self._detok.add(output_ids[self._detok.num_tokens :])
        text = self._detok.text
        hits = [i for s in self._stop if (i := text.find(s, max(0, len(self.emitted) - self._hold))) >= 0]
        if hits:
            self.stopped = True
            return self._emit(text[: min(hits)])
        return self._emit(text[: len(text) - self._hold] if self._hold else text)

    def flush(self) -> str:
        """At the end of generation: release the held-back tail."""
        return "" if self.stopped else self._emit(self._detok.text)

    def _emit(self, upto: str) -> str:
        if len(upto) <= len(self.emitted):
            return ""
        delta, self.emitted = upto[len(self.emitted) :], upto
        return delta
