"""OpenAI request bodies -> (prompt ids, SamplingParams), and the response objects back.

The bodies are validated against their pydantic models (gateway/openai_requests.py), which
forbid any field they do not declare; the fields accepted only at their neutral value are
checked here.

Every problem is an ApiError with the HTTP status and an OpenAI-style error body; nothing
here raises anything else on any JSON input.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from pulseinfer.gateway.core import Prompt
from pulseinfer.gateway.openai_requests import (
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    NamedToolChoice,
    SamplingRequest,
    StrictBody,
    TokenizeRequest,
    Tool,
    ToolCall,
)
from pulseinfer.gateway.structured import ForcedToolCalls, Structured, StructuredError, forced_tool_schema, structured_of
from pulseinfer.messages.limits import MAX_STOP_STRINGS
from pulseinfer.messages.sampling import SamplingParams

# accepted only at the value that asks for nothing: anything else is refused, naming the field
NEUTRAL = {
    "best_of": (1,),
    "suffix": ("",),
}
# what a chat template is given besides chat_template_kwargs, which may not replace it
TEMPLATE_ARGUMENTS = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None, kind: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class TokenizeText:
    """What /tokenize encodes: a text, with the tokenizer's special tokens or without."""

    text: str
    add_special: bool


MAX_CHOICES = 128  # prompts times n, per request


@dataclass(frozen=True)
class ParsedRequest:
    prompts: tuple[Prompt, ...]  # a completion's batch of prompts; a chat's one
    n: int  # choices per prompt
    params: SamplingParams
    echo: bool  # a completion's text (and logprobs) begin with its prompt's
    max_tokens_given: bool
    stream: bool
    include_usage: bool
    tools: frozenset[str] = frozenset()  # the functions a chat's output may call (offered, tool_choice not "none")
    forced: ForcedToolCalls | None = None  # a chat's tool_choice "required" or named: its output is the calls' JSON
    # the request field behind a SamplingParams field (or "prompt") where the names differ: what a 400 names
    fields: dict[str, str] = field(default_factory=dict)

    def param(self, name: str) -> str:
        """The request field a problem with `name` (a SamplingParams field, or "prompt") is in."""
        return self.fields.get(name, name)


