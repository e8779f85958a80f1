"""gateway/chat_parsers.py: hand-written whole parses, and every stream against the whole parse of
the same text over many chunkings (one character at a time, every split in two, seeded random)."""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest

from pulseinfer.gateway.chat_parsers import parser_for
from pulseinfer.gateway.chat_text import (
    ChatDelta,
    ChatParts,
    Qwen3ReasoningStream,
    make_tool_call_id,
    prompt_opens_think,
    split_qwen3_reasoning,
)
from pulseinfer.gateway.tool_parsers import parse_hermes_tool_calls, parse_llama3_json_tool_calls

OFFERED = frozenset({"get_weather", "get_time", "f", "a", "b"})  # the functions the texts' requests offer


def ids():
    """A fresh id factory: the whole parse and a stream of the same text name their calls alike."""
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def call(n: int, name: str, arguments: dict) -> dict:
    return {"id": f"call_{n}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def chunkings(text: str, seed: int = 0, randoms: int = 12) -> list[list[str]]:
    """Whole, one character at a time, every split in two, and seeded random chunkings."""
    out = [[text], list(text)]
    out += [[text[:i], text[i:]] for i in range(1, len(text))]
    rng = random.Random(seed)
    for _ in range(randoms):
        pieces, i = [], 0
        while i < len(text):
            n = rng.randint(1, 9)
            pieces.append(text[i : i + n])
            i += n
        out.append(pieces)
    return out


def collect(deltas: list[ChatDelta]) -> ChatParts:
    """Deltas reassembled as a client does: text concatenated, a call's arguments per index."""
    calls: dict[int, dict] = {}
    for delta in deltas:
        for part in delta.tool_calls:
            index = part["index"]
            if index not in calls:
                assert set(part) == {"index", "id", "type", "function"} and part["type"] == "function"
                assert part["function"]["arguments"] == "" and part["function"]["name"]
                calls[index] = {"id": part["id"], "type": "function", "function": dict(part["function"])}
            else:
                assert set(part) == {"index", "function"} and set(part["function"]) == {"arguments"}
                calls[index]["function"]["arguments"] += part["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    reasoning = "".join(d.reasoning for d in deltas)
    content = "".join(d.content for d in deltas)
    return ChatParts(reasoning or None, content or None, tuple(calls[i] for i in range(len(calls))))


def streamed(family: str, pieces: list[str], **kwargs) -> ChatParts:
    stream = parser_for(family).stream(new_id=ids(), **kwargs)
    return collect([stream.feed(p) for p in pieces] + [stream.flush()])


def assert_streams_agree(family: str, text: str, **kwargs) -> ChatParts:
    whole = parser_for(family).parse(text, new_id=ids(), **kwargs)
    for pieces in chunkings(text, seed=len(text)):
        assert streamed(family, pieces, **kwargs) == whole, pieces
    return whole


# --- Qwen3 reasoning -----------------------------------------------------------------------------

MODES = (True, False, None)


@pytest.mark.parametrize(
    "text, think_open, expected",
    [
        # vLLM strips neither the newlines inside the tags nor those after
        ("<think>\nLet me greet.\n</think>\n\nHello!", None, ("\nLet me greet.\n", "\n\nHello!")),
        ("<think>\nLet me greet.\n</think>\n\nHello!", False, ("\nLet me greet.\n", "\n\nHello!")),
        ("<think>\nLet me greet.\n</think>\n\nHello!", True, ("\nLet me greet.\n", "\n\nHello!")),
        ("\n<think>r</think>c", False, ("r", "c")),  # whitespace before <think> is dropped
        ("<think>r</think>", None, ("r", None)),
        ("<think></think>c", None, (None, "c")),
        ("<think>\n\n</think>\n\nHi", False, ("\n\n", "\n\nHi")),
        # no think at all: content
        ("Hello there.", None, (None, "Hello there.")),
        ("Hello there.", False, (None, "Hello there.")),
        ("", None, (None, None)),
        # the prompt opened <think>: the output starts mid-reasoning
        ("I think so.\n</think>\n\nYes.", True, ("I think so.\n", "\n\nYes.")),
        ("I think so.\n</think>\n\nYes.", None, ("I think so.\n", "\n\nYes.")),
        ("I think so.\n</think>\n\nYes.", False, (None, "I think so.\n</think>\n\nYes.")),
        ("still thinking", True, ("still thinking", None)),
        # an unclosed <think> (cut short by max_tokens): reasoning, as vLLM streams it
        ("<think>\nhmm, let me", None, ("\nhmm, let me", None)),
        ("<think>\nhmm, let me", False, ("\nhmm, let me", None)),
        # only the first </think> closes; a <think> later in the content is text
        ("<think>a</think>b</think>c<think>d", None, ("a", "b</think>c<think>d")),
        ("Use <think> tags.", False, (None, "Use <think> tags.")),
        ("<thi", None, (None, "<thi")),
        ("<thi", True, ("<thi", None)),
    ],
)
def test_split_qwen3_reasoning(text, think_open, expected):
    assert split_qwen3_reasoning(text, think_open) == expected
    assert parser_for("qwen3").parse(text, think_open=think_open) == ChatParts(*expected)


REASONING_TEXTS = [
    "<think>\nLet me greet.\n</think>\n\nHello!",
    "  <think>r</think>c",
    "<think>\nhmm, let me",
    "I think so.\n</think>\n\nYes.",
    "Hello there, <this> is </thinking> text.",
    "<think>a</th</think>b</think>c<think>d",
    "<think><think></think>",
    "<thi",
    "\n\n",
    "",
    "</think>",
    "<think>x</think",
]


@pytest.mark.parametrize("think_open", MODES)
@pytest.mark.parametrize("text", REASONING_TEXTS)
def test_reasoning_streams_agree(text, think_open):
    assert_streams_agree("qwen3", text, think_open=think_open)


def test_reasoning_stream_holds_back_only_a_tag_piece():
    stream = Qwen3ReasoningStream(think_open=False)
    assert stream.feed("<th") == ("", "")
    assert stream.feed("ink>\nStep one") == ("\nStep one", "")
    assert stream.feed(". Done</th") == (". Done", "")
    assert stream.feed("ink") == ("", "")
    assert stream.feed(">\n\nAns") == ("", "\n\nAns")
    assert stream.feed("wer </think>") == ("", "wer </think>")
    assert stream.flush() == ("", "")


def test_reasoning_stream_sends_a_false_tag_piece_once_it_is_not_one():
    stream = Qwen3ReasoningStream(think_open=True)
    assert stream.feed("a </") == ("a ", "")
    assert stream.feed("b") == ("</b", "")
    assert stream.feed("</think") == ("", "")
    assert stream.flush() == ("</think", "")


def test_reasoning_stream_without_think_open_waits_for_the_answer():
    # not knowing the prompt, text before a </think> may be reasoning: it is held until one comes or the end
    stream = Qwen3ReasoningStream(think_open=None)
    assert stream.feed("Hello") == ("", "")
    assert stream.feed(" world") == ("", "")
    assert stream.flush() == ("", "Hello world")
    stream = Qwen3ReasoningStream(think_open=None)
    assert stream.feed("mull") == ("", "")
    assert stream.feed("ing</think>ok") == ("mulling", "ok")
    assert stream.feed("!") == ("", "!")
    # a prompt that did not open <think>: content streams at once
    assert Qwen3ReasoningStream(think_open=False).feed("Hello") == ("", "Hello")


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", False),
        ("<|im_start|>assistant\n<think>\n", True),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
        ("<think>\nold</think>\n\nold answer<|im_end|>\n<|im_start|>assistant\n<think>\n", True),
    ],
)
def test_prompt_opens_think(prompt, expected):
    assert prompt_opens_think(prompt) is expected


