"""A chat model's generated text -> OpenAI chat response parts: reasoning_content, content, tool_calls.

Each parser comes twice: whole (a finished choice, non-streamed) and streamed (text deltas in, delta
parts out), after vLLM's qwen3 reasoning parser and its hermes and llama3_json tool parsers. Every
stream keeps one promise, which the tests check on every chunking of their texts: its deltas
concatenated (a tool call's arguments per index) equal the whole parse of the same text. Where vLLM's
whole and streamed answers differ, we take the one a stream can keep (each parser says where).

Text is not stripped around the tags, as in vLLM: Qwen3's `<think>\\nR\\n</think>\\n\\nC` gives
reasoning "\\nR\\n" and content "\\n\\nC". An empty part is None (whole) or "" (a delta).
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

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


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of text that begins tag: held back, the next delta may complete it."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _find(buf: str, tag: str, scanned: int) -> int:
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
        end = _find(self._buf, THINK_END, self._scanned)
        if end >= 0:
            reasoning, self._buf, self._state = self._buf[:end], self._buf[end + len(THINK_END) :], "content"
            return reasoning, self._drain(final)[1]
        if final:
            text, self._buf = self._buf, ""
            return (text, "") if self._state == "reasoning" else ("", text)
        if self._state == "undecided":
            self._scanned = len(self._buf)
            return "", ""
        cut = len(self._buf) - _partial_tag(self._buf, THINK_END)
        reasoning, self._buf = self._buf[:cut], self._buf[cut:]
        return reasoning, ""


# --- Tool calls: shared -------------------------------------------------------------------------


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")  # json.loads takes NaN and Infinity; arguments must be JSON


def _loads(text: str) -> Any:
    return json.loads(text, parse_constant=_reject_constant)


def _named_call(obj: Any, argument_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments as a JSON string) of a call object, or None if it is not one: a non-empty
    string name and an object of arguments (under the first of argument_keys it has)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = next((obj[key] for key in argument_keys if key in obj), None)
    if not isinstance(arguments, dict):
        return None
    return obj["name"], json.dumps(arguments, ensure_ascii=False)


def _tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _tool_call_deltas(index: int, call_id: str, name: str, arguments: str) -> tuple[dict[str, Any], ...]:
    head = {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
    return head, {"index": index, "function": {"arguments": arguments}}


class ToolStream(Protocol):
    def feed(self, delta: str) -> ChatDelta: ...

    def flush(self) -> ChatDelta: ...


# --- Hermes tool calls (Qwen2.5, Qwen3): <tool_call>{"name": ..., "arguments": {...}}</tool_call> ---

TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"


def _hermes_call(body: str) -> tuple[str, str] | None:
    try:
        return _named_call(_loads(body), ("arguments",))
    except ValueError:
        return None


def parse_hermes_tool_calls(text: str, new_id: IdFactory = make_tool_call_id) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a whole output.

    A block runs from `<tool_call>` to the next `</tool_call>`, or to the end if none comes. A block
    whose body is not a call object (bad JSON, no name, no arguments object) stays in the content,
    tags and all; vLLM would return the whole output as content, but a stream cannot take back the
    calls it already sent. The text outside the calls is the content (vLLM keeps only what precedes
    the first), less the whitespace-only runs between, before or after calls ("\\n" between blocks).
    """
    segments = [""]  # the text between calls
    calls: list[dict[str, Any]] = []
    pos = 0
    while (start := text.find(TOOL_START, pos)) >= 0:
        segments[-1] += text[pos:start]
        body_at = start + len(TOOL_START)
        end = text.find(TOOL_END, body_at)
        pos = len(text) if end < 0 else end + len(TOOL_END)
        call = _hermes_call(text[body_at : len(text) if end < 0 else end])
        if call is None:
            segments[-1] += text[start:pos]
        else:
            calls.append(_tool_call(new_id(), *call))
            segments.append("")
    segments[-1] += text[pos:]
    if calls:
        segments = [s for s in segments if not s.isspace()]
    return "".join(segments) or None, calls