def parse_body(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not valid UTF-8 (byte {e.start})") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    except ValueError as e:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise ApiError(400, f"the request body has a number out of range: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def parse_completion(body: dict, default_max_tokens: int) -> ParsedRequest:
    """`echo` with `logprobs` scores the prompt too (its first token has none), as OpenAI's legacy API does."""
    request = _validated(CompletionRequest, body)
    echo = _given_or(request.echo, False)
    prompt_logprobs = request.logprobs if echo and request.logprobs is not None else request.prompt_logprobs
    return _parsed(
        request, _completion_prompts(request.prompt), default_max_tokens, request.max_tokens, request.logprobs, prompt_logprobs, echo
    )


def parse_chat(body: dict, default_max_tokens: int) -> ParsedRequest:
    request = _validated(ChatRequest, body)
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    if request.top_logprobs is not None and not request.logprobs:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    logprobs = _given_or(request.top_logprobs, 0) if request.logprobs else None
    prompt = _chat_prompt(request.messages, request.tools, request.chat_template_kwargs)
    parsed = _parsed(request, (prompt,), default_max_tokens, max_tokens, logprobs, request.prompt_logprobs)
    names = frozenset(tool.function.name for tool in request.tools or ())
    fields = parsed.fields | {
        "prompt": "messages",
        "logprobs": "top_logprobs",
        "max_tokens": "max_tokens" if request.max_completion_tokens is None else "max_completion_tokens",
    }
    forced = _forced_tool_calls(request)
    if forced is None:
        return dataclasses.replace(parsed, tools=names if request.tool_choice != "none" else frozenset(), fields=fields)
    if parsed.params.structured is not None:
        raise ApiError(400, "a 'tool_choice' that forces a call constrains the output: it takes no 'response_format'", param="tool_choice")
    tools, parallel = [tool.model_dump() for tool in request.tools], request.parallel_tool_calls is not False
    params = dataclasses.replace(parsed.params, structured=_structured(lambda: forced_tool_schema(tools, forced.named, parallel)))
    # the constraint is built from the tools' parameter schemas: a grammar they make is theirs
    return dataclasses.replace(parsed, params=params, tools=names, forced=forced, fields=fields | {"structured": "tools"})


def _chat_prompt(messages: list[ChatMessage], tools: list[Tool] | None, template_kwargs: dict[str, Any] | None) -> Prompt:
    """What the chat template renders: the turns, the tools offered (as OpenAI's tool objects, which
    templates take as transformers passes them) and chat_template_kwargs."""
    if reserved := sorted(set(template_kwargs or ()) & set(TEMPLATE_ARGUMENTS)):
        raise ApiError(400, f"'chat_template_kwargs' may not set {reserved[0]!r}: the request sets it", param="chat_template_kwargs")
    offered = tuple(tool.model_dump(exclude_none=True) for tool in tools or ())
    names = [tool.function.name for tool in tools or ()]
    if len(set(names)) < len(names):
        raise ApiError(400, "'tools' names a function twice", param="tools")
    return Prompt(chat=_turns(messages), tools=offered or None, template_kwargs=template_kwargs or None)


def _forced_tool_calls(request: ChatRequest) -> ForcedToolCalls | None:
    """tool_choice "required" or a named function: the output is constrained to the calls (None:
    "auto" or "none", where the model's own format is parsed, or not)."""
    choice = request.tool_choice
    if choice is not None and not request.tools:
        raise ApiError(400, "'tool_choice' needs 'tools'", param="tool_choice")
    if choice == "required":
        return ForcedToolCalls(None)
    if isinstance(choice, NamedToolChoice):
        return ForcedToolCalls(choice.function.name)
    return None


def _structured(constraint: Callable[[], Structured | None]) -> Structured | None:
    try:
        return constraint()
    except StructuredError as e:
        raise ApiError(400, str(e), param=e.param) from None


def parse_tokenize(body: dict, render_chat) -> TokenizeText:
    """The text /tokenize encodes; `render_chat(prompt, add_generation_prompt)` is the model's template."""
    request = _validated(TokenizeRequest, body)
    if (request.prompt is None) == (request.messages is None):
        raise ApiError(400, "give exactly one of 'prompt' and 'messages'", param="prompt")
    if request.prompt is not None:
        return TokenizeText(_text(request.prompt, "prompt"), _given_or(request.add_special_tokens, True))
    prompt = _chat_prompt(request.messages, request.tools, request.chat_template_kwargs)
    return TokenizeText(render_chat(prompt, request.add_generation_prompt), _given_or(request.add_special_tokens, False))


def parse_detokenize(body: dict) -> list[int]:
    return _validated(DetokenizeRequest, body).tokens


def _validated(model: type[StrictBody], body: dict) -> StrictBody:
    """The body as `model`, its fields beyond the implemented ones at their neutral values."""
    try:
        request = model.model_validate(body)
    except ValidationError as e:
        raise _api_error(e.errors(include_url=False)[0]) from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    for name in NEUTRAL.keys() & request.model_fields_set:
        value = getattr(request, name)
        if value is not None and value not in NEUTRAL[name]:
            neutral = " or ".join(json.dumps(v) for v in NEUTRAL[name])
            raise ApiError(400, f"'{name}' is not supported by this server (only {neutral})", param=name)
    return request


def _api_error(error: dict) -> ApiError:
    """One pydantic error as a 400 naming the field: messages[0].role, stream_options.include_usage."""
    param = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in error["loc"]).lstrip(".")
    if error["type"] == "extra_forbidden":
        return ApiError(400, f"'{param}' is not supported by this server (docs/api.md: OpenAI API parameters)", param=param)
    if error["type"] == "missing":
        return ApiError(400, f"'{param}' is required", param=param)
    return ApiError(400, f"'{param}': {error['msg']}", param=param)


def _parsed(
    request: SamplingRequest,
    prompts: tuple[Prompt, ...],
    default_max_tokens: int,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
    echo: bool = False,
) -> ParsedRequest:
    n = _given_or(request.n, 1)
    if not 1 <= n <= MAX_CHOICES // len(prompts):
        raise ApiError(400, f"'n' must be in [1, {MAX_CHOICES // len(prompts)}]: at most {MAX_CHOICES} choices a request", param="n")
    params = SamplingParams(
        max_tokens=default_max_tokens if max_tokens is None else max_tokens,
        temperature=_given_or(request.temperature, 1.0),
        top_p=_given_or(request.top_p, 1.0),
        top_k=_given_or(request.top_k, 0),
        seed=request.seed,
        stop=_stop(request.stop),
        stop_token_ids=tuple(request.stop_token_ids or ()),
        ignore_eos=_given_or(request.ignore_eos, False),
        min_p=_given_or(request.min_p, 0.0),
        min_tokens=_given_or(request.min_tokens, 0),
        logit_bias=_logit_bias(request.logit_bias or {}),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=_given_or(request.skip_special_tokens, True),
        include_stop_str_in_output=_given_or(request.include_stop_str_in_output, False),
        presence_penalty=_given_or(request.presence_penalty, 0.0),
        frequency_penalty=_given_or(request.frequency_penalty, 0.0),
        repetition_penalty=_given_or(request.repetition_penalty, 1.0),
        structured=_structured(lambda: structured_of(request.response_format, request.structured_outputs)),
    )
    stream = _given_or(request.stream, False)
    if stream and request.prompt_logprobs is not None:
        raise ApiError(
            400,
            "'prompt_logprobs' is returned in non-streamed responses only (a streamed completion has them with echo)",
            param="prompt_logprobs",
        )
    if request.stream_options is not None and not stream:
        raise ApiError(400, "'stream_options' needs 'stream': true", param="stream_options")
    include_usage = request.stream_options is not None and _given_or(request.stream_options.include_usage, False)
    structured = "response_format" if request.response_format is not None else "structured_outputs"
    return ParsedRequest(prompts, n, params, echo, max_tokens is not None, stream, include_usage, fields={"structured": structured})