# --- Hermes tool calls ---------------------------------------------------------------------------

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, {"unit": "°C"}]}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
WEATHER_CALL = {"city": "Paris", "days": [1, {"unit": "°C"}]}


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("No tools needed.", "No tools needed.", []),
        (WEATHER, None, [call(0, "get_weather", WEATHER_CALL)]),
        (WEATHER + "\n" + TIME, None, [call(0, "get_weather", WEATHER_CALL), call(1, "get_time", {})]),
        (WEATHER + "\n" + TIME + "\n", None, [call(0, "get_weather", WEATHER_CALL), call(1, "get_time", {})]),
        ("Let me check.\n\n" + WEATHER, "Let me check.\n\n", [call(0, "get_weather", WEATHER_CALL)]),
        (TIME + " Done.", " Done.", [call(0, "get_time", {})]),
        # a block that is no call stays content, tags and all; the others are calls
        ('<tool_call>\n{"name": "f", "arguments": {\n</tool_call>', '<tool_call>\n{"name": "f", "arguments": {\n</tool_call>', []),
        ("<tool_call>{bad}</tool_call>\n" + TIME, "<tool_call>{bad}</tool_call>\n", [call(0, "get_time", {})]),
        ('<tool_call>{"name": "f"}</tool_call>', '<tool_call>{"name": "f"}</tool_call>', []),
        ('<tool_call>{"name": "f", "arguments": NaN}</tool_call>', '<tool_call>{"name": "f", "arguments": NaN}</tool_call>', []),
        # an unclosed block (cut short): a call if its JSON is whole
        ('<tool_call>\n{"name": "get_time", "arguments": {}}\n', None, [call(0, "get_time", {})]),
        ('<tool_call>\n{"name": "get_time", "argu', '<tool_call>\n{"name": "get_time", "argu', []),
        ("\n\n", "\n\n", []),
    ],
)
def test_parse_hermes_tool_calls(text, content, calls):
    assert parse_hermes_tool_calls(text, OFFERED, ids()) == (content, calls)


