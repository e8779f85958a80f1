"""Chat templates with tools, tool calls, tool answers and chat_template_kwargs render as
transformers' apply_chat_template renders them, from the OpenAI request the gateway parses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pulseinfer.common.model.tokenizer import Tokenizer
from pulseinfer.gateway.openai_api import ApiError, parse_chat

TEMPLATE = (Path(__file__).parent / "data" / "templates" / "qwen3_format.jinja").read_text()
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather at a place: <city> & country, e.g. Montréal",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]},
        },
    },
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": "Zürich", "days": 2})}}
CONVERSATIONS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Zürich?"}],
    [
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL, {**CALL, "id": "call_2"}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
        {"role": "user", "content": "And tomorrow?"},
    ],
]


def _as_transformers_takes_them(messages: list[dict]) -> list[dict]:
    """The OpenAI messages in transformers' form: a call's arguments as an object, no null content."""
    out = []
    for message in messages:
        message = {**message, "content": message["content"] or ""}
        if "tool_calls" in message:
            message["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}} for c in message["tool_calls"]
            ]
        out.append(message)
    return out


@pytest.mark.parametrize("kwargs", [None, {"enable_thinking": False}])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_tools_and_template_kwargs_render_as_transformers_renders_them(engine, hf_tokenizer, conversation, kwargs):
    messages = CONVERSATIONS[conversation]
    body = {"messages": messages, "tools": TOOLS} | ({"chat_template_kwargs": kwargs} if kwargs else {})
    prompt = parse_chat(body, 16).prompts[0]
    ours = Tokenizer(engine.tokenizer.backend, engine.tokenizer.special, TEMPLATE)
    rendered = ours.render_chat(prompt.chat, True, prompt.tools, prompt.template_kwargs)
    expected = hf_tokenizer.apply_chat_template(
        _as_transformers_takes_them(messages), tools=TOOLS, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True,
        **(kwargs or {}),
    )  # fmt: skip
    assert rendered == expected
    assert '"Montréal"' not in rendered and "Montréal" in rendered and "<city> &" in rendered  # json.dumps's text, unescaped
    assert rendered.endswith("<think>\n\n</think>\n\n") == bool(kwargs)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools"),
        ({"tool_choice": "auto", "tools": None}, "tool_choice"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]}, "messages[0].tool_calls"),
        ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "[1]"}}]}]},
         "messages[0].tool_calls[0].function.arguments"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ],
)  # fmt: skip
def test_bad_tools_messages_and_template_kwargs_are_refused_naming_the_field(body, param):
    with pytest.raises(ApiError) as refused:
        parse_chat({"messages": [{"role": "user", "content": "hi"}]} | body, 16)
    assert refused.value.status == 400 and refused.value.param == param, refused.value.message
