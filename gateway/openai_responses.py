"""OpenAI response objects: a whole choice's, a stream's chunks, usage (gateway/openai_api.py parses the requests)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from pulseinfer.gateway.chat_text import ChatParts
from pulseinfer.gateway.core import Final
from pulseinfer.messages.plan import Logprobs


@dataclass(frozen=True)
class ChoiceOutput:
    """What one choice produced, for the non-streamed response."""

    text: str
    token_ids: list[int]
    logprobs: Logprobs | None
    prompt_logprobs: Logprobs | None
    final: Final
    parts: ChatParts | None = None  # a chat's text divided (reasoning, tool calls); None: all content


def usage(finals: list[Final], n: int) -> dict:
    """The choices' usage, in choice order (n per prompt): each prompt counts once, as its first
    choice computed it (the others reuse its KV); every choice's tokens count."""
    firsts = finals[::n]
    prompt = sum(f.prompt_tokens for f in firsts)
    completion = sum(f.completion_tokens for f in finals)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(f.cached_tokens for f in firsts)},
    }


def finish_reason(final: Final, called: bool = False) -> str:
    """`called`: the choice called a tool (OpenAI's "tool_calls", unless it ran out of tokens)."""
    if final.finish_reason == "length":
        return "length"
    return "tool_calls" if called else "stop"


class ResponseShape:
    """Builds the objects of one endpoint: text_completion or chat.completion(.chunk)."""

    def __init__(self, chat: bool, model: str, request_id: str):
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.created = int(time.time())

    def _object(self, kind: str, choices: list, usage_body: dict | None) -> dict:
        body = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}
        if usage_body is not None:
            body["usage"] = usage_body
        return body

    def full(self, outputs: list[ChoiceOutput], n: int, logprobs: dict | None = None) -> dict:
        """Every choice, in index order; `logprobs`: each choice's logprobs object, by index."""
        choices = [self._choice(i, out, (logprobs or {}).get(i)) for i, out in enumerate(outputs)]
        return self._object("chat.completion" if self.chat else "text_completion", choices, usage([o.final for o in outputs], n))

    def _choice(self, index: int, out: ChoiceOutput, logprobs: dict | None) -> dict:
        if not self.chat:
            return {"index": index, "text": out.text, "logprobs": logprobs, "finish_reason": finish_reason(out.final)}
        parts = out.parts or ChatParts(content=out.text)
        reason = finish_reason(out.final, bool(parts.tool_calls))
        return {"index": index, "message": parts.message(), "logprobs": logprobs, "finish_reason": reason}

    def chunk(
        self, text: str | None, reason: str | None = None, role: bool = False, index: int = 0, logprobs: dict | None = None,
        parts: dict | None = None,
    ) -> dict:  # fmt: skip
        """`parts`: a chat delta's divided text (reasoning_content, content, tool_calls), for `text`."""
        if self.chat:
            text_parts = parts if parts is not None else {"content": text} if text is not None else {}
            delta = ({"role": "assistant"} if role else {}) | text_parts
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            return self._object("chat.completion.chunk", [choice], None)
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
        return self._object("text_completion", [choice], None)

    def usage_chunk(self, finals: list[Final], n: int) -> dict:
        return self._object("chat.completion.chunk" if self.chat else "text_completion", [], usage(finals, n))