HERMES_TEXTS = [
    "No tools needed. <tool is not a tag",
    WEATHER + "\n" + TIME,
    "Let me check.\n\n" + WEATHER + "\n\n",
    "\n" + TIME + " Done. " + TIME,
    "<tool_call>{bad}</tool_call>\n" + TIME + "\n<tool_call>[1]</tool_call>\n",
    '<tool_call>\n{"name": "get_time", "arguments": {}}',
    '<tool_call>\n{"name": "get_time", "argu',
    '<tool_call>{"name": "f", "arguments": {"s": "</tool_"}}</tool_call>',
    "<tool_cal",
    "  ",
]


@pytest.mark.parametrize("text", HERMES_TEXTS)
def test_hermes_streams_agree(text):
    assert_streams_agree("hermes", text, tools=OFFERED)


def test_hermes_stream_deltas():
    stream = parser_for("hermes").stream(tools=OFFERED, new_id=ids())
    assert stream.feed("Sure. <tool") == ChatDelta(content="Sure. ")
    assert stream.feed('_call>\n{"name": "get_time", ') == ChatDelta()
    delta = stream.feed('"arguments": {"tz": "UTC"}}\n</tool_call>\n')
    assert delta.tool_calls == (
        {"index": 0, "id": "call_0", "type": "function", "function": {"name": "get_time", "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"tz": "UTC"}'}},
    )
    assert delta.delta() == {"tool_calls": list(delta.tool_calls)}
    assert stream.feed("<toolbox") == ChatDelta(content="\n<toolbox")  # the held "\n" precedes no call after all
    assert stream.flush() == ChatDelta()


# --- Llama 3.1 JSON tool calls -------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ('{"name": "get_time", "parameters": {"tz": "UTC"}}', None, [call(0, "get_time", {"tz": "UTC"})]),
        ('<|python_tag|>{"name": "get_time", "arguments": {}}', None, [call(0, "get_time", {})]),
        (
            '<|python_tag|>{"name": "a", "parameters": {"x": {"y": {"z": 1}}}}; {"name": "b", "parameters": {}};',
            None,
            [call(0, "a", {"x": {"y": {"z": 1}}}), call(1, "b", {})],
        ),
        (' \n{"name": "a", "parameters": {}} ;{"name": "b", "parameters": {}}\n', None, [call(0, "a", {}), call(1, "b", {})]),
        ("The answer is 4.", "The answer is 4.", []),
        # anything that is not all calls is content, as it came
        ('Calling: {"name": "a", "parameters": {}}', 'Calling: {"name": "a", "parameters": {}}', []),
        ('{"name": "a", "parameters": {}} done', '{"name": "a", "parameters": {}} done', []),
        ('{"name": "a", "parameters": {}} {"name": "b"}', '{"name": "a", "parameters": {}} {"name": "b"}', []),  # no ';'
        ('{"name": "a", "parameters": {', '{"name": "a", "parameters": {', []),
        ('{"answer": 4}', '{"answer": 4}', []),
        ("<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
        ("", None, []),
    ],
)
def test_parse_llama3_json_tool_calls(text, content, calls):
    assert parse_llama3_json_tool_calls(text, OFFERED, ids()) == (content, calls)


LLAMA_TEXTS = [
    '<|python_tag|>{"name": "a", "parameters": {"x": "é;}"}}; {"name": "b", "arguments": {}}',
    ' {"name": "a", "parameters": {}}',
    "The answer is 4.",
    "<|python",
    '{"answer": 4}',
    " ",
]


@pytest.mark.parametrize("text", LLAMA_TEXTS)
def test_llama_streams_agree(text):
    assert_streams_agree("llama3_json", text, tools=OFFERED)


def test_llama_stream_sends_content_at_once():
    stream = parser_for("llama3_json").stream(tools=OFFERED)
    assert stream.feed(" The") == ChatDelta(content=" The")
    stream = parser_for("llama3_json").stream(tools=OFFERED)
    assert stream.feed('{"name": "a", "parameters": {}}') == ChatDelta()  # calls are sent whole, at the end
    assert [part["function"] for part in stream.flush().tool_calls] == [{"name": "a", "arguments": ""}, {"arguments": "{}"}]


# --- Qwen3 combined, and the registry ------------------------------------------------------------

QWEN3_TEXTS = [
    "<think>\nThe user wants the weather.\n</think>\n\n" + WEATHER,
    "<think>\nNo tools.\n</think>\n\nHi <tool_call>{bad}</tool_call>",
    "Mid-thought, maybe " + TIME + "?\n</think>\n\n" + TIME,
    "<think>\ncut short " + TIME,
]


@pytest.mark.parametrize("think_open", MODES)
@pytest.mark.parametrize("text", QWEN3_TEXTS)
def test_qwen3_streams_agree(text, think_open):
    assert_streams_agree("qwen3", text, think_open=think_open, tools=OFFERED)
    assert_streams_agree("qwen3", text, think_open=think_open)


def test_qwen3_reasoning_then_tools():
    parts = parser_for("qwen3").parse(QWEN3_TEXTS[0], tools=OFFERED, new_id=ids())
    assert parts == ChatParts("\nThe user wants the weather.\n", None, (call(0, "get_weather", WEATHER_CALL),))
    assert parts.message() == {
        "role": "assistant",
        "content": None,
        "reasoning_content": "\nThe user wants the weather.\n",
        "tool_calls": [call(0, "get_weather", WEATHER_CALL)],
    }
    # a call inside the reasoning is reasoning text; only the content's are calls
    parts = parser_for("qwen3").parse(QWEN3_TEXTS[2], think_open=True, tools=OFFERED, new_id=ids())
    assert parts.reasoning == "Mid-thought, maybe " + TIME + "?\n" and parts.content is None
    assert parts.tool_calls == (call(0, "get_time", {}),)
    # without tools in the request, a call stays content
    assert parser_for("qwen3").parse(QWEN3_TEXTS[0]).content == "\n\n" + WEATHER


# --- Calls the request cannot take: undeclared functions, JSON nested past the recursion limit ----

UNDECLARED = '<tool_call>{"name": "delete_files", "arguments": {}}</tool_call>'


@pytest.mark.parametrize(
    "family, text, content, names",
    [
        ("hermes", UNDECLARED, UNDECLARED, []),
        ("hermes", UNDECLARED + "\n" + TIME, UNDECLARED + "\n", ["get_time"]),  # the offered call is still one
        ("llama3_json", '{"name": "delete_files", "parameters": {}}', '{"name": "delete_files", "parameters": {}}', []),
        # one undeclared call makes the output not all calls: all of it is content
        (
            "llama3_json",
            '{"name": "a", "parameters": {}}; {"name": "rm", "parameters": {}}',
            '{"name": "a", "parameters": {}}; {"name": "rm", "parameters": {}}',
            [],
        ),
    ],
)
def test_a_call_of_a_function_not_offered_stays_content(family, text, content, names):
    whole = assert_streams_agree(family, text, tools=OFFERED)
    assert whole.content == content and [c["function"]["name"] for c in whole.tool_calls] == names


DEEP = "[" * 10_000 + "]" * 10_000  # JSON 10,000 arrays deep: past the recursion limit of Python's parser

DEEP_TEXTS = [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": ' + DEEP + "}}</tool_call>"),
    ("hermes", "<tool_call>" + DEEP + "</tool_call>\n" + TIME),
    ("llama3_json", '{"name": "a", "parameters": {"x": ' + DEEP + "}}"),
    ("llama3_json", "<|python_tag|>" + DEEP),
    ("qwen3", "<think>\nnested\n</think>\n\n<tool_call>" + DEEP + "</tool_call>"),
]


