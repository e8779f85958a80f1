"""OpenAI request bodies -> (prompt ids, SamplingParams), and the response objects back.

Every problem is an ApiError with the HTTP status and an OpenAI-style error body; nothing
here raises anything else on any JSON input.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any

from pulseinfer.gateway.core import Final, Prompt
from pulseinfer.scheduler.request import MAX_STOP_STRINGS, SamplingParams

CHAT_ROLES = ("system", "user", "assistant")
# accepted for compatibility only at their neutral value
NEUTRAL_FIELDS = {"presence_penalty": 0, "frequency_penalty": 0, "best_of": 1, "echo": False, "suffix": None}


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
class ParsedRequest:
    prompt: Prompt
    params: SamplingParams
    max_tokens_given: bool
    stream: bool
    include_usage: bool


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
    prompt = body.get("prompt")
    if prompt is None:
        raise ApiError(400, "'prompt' is required", param="prompt")
    return _parsed(body, _completion_prompt(prompt), default_max_tokens, "max_tokens")


def parse_chat(body: dict, default_max_tokens: int) -> ParsedRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty array of messages", param="messages")
    turns = [_chat_message(m, i) for i, m in enumerate(messages)]
    if _get(body, "logprobs", bool, False) or body.get("top_logprobs") is not None:
        raise ApiError(400, "logprobs are not supported", param="logprobs")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return _parsed(body, Prompt(chat=turns), default_max_tokens, key)


def _parsed(body: dict, prompt: Prompt, default_max_tokens: int, max_tokens_key: str) -> ParsedRequest:
    for name, neutral in NEUTRAL_FIELDS.items():
        if body.get(name, neutral) not in (neutral, None):
            raise ApiError(400, f"'{name}' is not supported (only {json.dumps(neutral)})", param=name)
    n = _get(body, "n", int, 1)
    if n != 1:
        raise ApiError(400, f"only n=1 is supported, got n={n}", param="n")
    logprobs = body.get("logprobs")
    if logprobs not in (None, False, 0):
        raise ApiError(400, "logprobs are not supported", param="logprobs")
    max_tokens = _get(body, max_tokens_key, int, None)
    params = SamplingParams(
        max_tokens=default_max_tokens if max_tokens is None else max_tokens,
        temperature=_get(body, "temperature", float, 1.0),
        top_p=_get(body, "top_p", float, 1.0),
        top_k=_get(body, "top_k", int, 0),
        seed=_get(body, "seed", int, None),
        stop=_stop(body.get("stop")),
        stop_token_ids=tuple(_int_list(body.get("stop_token_ids") or [], "stop_token_ids")),
        ignore_eos=_get(body, "ignore_eos", bool, False),
    )
    stream = _get(body, "stream", bool, False)
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise ApiError(400, "'stream_options' must be an object and needs 'stream': true", param="stream_options")
    include_usage = _get(options or {}, "include_usage", bool, False)
    return ParsedRequest(prompt, params, max_tokens is not None, stream, include_usage)


def _get(body: dict, name: str, kind: type, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    # JSON true/false are Python bools, a subclass of int: never accept them as numbers
    if kind is bool and not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be a boolean", param=name)
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ApiError(400, f"'{name}' must be an integer", param=name)
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ApiError(400, f"'{name}' must be a finite number", param=name)
        value = float(value)
    return value


def _int_list(value: Any, param: str) -> list[int]:
    if not isinstance(value, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in value):
        raise ApiError(400, f"'{param}' must be an array of integers", param=param)
    return value


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


def _completion_prompt(prompt: Any) -> Prompt:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return Prompt(text=_text(prompt, "prompt"))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return Prompt(token_ids=prompt)
    raise ApiError(400, "'prompt' must be a string, an array of token ids, or a batch of one of those", param="prompt")


def _chat_message(message: Any, index: int) -> dict[str, str]:
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise ApiError(400, f"{param} must be an object with 'role' and 'content'", param=param)
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise ApiError(400, f"{param}.role must be one of {', '.join(CHAT_ROLES)}, got {json.dumps(role)}", param=f"{param}.role")
    return {"role": role, "content": _chat_content(message.get("content"), f"{param}.content")}


def _chat_content(content: Any, param: str) -> str:
    if isinstance(content, str):
        return _text(content, param)
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return _text("".join(p["text"] for p in content), param)
    raise ApiError(400, f"{param} must be a string or an array of text parts", param=param)


# ---------------------------------------------------------------- responses


def usage(final: Final) -> dict:
    return {
        "prompt_tokens": final.prompt_tokens,
        "completion_tokens": final.completion_tokens,
        "total_tokens": final.prompt_tokens + final.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": final.cached_tokens},
    }


def finish_reason(final: Final) -> str:
    return "length" if final.finish_reason == "length" else "stop"


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

    def full(self, text: str, final: Final) -> dict:
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason(final),
            }
            return self._object("chat.completion", [choice], usage(final))
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason(final)}
        return self._object("text_completion", [choice], usage(final))

    def chunk(self, text: str | None, reason: str | None = None, role: bool = False) -> dict:
        if self.chat:
            delta = ({"role": "assistant"} if role else {}) | ({"content": text} if text is not None else {})
            return self._object("chat.completion.chunk", [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}], None)
        return self._object("text_completion", [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}], None)

    def usage_chunk(self, final: Final) -> dict:
        return self._object("chat.completion.chunk" if self.chat else "text_completion", [], usage(final))
