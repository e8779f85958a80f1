"""The parts a chat choice's text divides into (reasoning_content, content, tool_calls), whole and as
stream deltas, and Qwen3's reasoning split, after vLLM's qwen3 reasoning parser (gateway/chat_parsers.py
puts the parsers together).

Text is not stripped around the tags, as in vLLM: Qwen3's `<think>\\nR\\n</think>\\n\\nC` gives
reasoning "\\nR\\n" and content "\\n\\nC". An empty part is None (whole) or "" (a delta).
"""

from __future__ import annotations

import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

IdFactory = Callable[[], str]
_ID_CHARS = string.ascii_letters + string.digits


def make_tool_call_id() -> str:
    """'call_' and 24 random alphanumerics, as vLLM's (OpenAI's are 'call_' and 24 too)."""
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


@dataclass(frozen=True)
class ChatParts:
    """A whole choice, parsed. tool_calls: OpenAI's {id, type, function: {name, arguments}} objects."""

    reasoning: str | None = None
    content: str | None = None
    tool_calls: tuple[dict[str, Any], ...] = ()

    def message(self) -> dict[str, Any]:
        """The OpenAI assistant message (reasoning_content only when there is some, as vLLM's)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = list(self.tool_calls)
        return message


@dataclass(frozen=True)
class ChatDelta:
    """What one streamed text delta adds. A tool call's first delta has index, id, type,
    function.name and arguments ""; its later ones index and function.arguments to append."""

    reasoning: str = ""
    content: str = ""
    tool_calls: tuple[dict[str, Any], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def __add__(self, other: ChatDelta) -> ChatDelta:
        return ChatDelta(self.reasoning + other.reasoning, self.content + other.content, self.tool_calls + other.tool_calls)

    def delta(self) -> dict[str, Any]:
        """The OpenAI chunk's choices[i].delta, without the empty parts."""
        out: dict[str, Any] = {}
        if self.reasoning:
            out["reasoning_content"] = self.reasoning
        if self.content:
            out["content"] = self.content
        if self.tool_calls:
            out["tool_calls"] = list(self.tool_calls)
        return out


def partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of text that begins tag: held back, the next delta may complete it."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def find_tag(buf: str, tag: str, scanned: int) -> int:
    """buf.find(tag), skipping what an earlier search of a prefix of buf (scanned chars) ruled out:
    a long buffered block is not searched again from its start on every delta."""
    return buf.find(tag, max(0, scanned - len(tag) + 1))


# --- Qwen3 reasoning: <think>...</think> ---------------------------------------------------------

THINK_START, THINK_END = "<think>", "</think>"


def prompt_opens_think(prompt: str) -> bool:
    """Whether a rendered chat prompt ends inside an open <think>, so the output begins mid-reasoning:
    the Qwen3-2507 Thinking and Qwen3.5 templates end the prompt with `<think>\\n`; Qwen3's with
    enable_thinking false closes it (`<think>\\n\\n</think>\\n\\n`); its default leaves it to the model."""
    return prompt.rfind(THINK_START) > prompt.rfind(THINK_END)


def split_qwen3_reasoning(text: str, think_open: bool | None = None) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole output. think_open: whether the prompt opened <think>
    (prompt_opens_think); None when unknown.

    A `<think>` starting the output (after any whitespace, which is dropped) opens reasoning, as does
    think_open true; open reasoning runs to the first `</think>`, or to the end if none comes (the
    output was cut short: vLLM's stream says the same, while the whole parse of some vLLM versions
    called it content). Otherwise the output is content, except that with think_open None a
    `</think>` anywhere makes what precedes it reasoning (vLLM's guess for a prompt-opened <think>).
    """
    head = text.lstrip()
    if head.startswith(THINK_START):
        body, opened = head[len(THINK_START) :], True
    else:
        body, opened = text, think_open is True
    if opened or (think_open is None and THINK_END in body):
        reasoning, _, content = body.partition(THINK_END)
        return reasoning or None, content or None
    return None, text or None


class Qwen3ReasoningStream:
    """split_qwen3_reasoning, streamed: feed(delta) and flush() give (reasoning, content) deltas.

    No tag, nor a piece of one, is ever emitted: a delta ending in `</th` is held until the next
    resolves it. With think_open true or false only a possible tag is held back. With None, an output
    not opening with `<think>` is held whole until a `</think>` (then reasoning before it) or the end
    (then content): only then is it known which it was. The gateway knows; pass prompt_opens_think.
    """

    def __init__(self, think_open: bool | None = None):
        self._think_open = think_open
        self._state = "start"  # start -> reasoning | undecided | content; undecided -> content
        self._buf = ""  # text not emitted yet
        self._scanned = 0  # undecided: how much of _buf holds no </think>

    def feed(self, delta: str) -> tuple[str, str]:
        self._buf += delta
        return self._drain(final=False)

    def flush(self) -> tuple[str, str]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, str]:
        if self._state == "start":
            head = self._buf.lstrip()
            if head.startswith(THINK_START):
                self._buf, self._state = head[len(THINK_START) :], "reasoning"
            elif THINK_START.startswith(head) and not final:
                return "", ""  # whitespace, or the start of a <think>
            else:
                self._state = {True: "reasoning", False: "content", None: "undecided"}[self._think_open]
        if self._state == "content":
            content, self._buf = self._buf, ""
            return "", content
        end = find_tag(self._buf, THINK_END, self._scanned)
        if end >= 0:
            reasoning, self._buf, self._state = self._buf[:end], self._buf[end + len(THINK_END) :], "content"
            return reasoning, self._drain(final)[1]
        if final:
            text, self._buf = self._buf, ""
            return (text, "") if self._state == "reasoning" else ("", text)
        if self._state == "undecided":
            self._scanned = len(self._buf)
            return "", ""
        cut = len(self._buf) - partial_tag(self._buf, THINK_END)
        reasoning, self._buf = self._buf[:cut], self._buf[cut:]
        return reasoning, ""
