"""Structured outputs in OpenAI's and vLLM's request shapes -> SamplingParams.structured, and the
tool calls a forced tool_choice writes -> OpenAI tool_calls.

`response_format` (OpenAI: json_object, json_schema) and vLLM's `structured_outputs` extension (json,
regex, choice, grammar, json_object) name one constraint; a chat's tool_choice "required" or a named
function is one too, as vLLM builds it: the named function's arguments object, or a non-empty array
of {"name", "parameters"} calls of the offered functions. The worker follows it with llguidance
(pulseinfer/common/grammar.py).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pulseinfer.gateway.chat_text import ChatDelta, ChatParts, IdFactory, make_tool_call_id

Structured = tuple[str, str]  # SamplingParams.structured: (kind, value text)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)


class JsonSchemaFormat(_Body):
    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None  # the output always follows the schema here, strict or not


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs`: exactly one of them."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # a Lark grammar, in llguidance's dialect
    json_object: bool | None = None


class StructuredError(ValueError):
    """A constraint the request cannot have; `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def structured_of(response_format: ResponseFormat | None, outputs: StructuredOutputs | None) -> Structured | None:
    """The request's constraint, from at most one of its fields."""
    asked = [c for c in (_from_response_format(response_format), _from_structured_outputs(outputs)) if c is not None]
    if len(asked) > 1:
        raise StructuredError("give 'response_format' or 'structured_outputs', not both", "structured_outputs")
    return asked[0] if asked else None


def _from_response_format(response_format: ResponseFormat | None) -> Structured | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return ("json_object", "")
    if response_format.json_schema is None:
        raise StructuredError("a 'json_schema' response_format needs its 'json_schema'", "response_format.json_schema")
    schema = response_format.json_schema.schema_
    return ("json_schema", json.dumps(schema if schema is not None else {"type": "object"}))


def _from_structured_outputs(outputs: StructuredOutputs | None) -> Structured | None:
    if outputs is None:
        return None
    given = {name: value for name, value in outputs if value is not None and value is not False}
    if len(given) != 1:
        raise StructuredError("'structured_outputs' takes exactly one of json, regex, choice, grammar, json_object", "structured_outputs")
    ((name, value),) = given.items()
    if name == "json_":
        return ("json_schema", value if isinstance(value, str) else json.dumps(value))
    if name == "json_object":
        return ("json_object", "")
    if name == "choice":
        return ("choice", json.dumps(value))
    return ("lark" if name == "grammar" else "regex", value)


def forced_tool_schema(tools: list[dict[str, Any]], named: str | None, parallel: bool = True) -> Structured:
    """tool_choice "required" (named None) or a named function, as vLLM constrains it: the function's
    arguments object, or a non-empty array of calls of the offered functions (one, not `parallel`)."""
    functions = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    if named is not None:
        if named not in functions:
            raise StructuredError(f"'tool_choice' names {named!r}, which 'tools' does not offer", "tool_choice")
        return ("json_schema", json.dumps(functions[named]))
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "parameters": {"$ref": f"#/$defs/{name}"}},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name in functions
    ]
    # Each function's schema is a definition of the array's, its local $refs rebased onto it: nested
    # as they were, "#/$defs/Unit" would name the array's $defs. Function names are unique, and
    # need no escaping in a JSON pointer (no "/" or "~").
    try:
        definitions = {name: _rebased(parameters, f"#/$defs/{name}") for name, parameters in functions.items()}
    except RecursionError:
        raise StructuredError("a function's 'parameters' nest too deeply", "tools") from None
    array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, "$defs": definitions}
    return ("json_schema", json.dumps(array | ({} if parallel else {"maxItems": 1})))


def _rebased(schema: Any, base: str) -> Any:
    """A copy of the schema with its local $refs ("#" and "#/...") made relative to `base`, the
    pointer of where it now lives."""
    if isinstance(schema, list):
        return [_rebased(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    rebased = {key: _rebased(value, base) for key, value in schema.items()}
    if isinstance(ref := schema.get("$ref"), str) and ref.startswith("#"):
        rebased["$ref"] = base + ref[1:]
    return rebased


class ForcedToolCalls:
    """A forced tool_choice's output (the JSON its constraint allows) as tool calls: whole, or
    streamed as one delta per call once the output is complete (its JSON parses only then). Output
    that is not the complete JSON (cut by max_tokens) stays content."""

    def __init__(self, named: str | None, new_id: IdFactory = make_tool_call_id):
        self.named = named
        self.new_id = new_id

    def parse(self, text: str) -> ChatParts:
        calls = self._calls(text)
        if calls is None:
            return ChatParts(content=text or None)
        return ChatParts(tool_calls=tuple(_call(self.new_id(), name, arguments) for name, arguments in calls))

    def stream(self) -> _ForcedStream:
        return _ForcedStream(self)

    def _calls(self, text: str) -> list[tuple[str, str]] | None:
        try:
            value = json.loads(text)
            if self.named is not None:
                return [(self.named, text)] if isinstance(value, dict) else None
            if not isinstance(value, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in value):
                return None
            return [(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False)) for c in value]
        except (ValueError, RecursionError):  # not JSON, or nested deeper than the parser recurses: it stays content
            return None


class _ForcedStream:
    def __init__(self, forced: ForcedToolCalls):
        self.forced = forced
        self.text: list[str] = []
        self.called = False

    def feed(self, delta: str) -> ChatDelta:
        self.text.append(delta)
        return ChatDelta()

    def flush(self) -> ChatDelta:
        parts = self.forced.parse("".join(self.text))
        self.called = bool(parts.tool_calls)
        deltas = tuple({"index": i, **call} for i, call in enumerate(parts.tool_calls))
        return ChatDelta(content=parts.content or "", tool_calls=deltas)


def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