def _logit_bias(bias: dict[str, float]) -> tuple[tuple[int, float], ...]:
    """OpenAI's map of token ids (as JSON keys: strings) to biases, as (id, bias) pairs."""
    if any(not key.isascii() or not key.isdigit() or len(key) > 12 for key in bias):
        raise ApiError(400, "'logit_bias' keys must be token ids (decimal integers)", param="logit_bias")
    return tuple(sorted((int(key), value) for key, value in bias.items()))


def _given_or(value: Any, default: Any) -> Any:
    """The value the client gave, or `default` where it gave none (left the field out, or sent null)."""
    return default if value is None else value


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or any(not isinstance(s, str) or not s for s in stops) or len(stops) > MAX_STOP_STRINGS:
        raise ApiError(400, f"'stop' must be a non-empty string or an array of at most {MAX_STOP_STRINGS} of them", param="stop")
    return tuple(_text(s, "stop") for s in stops)


def _text(value: str, param: str) -> str:
    """JSON may escape a lone surrogate (\\ud800), which no UTF-8 text holds: neither the tokenizer nor protobuf takes it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"'{param}' is not valid Unicode text (character {e.start}: a lone surrogate)", param=param) from None
    return value


def _turns(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Chat messages as templates take them (transformers' shapes): each content checked as text, an
    assistant's tool calls with their arguments as objects, a tool's answer with its call id."""
    return [_turn(m, f"messages[{i}]") for i, m in enumerate(messages)]


def _turn(message: ChatMessage, param: str) -> dict[str, Any]:
    turn: dict[str, Any] = {"role": message.role}
    if message.tool_calls is not None and message.role != "assistant":
        raise ApiError(400, f"'{param}.tool_calls' is an assistant's", param=f"{param}.tool_calls")
    if message.tool_call_id is not None and message.role != "tool":
        raise ApiError(400, f"'{param}.tool_call_id' is a tool message's", param=f"{param}.tool_call_id")
    if message.tool_call_id is None and message.role == "tool":
        raise ApiError(400, f"'{param}.tool_call_id' is required: the call a tool message answers", param=f"{param}.tool_call_id")
    if message.content is None and not message.tool_calls:
        raise ApiError(400, f"'{param}.content' is required (an assistant with tool calls may leave it out)", param=f"{param}.content")
    turn["content"] = "" if message.content is None else _chat_content(message.content, f"{param}.content")
    if message.tool_calls:
        turn["tool_calls"] = [_template_call(call, f"{param}.tool_calls[{j}]") for j, call in enumerate(message.tool_calls)]
    if message.tool_call_id is not None:
        turn["tool_call_id"] = _text(message.tool_call_id, f"{param}.tool_call_id")
    return turn


def _template_call(call: ToolCall, param: str) -> dict[str, Any]:
    """A tool call as chat templates read it: arguments as an object (vLLM does the same)."""
    try:
        arguments = json.loads(call.function.arguments)
    except (ValueError, RecursionError):  # arguments nested thousands deep exhaust the recursion limit
        arguments = None
    if not isinstance(arguments, dict):
        raise ApiError(400, f"'{param}.function.arguments' must be the JSON text of an object", param=f"{param}.function.arguments")
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


def _completion_prompts(prompt: Any) -> tuple[Prompt, ...]:
    """OpenAI's four forms: a string, an array of token ids, or an array (a batch) of either."""
    if isinstance(prompt, str) or _is_token_ids(prompt):
        return (_completion_prompt(prompt),)
    if isinstance(prompt, list) and 0 < len(prompt) <= MAX_CHOICES and all(isinstance(p, str) or _is_token_ids(p) for p in prompt):
        return tuple(_completion_prompt(p) for p in prompt)
    raise ApiError(400, f"'prompt' must be a string, an array of token ids, or an array of at most {MAX_CHOICES} of either", param="prompt")


def _completion_prompt(prompt: str | list[int]) -> Prompt:
    return Prompt(text=_text(prompt, "prompt")) if isinstance(prompt, str) else Prompt(token_ids=prompt)


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _chat_content(content: Any, param: str) -> str:
    if isinstance(content, str):
        return _text(content, param)
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) and p.keys() == {"type", "text"} for p in content
    ):
        return _text("".join(p["text"] for p in content), param)
    raise ApiError(400, f"'{param}' must be a string or an array of text parts", param=param)
