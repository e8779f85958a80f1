"""The OpenAI request bodies (completions, chat, vLLM's /tokenize and /detokenize) as pydantic
models: strict (JSON true is no number, NaN no float), and forbidding any field they do not
declare, so nothing a client sends is silently ignored: a field is either implemented, accepted
only at its neutral value (the value that asks for nothing, as a client library may send it),
accepted and ignored on purpose (it does not change the output), or refused with a 400 naming
it (docs/api.md "OpenAI API parameters"). gateway/openai_api.py validates bodies against them."""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

from pulseinfer.gateway.structured import ResponseFormat, StructuredOutputs


class StrictBody(BaseModel):
    """A body or a part of one: strict types, no field it does not declare, read-only."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)


class StreamOptions(StrictBody):
    include_usage: bool | None = None


ChatRole = Literal["system", "user", "assistant", "tool"]
CHAT_ROLES = get_args(ChatRole)


class FunctionCall(StrictBody):
    name: str = Field(min_length=1)
    arguments: str  # JSON text of an object, as OpenAI sends it


class ToolCall(StrictBody):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(StrictBody):
    role: ChatRole
    content: Any = None  # a string or an array of text parts (checked with its index, for the error's param)
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's answer: to which call


class Function(StrictBody):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(StrictBody):
    type: Literal["function"]
    function: Function


class NamedToolChoice(StrictBody):
    class Name(StrictBody):
        name: str

    type: Literal["function"]
    function: Name


class SamplingRequest(StrictBody):
    """The fields completions and chat share. None: the client did not send it (or sent null)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM's extension, as ignore_eos, stop_token_ids, min_p and min_tokens
    min_p: float | None = None
    min_tokens: int | None = None
    seed: int | None = None
    stop: Any = None  # a string or an array of them
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extension
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = None  # vLLM's extension: each prompt token's logprob, with this many alternatives
    skip_special_tokens: bool | None = None  # vLLM's extensions, as include_stop_str_in_output
    include_stop_str_in_output: bool | None = None
    response_format: ResponseFormat | None = None  # OpenAI's (chat); completions too, as vLLM's
    structured_outputs: StructuredOutputs | None = None  # vLLM's extension: json, regex, choice, grammar
    # accepted and ignored on purpose: OpenAI's bookkeeping and routing hints, which do not change the output
    user: str | None = None
    service_tier: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class CompletionRequest(SamplingRequest):
    prompt: Any  # a string, an array of token ids, or an array of either
    best_of: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    logprobs: int | None = None


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extension: e.g. Qwen3's enable_thinking


class TokenizeRequest(StrictBody):
    """vLLM's POST /tokenize: a prompt, or chat messages rendered by the model's template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (the template writes its own)
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(StrictBody):
    """vLLM's POST /detokenize."""

    model: str | None = None
    tokens: list[int]
