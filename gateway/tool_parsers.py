"""Tool calls in a model's own format -> OpenAI tool_calls, whole and streamed: hermes `<tool_call>`
JSON blocks (Qwen2.5, Qwen3) and Llama 3.1's JSON calls, after vLLM's hermes and llama3_json parsers.

A call is one only if it names a function the request offers: a client cannot run any other, so an
output naming one stays content, where the client sees what the model wrote. Text that does not
parse (bad JSON, or JSON nested past what the parser recurses into) stays content too."""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from typing import Any, Protocol

from pulseinfer.gateway.chat_text import ChatDelta, IdFactory, find_tag, make_tool_call_id, partial_tag

# --- Tool calls: shared -------------------------------------------------------------------------


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")  # json.loads takes NaN and Infinity; arguments must be JSON


# what a model's text may raise when parsed: JSON nested thousands deep exhausts the recursion limit
_PARSE_ERRORS = (ValueError, RecursionError)


def _loads(text: str) -> Any:
    return json.loads(text, parse_constant=_reject_constant)


def _named_call(obj: Any, argument_keys: tuple[str, ...], offered: Collection[str]) -> tuple[str, str] | None:
    """(name, arguments as a JSON string) of a call object, or None if it is not one: the name of an
    offered function and an object of arguments (under the first of argument_keys it has)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in offered:
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


def _hermes_call(body: str, offered: Collection[str]) -> tuple[str, str] | None:
    try:
        return _named_call(_loads(body), ("arguments",), offered)
    except _PARSE_ERRORS:
        return None


def parse_hermes_tool_calls(
    text: str, offered: Collection[str], new_id: IdFactory = make_tool_call_id
) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a whole output; `offered`: the names of the request's functions.

    A block runs from `<tool_call>` to the next `</tool_call>`, or to the end if none comes. A block
    whose body is not a call object (bad JSON, no offered name, no arguments object) stays in the content,
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
        call = _hermes_call(text[body_at : len(text) if end < 0 else end], offered)
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

    def __init__(self, offered: Collection[str], new_id: IdFactory = make_tool_call_id):
        self._offered = offered
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
                end = find_tag(self._buf, TOOL_END, self._scanned)
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
            cut = len(self._buf) - (0 if final else partial_tag(self._buf, TOOL_START))
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
        call = _hermes_call(body, self._offered)
        if call is None:
            content.append(self._text(raw))
            return
        self._held = ""  # a whitespace-only run before a call is dropped; a new run begins
        calls.extend(_tool_call_deltas(self._calls, self._new_id(), *call))
        self._calls += 1


# --- Llama 3.1 JSON tool calls: [<|python_tag|>]{"name": ..., "parameters": {...}}; {...} ---------

PYTHON_TAG = "<|python_tag|>"


def _llama_calls(text: str, offered: Collection[str]) -> list[tuple[str, str]] | None:
    """The calls of an output that is nothing but calls, or None. Calls must start the output (after
    whitespace, and <|python_tag|>), as in vLLM's stream (its whole parse takes JSON anywhere and drops
    the text around it); objects are separated by ';' and whitespace, and may nest as deep as the
    JSON parser recurses."""
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
            call = _named_call(obj, ("arguments", "parameters"), offered)  # Llama's prompts ask for either
        except _PARSE_ERRORS:
            return None
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


def parse_llama3_json_tool_calls(
    text: str, offered: Collection[str], new_id: IdFactory = make_tool_call_id
) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a whole output: calls and no content, or, if the output is not all
    calls of offered functions (_llama_calls), all of it as content (as vLLM, which returns the output
    on any error)."""
    calls = _llama_calls(text, offered)
    if calls is None:
        return text or None, []
    return None, [_tool_call(new_id(), *call) for call in calls]


class Llama3JsonToolStream(_BufferedToolStream):
    """parse_llama3_json_tool_calls, streamed: an output starting with `{` or <|python_tag|> (after
    whitespace) is buffered to the end, then sent as calls or as content; any other streams as content."""

    def __init__(self, offered: Collection[str], new_id: IdFactory = make_tool_call_id):
        self._offered = offered
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
        calls = _llama_calls(text, self._offered) if self._state == "calls" else None
        if calls is None:
            return ChatDelta(content=text)
        deltas = [d for index, call in enumerate(calls) for d in _tool_call_deltas(index, self._new_id(), *call)]
        return ChatDelta(tool_calls=tuple(deltas))


TOOL_PARSE: dict[str, Callable[[str, Collection[str], IdFactory], tuple[str | None, list[dict[str, Any]]]]] = {
    "hermes": parse_hermes_tool_calls,
    "llama3_json": parse_llama3_json_tool_calls,
}
TOOL_STREAM: dict[str, Callable[[Collection[str], IdFactory], ToolStream]] = {
    "hermes": HermesToolStream,
    "llama3_json": Llama3JsonToolStream,
}