class _BufferedToolStream:
    """A tool stream over a text buffer: each delta is appended and what can be sent is drained."""

    _buf: str

    def feed(self, delta: str) -> ChatDelta:
        self._buf += delta
        return self._drain(final=False)

    def flush(self) -> ChatDelta:
        return self._drain(final=True)

    def _drain(self, final: bool) -> ChatDelta:
        raise NotImplementedError


class HermesToolStream(_BufferedToolStream):
    """parse_hermes_tool_calls, streamed. Content streams as it comes, less a possible `<tool_call>`
    piece at its end, and less leading whitespace, held until it is known to precede no call. A block
    is buffered to its `</tool_call>` (or the end), then sent as a call (name, then all its arguments)
    or, if not one, as content."""

    def __init__(self, new_id: IdFactory = make_tool_call_id):
        self._new_id = new_id
        self._buf = ""  # text not emitted yet: a block's body after its <tool_call>, or content
        self._in_block = False
        self._scanned = 0  # in a block: how much of _buf holds no </tool_call>
        self._held: str | None = ""  # the whitespace a run of content began with; None once it had more
        self._calls = 0

    def _drain(self, final: bool) -> ChatDelta:
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        while True:
            if self._in_block:
                end = _find(self._buf, TOOL_END, self._scanned)
                if end < 0 and not final:
                    self._scanned = len(self._buf)
                    break
                stop = len(self._buf) if end < 0 else end + len(TOOL_END)
                body, raw, self._buf = self._buf[: len(self._buf) if end < 0 else end], TOOL_START + self._buf[:stop], self._buf[stop:]
                self._in_block = False
                self._close_block(body, raw, content, calls)
                continue
            start = self._buf.find(TOOL_START)
            if start >= 0:
                content.append(self._text(self._buf[:start]))
                self._buf, self._in_block, self._scanned = self._buf[start + len(TOOL_START) :], True, 0
                continue
            cut = len(self._buf) - (0 if final else _partial_tag(self._buf, TOOL_START))
            content.append(self._text(self._buf[:cut]))
            self._buf = self._buf[cut:]
            break
        if final and self._held:
            if not self._calls:  # whitespace-only runs are dropped only beside calls
                content.append(self._held)
            self._held = ""
        return ChatDelta(content="".join(content), tool_calls=tuple(calls))

    def _text(self, text: str) -> str:
        """The content to send for text outside blocks."""
        if self._held is None:
            return text
        if not text or text.isspace():
            self._held += text
            return ""
        text, self._held = self._held + text, None
        return text

    def _close_block(self, body: str, raw: str, content: list[str], calls: list[dict[str, Any]]) -> None:
        call = _hermes_call(body)
        if call is None:
            content.append(self._text(raw))
            return
        self._held = ""  # a whitespace-only run before a call is dropped; a new run begins
        calls.extend(_tool_call_deltas(self._calls, self._new_id(), *call))
        self._calls += 1


# --- Llama 3.1 JSON tool calls: [<|python_tag|>]{"name": ..., "parameters": {...}}; {...} ---------

PYTHON_TAG = "<|python_tag|>"


def _llama_calls(text: str) -> list[tuple[str, str]] | None:
    """The calls of an output that is nothing but calls, or None. Calls must start the output (after
    whitespace, and <|python_tag|>), as in vLLM's stream (its whole parse takes JSON anywhere and drops
    the text around it); objects are separated by ';' and whitespace, and may nest to any depth."""
    head = text.lstrip()
    if head.startswith(PYTHON_TAG):
        head = head[len(PYTHON_TAG) :]
    elif not head.startswith("{"):
        return None
    decoder = json.JSONDecoder(parse_constant=_reject_constant)
    calls: list[tuple[str, str]] = []
    pos = 0
    while True:
        pos = len(head) - len(head[pos:].lstrip())
        try:
            obj, pos = decoder.raw_decode(head, pos)
        except ValueError:
            return None
        call = _named_call(obj, ("arguments", "parameters"))  # Llama's prompts ask for either
        if call is None:
            return None
        calls.append(call)
        rest = head[pos:].lstrip()
        if not rest:
            return calls
        if not rest.startswith(";"):
            return None  # text after a call: not all calls
        rest = rest[1:].lstrip()
        if not rest:
            return calls  # a trailing ';'
        pos = len(head) - len(rest)


