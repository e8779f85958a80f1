"""A chat model's generated text -> OpenAI chat response parts: reasoning_content, content, tool_calls.

Each parser comes twice: whole (a finished choice, non-streamed) and streamed (text deltas in, delta
parts out), after vLLM's qwen3 reasoning parser and its hermes and llama3_json tool parsers. Every
stream keeps one promise, which the tests check on every chunking of their texts: its deltas
concatenated (a tool call's arguments per index) equal the whole parse of the same text. Where vLLM's
whole and streamed answers differ, we take the one a stream can keep (each parser says where).

The parts and Qwen3's reasoning split are in gateway/chat_text.py, the tool-call formats in
gateway/tool_parsers.py; here they are put together by model family.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Protocol

from pulseinfer.gateway.chat_text import (
    ChatDelta,
    ChatParts,
    IdFactory,
    Qwen3ReasoningStream,
    make_tool_call_id,
    split_qwen3_reasoning,
)
from pulseinfer.gateway.tool_parsers import TOOL_PARSE, TOOL_STREAM, ToolStream

# --- By model family --------------------------------------------------------------------------


class ChatStream:
    """One choice's stream: reasoning split first (if any), then tool calls parsed from its content."""

    def __init__(self, reasoning: Qwen3ReasoningStream | None, tools: ToolStream | None):
        self._reasoning = reasoning
        self._tools = tools
        self.called = False  # it has sent a tool call (the choice finishes with "tool_calls")

    def feed(self, delta: str) -> ChatDelta:
        reasoning, content = self._reasoning.feed(delta) if self._reasoning else ("", delta)
        return self._step(reasoning, content, final=False)

    def flush(self) -> ChatDelta:
        reasoning, content = self._reasoning.flush() if self._reasoning else ("", "")
        return self._step(reasoning, content, final=True)

    def _step(self, reasoning: str, content: str, final: bool) -> ChatDelta:
        if self._tools is None:
            return ChatDelta(reasoning, content)
        out = ChatDelta(reasoning) + self._tools.feed(content)
        out = out + self._tools.flush() if final else out
        self.called |= bool(out.tool_calls)
        return out


@dataclass(frozen=True)
class ChatParser:
    """How one model family's output divides: reasoning (Qwen3's <think>) and a tool call format."""

    name: str
    reasoning: bool = False
    tool_format: str | None = None  # a key of tool_parsers.TOOL_PARSE

    def parse(
        self, text: str, *, think_open: bool | None = None, tools: Collection[str] = (), new_id: IdFactory = make_tool_call_id
    ) -> ChatParts:
        """A whole output. tools: the names of the functions the request offers, the only ones a call
        may name (none: calls stay content, as in vLLM); think_open: see split_qwen3_reasoning."""
        reasoning, content = split_qwen3_reasoning(text, think_open) if self.reasoning else (None, text or None)
        calls: list[dict[str, Any]] = []
        if tools and self.tool_format and content:
            content, calls = TOOL_PARSE[self.tool_format](content, tools, new_id)
        return ChatParts(reasoning, content, tuple(calls))

    def stream(self, *, think_open: bool | None = None, tools: Collection[str] = (), new_id: IdFactory = make_tool_call_id) -> ChatStream:
        """A stream whose deltas add up to parse() of the same text with the same arguments."""
        return ChatStream(
            Qwen3ReasoningStream(think_open) if self.reasoning else None,
            TOOL_STREAM[self.tool_format](tools, new_id) if tools and self.tool_format else None,
        )


PARSERS: dict[str, ChatParser] = {
    parser.name: parser
    for parser in (
        ChatParser("none"),
        ChatParser("qwen3", reasoning=True, tool_format="hermes"),
        ChatParser("hermes", tool_format="hermes"),
        ChatParser("llama3_json", tool_format="llama3_json"),
    )
}


# the parser `auto` picks for a model family (config.json's model_type): its chat template's formats
AUTO_PARSERS = {"qwen3": "qwen3", "qwen2": "hermes", "llama": "llama3_json"}


class DividedStream(Protocol):
    called: bool  # it has sent a tool call

    def feed(self, delta: str) -> ChatDelta: ...

    def flush(self) -> ChatDelta: ...


class ForcedOutput(Protocol):
    """An output a constraint shaped (structured.ForcedToolCalls), parsed in place of the model's format."""

    def parse(self, text: str) -> ChatParts: ...

    def stream(self) -> DividedStream: ...


@dataclass(frozen=True)
class ChatOutput:
    """How one chat request's choices divide: the model's parser, the functions its output may call
    (those offered; none with tool_choice "none"), whether its prompt left a <think> open (the
    template may write it); or, for a forced tool_choice, the calls its constrained output holds."""

    parser: ChatParser
    tools: frozenset[str]
    think_open: bool | None
    forced: ForcedOutput | None = None

    def parse(self, text: str) -> ChatParts:
        if self.forced is not None:
            return self.forced.parse(text)
        return self.parser.parse(text, think_open=self.think_open, tools=self.tools)

    def stream(self) -> DividedStream:
        if self.forced is not None:
            return self.forced.stream()
        return self.parser.stream(think_open=self.think_open, tools=self.tools)

    @property
    def divides(self) -> bool:
        """Whether a choice's text is anything but content."""
        return self.forced is not None or self.parser.reasoning or (bool(self.tools) and self.parser.tool_format is not None)


def chat_parser_for(name: str, family: str) -> ChatParser:
    """The parser a server uses: `name`, or with "auto" its model family's (none for a family without one)."""
    return parser_for(AUTO_PARSERS.get(family, "none") if name == "auto" else name)


def parser_for(family: str) -> ChatParser:
    """The parser named family ("qwen3", "hermes", "llama3_json", "none"); ValueError naming the
    known ones if there is none."""
    try:
        return PARSERS[family]
    except KeyError:
        raise ValueError(f"no chat parser {family!r} (known: {', '.join(sorted(PARSERS))})") from None