@pytest.mark.parametrize("family, text", DEEP_TEXTS)
def test_json_nested_past_the_recursion_limit_stays_content(family, text):
    whole = parser_for(family).parse(text, think_open=False, tools=OFFERED, new_id=ids())
    assert DEEP in whole.content
    assert [c["function"]["name"] for c in whole.tool_calls] == (["get_time"] if text.endswith(TIME) else [])
    for size in (len(text), 4096, 7):  # the texts are long: a few chunkings, not every split
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        assert streamed(family, pieces, think_open=False, tools=OFFERED) == whole


def test_parser_for():
    assert parser_for("none").parse("<think>a</think>" + TIME) == ChatParts(None, "<think>a</think>" + TIME)
    assert parser_for("hermes").parse("<think>a</think>").content == "<think>a</think>"
    with pytest.raises(ValueError, match="known: hermes, llama3_json, none, qwen3"):
        parser_for("mistral")


def test_make_tool_call_id():
    made = {make_tool_call_id() for _ in range(100)}
    assert len(made) == 100 and all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in made)


def test_a_forced_tool_call_nested_past_the_recursion_limit_stays_content():
    from pulseinfer.gateway.structured import ForcedToolCalls

    deep = '[{"name": "f", "parameters": ' + "[" * 100_000 + "]" * 100_000 + "}]"
    assert ForcedToolCalls(None).parse(deep).content == deep