def parse_llama3_json_tool_calls(text: str, new_id: IdFactory = make_tool_call_id) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a whole output: calls and no content, or, if the output is not all
    calls (_llama_calls), all of it as content (as vLLM, which returns the output on any error)."""
    calls = _llama_calls(text)
    if calls is None:
        return text or None, []
    return None, [_tool_call(new_id(), *call) for call in calls]


class Llama3JsonToolStream(_BufferedToolStream):
    """parse_llama3_json_tool_calls, streamed: an output starting with `{` or <|python_tag|> (after
    whitespace) is buffered to the end, then sent as calls or as content; any other streams as content."""

    def __init__(self, new_id: IdFactory = make_tool_call_id):
        self._new_id = new_id
        self._buf = ""
        self._state = "start"  # start -> calls | content

    def _drain(self, final: bool) -> ChatDelta:
        if self._state == "start":
            head = self._buf.lstrip()
            if head.startswith(("{", PYTHON_TAG)):
                self._state = "calls"
            elif PYTHON_TAG.startswith(head) and not final:
                return ChatDelta()  # whitespace, or the start of <|python_tag|>
            else:
                self._state = "content"
        if self._state == "calls" and not final:
            return ChatDelta()
        text, self._buf = self._buf, ""
        calls = _llama_calls(text) if self._state == "calls" else None
        if calls is None:
            return ChatDelta(content=text)
        deltas = [d for index, call in enumerate(calls) for d in _tool_call_deltas(index, self._new_id(), *call)]
        return ChatDelta(tool_calls=tuple(deltas))


# --- By model family --------------------------------------------------------------------------

_TOOL_PARSE: dict[str, Callable[[str, IdFactory], tuple[str | None, list[dict[str, Any]]]]] = {
    "hermes": parse_hermes_tool_calls,
    "llama3_json": parse_llama3_json_tool_calls,
}
_TOOL_STREAM: dict[str, Callable[[IdFactory], ToolStream]] = {"hermes": HermesToolStream, "llama3_json": Llama3JsonToolStream}


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
    tool_format: str | None = None  # a key of _TOOL_PARSE

    def parse(self, text: str, *, think_open: bool | None = None, tools: bool = True, new_id: IdFactory = make_tool_call_id) -> ChatParts:
        """A whole output. tools: whether the request offered tools (without, calls stay content, as
        in vLLM); think_open: see split_qwen3_reasoning."""
        reasoning, content = split_qwen3_reasoning(text, think_open) if self.reasoning else (None, text or None)
        calls: list[dict[str, Any]] = []
        if tools and self.tool_format and content:
            content, calls = _TOOL_PARSE[self.tool_format](content, new_id)
        return ChatParts(reasoning, content, tuple(calls))

    def stream(self, *, think_open: bool | None = None, tools: bool = True, new_id: IdFactory = make_tool_call_id) -> ChatStream:
        """A stream whose deltas add up to parse() of the same text with the same arguments."""
        return ChatStream(
            Qwen3ReasoningStream(think_open) if self.reasoning else None,
            _TOOL_STREAM[self.tool_format](new_id) if tools and self.tool_format else None,
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
    """How one chat request's choices divide: the model's parser, whether the request offered tools
    (tool_choice not "none"), whether its prompt left a <think> open (the template may write it);
    or, for a forced tool_choice, the calls its constrained output holds."""

    parser: ChatParser
    tools: bool
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
        return self.forced is not None or self.parser.reasoning or (self.tools and self.parser.tool_format is not None)


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
