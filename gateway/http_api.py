"""OpenAI-compatible HTTP API (Starlette on uvicorn/uvloop)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
from collections.abc import Callable
from importlib.metadata import version
from json.encoder import encode_basestring

import grpc
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from pulseinfer.gateway.chat_parsers import PARSERS, ChatOutput, ChatParser
from pulseinfer.gateway.chat_text import prompt_opens_think
from pulseinfer.gateway.choices import (
    Choice,
    ClientGone,
    gathered,
    merged_events,
    output_of,
    read_to_first_token,
    unless_disconnected,
)
from pulseinfer.gateway.core import Delta, Final, GatewayCore, GenerationError, Prepared, Prompt, key_matches
from pulseinfer.gateway.logprobs import NO_LOGPROBS, ChoiceView, LogprobFormat
from pulseinfer.gateway.metrics import CONTENT_TYPE_LATEST
from pulseinfer.gateway.openai_api import (
    ApiError,
    ParsedRequest,
    parse_body,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_tokenize,
)
from pulseinfer.gateway.openai_responses import ResponseShape, finish_reason
from pulseinfer.messages.sampling import ParamError, check_token_ids

MAX_REQUEST_BYTES = 2 << 20  # a prompt filling a 32k context is well under 1 MiB of JSON
_to_json = json.JSONEncoder(ensure_ascii=False).encode  # json.dumps with options builds an encoder per call
_TEXT_MARK = "\x00text\x00"
_THINK_TAIL_TOKENS = 16  # a prompt's last tokens, where a template's generation prompt opens (or closes) a <think>
GRPC_TO_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
}


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def generation_error(error: GenerationError, prompt_field: str) -> ApiError:
    """A refusal of the cluster's as an HTTP error: what it refuses as invalid is a prompt it cannot hold."""
    status = GRPC_TO_HTTP.get(error.status, 503)
    return ApiError(status, error.message, param=prompt_field if status == 400 else None, code="rate_limited" if status == 429 else None)


class HttpApi:
    def __init__(
        self,
        core: GatewayCore,
        api_key: str | None,
        default_max_tokens: int,
        max_request_bytes: int = MAX_REQUEST_BYTES,
        chat_parser: ChatParser = PARSERS["none"],
    ):
        self.core = core
        self.chat_parser = chat_parser
        self.api_key = api_key
        self.default_max_tokens = default_max_tokens
        self.max_request_bytes = max_request_bytes
        token_text = functools.lru_cache(maxsize=1 << 16)(lambda token: core.tokenizer.decode([token], skip_special=False))
        self.logprob_format = LogprobFormat(token_text)

    def app(self) -> Starlette:
        routes = [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/reset_prefix_cache", self.reset_prefix_cache, methods=["POST"]),  # vLLM's path
            Route("/tokenize", self.tokenize, methods=["POST"]),  # vLLM's paths and shapes
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/version", self.version, methods=["GET"]),
            Route("/tokenizer_info", self.tokenizer_info, methods=["GET"]),  # vLLM's: lm-eval's remote tokenizer reads it
        ]
        return Starlette(routes=routes, exception_handlers={404: self._not_found, 405: self._not_allowed})

    # ------------------------------------------------------------ endpoints

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def models(self, request: Request) -> Response:
        if (denied := self._check_key(request)) is not None:
            return denied
        card = {"id": self.core.model_id, "object": "model", "created": 0, "owned_by": "pulseinfer", "max_model_len": self.core.max_context}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self, request: Request) -> Response:
        """200 while some node can take requests; per node, its state and what is wrong with it."""
        stats = await self.core.cluster_stats()
        nodes = self.core.nodes.health()
        if not any(n["state"] == "up" for n in nodes.values()):
            problems = [p if len(nodes) == 1 else f"node {a}: {p}" for a, n in nodes.items() for p in n["problems"]]
            return JSONResponse({"status": "unavailable", "problems": problems, "nodes": nodes}, status_code=503)
        return JSONResponse({"status": "ok", "workers_alive": stats.workers_alive if stats else 0, "nodes": nodes})

    async def metrics(self, request: Request) -> Response:
        await self.core.cluster_stats()
        return PlainTextResponse(self.core.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def reset_prefix_cache(self, request: Request) -> Response:
        """Drops every worker's cached prefix blocks (those requests hold stay theirs)."""
        if (denied := self._check_key(request)) is not None:
            return denied
        try:
            freed = await self.core.reset_prefix_cache()
        except grpc.aio.AioRpcError as e:
            return error_response(ApiError(503, f"a node is not answering: {e.details()}"))
        return JSONResponse({"freed_blocks": freed})

    async def tokenize(self, request: Request) -> Response:
        """A prompt's (or chat messages') token ids as the completions would see them."""
        try:
            self._require_key(request)
            body = parse_body(await read_body(request, self.max_request_bytes))
            self._check_model(body)
            what = parse_tokenize(body, self.core.render_chat)
            ids = await self.core.encode(what.text, what.add_special)
        except ValueError as e:  # the template refused the messages, or the text cannot fit the context
            return error_response(ApiError(400, str(e), param="messages" if body.get("messages") is not None else "prompt"))
        except ApiError as e:
            return error_response(e)
        return JSONResponse({"count": len(ids), "max_model_len": self.core.max_context, "tokens": ids, "token_strs": None})

    async def detokenize(self, request: Request) -> Response:
        try:
            self._require_key(request)
            body = parse_body(await read_body(request, self.max_request_bytes))
            self._check_model(body)
            ids = parse_detokenize(body)
            check_token_ids(ids, self.core.vocab_size, "tokens", "tokens")
        except ValueError as e:
            return error_response(ApiError(400, str(e), param="tokens"))
        except ApiError as e:
            return error_response(e)
        return JSONResponse({"prompt": await asyncio.to_thread(self.core.tokenizer.decode, ids)})

    async def tokenizer_info(self, request: Request) -> Response:
        """The tokenizer's special tokens and chat template, for clients that tokenize through /tokenize."""
        if (denied := self._check_key(request)) is not None:
            return denied
        return JSONResponse(self.core.tokenizer.config() | {"pad_token": None, "model_max_length": self.core.max_context})

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": version("pulseinfer")})

    async def _not_found(self, request: Request, exc) -> Response:
        return error_response(ApiError(404, f"no route {request.url.path}", code="not_found"))

    async def _not_allowed(self, request: Request, exc) -> Response:
        return error_response(ApiError(405, f"{request.method} is not allowed on {request.url.path}"))

    # ------------------------------------------------------------ generation

    async def _generate(self, request: Request, chat: bool) -> Response:
        try:
            self._require_key(request)
            parsed = self._parse(parse_body(await read_body(request, self.max_request_bytes)), chat)
            return await unless_disconnected(request, self._respond(parsed, chat))
        except ApiError as e:
            self.core.metrics.errors.inc(code=str(e.status))
            return error_response(e)
        except ClientGone:
            return Response(status_code=499)  # for the log: nobody reads it

    async def _respond(self, parsed: ParsedRequest, chat: bool) -> Response:
        """The choices admitted, then the stream of their events, or, not streamed, the whole response."""
        choices = await self._start(parsed)
        shape = ResponseShape(chat, self.core.model_id, choices[0].request_id)
        view = ChoiceView(self.logprob_format, chat, parsed)
        output = self._chat_output(parsed, choices[0].prompt_ids) if chat else None
        if parsed.stream:
            return StreamingResponse(self._sse(shape, choices, parsed, view, output), media_type="text/event-stream")
        return await self._collect(shape, choices, parsed.n, view, output)

    def _chat_output(self, parsed: ParsedRequest, prompt_ids: tuple[int, ...]) -> ChatOutput | None:
        """How a chat's choices divide (None: all content). Whether the prompt left a <think> open is
        read from its last tokens: the template's generation prompt ends it."""
        think_open = None
        if self.chat_parser.reasoning:
            think_open = prompt_opens_think(self.core.tokenizer.decode(list(prompt_ids[-_THINK_TAIL_TOKENS:]), skip_special=False))
        output = ChatOutput(self.chat_parser, parsed.tools, think_open, parsed.forced)
        return output if output.divides else None

    async def _start(self, parsed: ParsedRequest) -> list[Choice]:
        """Every choice accepted by the scheduler, in index order (n per prompt), or none. A prompt's
        other choices are submitted once its first has its first token: the prompt's full blocks are
        in the prefix cache then, which they reuse, and its prompt logprobs have all come, which they
        are given (the prompt is computed and scored once). Nothing more is waited for: a choice
        queued behind others streams once it runs, and those running stream meanwhile."""
        prepared = [await self._prepare(prompt, parsed) for prompt in parsed.prompts]
        await self._check_structured(parsed)
        echoed = [await self._echoed(prompt, p) if parsed.echo else "" for prompt, p in zip(parsed.prompts, prepared)]
        started: list[Choice] = []
        try:
            await gathered(started, [self._admit_first(i * parsed.n, p, echoed[i], parsed.n) for i, p in enumerate(prepared)])
            firsts = sorted(started, key=lambda c: c.index)
            copies = [
                self._admit(c.index + j, self._copy(p, j), c.echoed, c.prompt_logprobs_head())
                for c, p in zip(firsts, prepared)
                for j in range(1, parsed.n)
            ]
            await gathered(started, copies)
        except BaseException as e:
            await asyncio.gather(*(c.events.aclose() for c in started), return_exceptions=True)
            if isinstance(e, GenerationError):  # before any byte of the body: an HTTP status
                raise generation_error(e, parsed.param("prompt")) from None
            raise
        return sorted(started, key=lambda c: c.index)

    async def _echoed(self, prompt: Prompt, prepared: Prepared) -> str:
        """The prompt's text, which an echoing completion begins with: as sent, or its tokens' text."""
        if prompt.text is not None:
            return prompt.text
        return await asyncio.to_thread(self.core.tokenizer.decode, list(prepared.prompt_ids))

    async def _admit(self, index: int, prepared: Prepared, echoed: str, head: list[Delta | Final] | None = None) -> Choice:
        """A choice accepted by the scheduler (GenerationError if refused). `head`: the events it
        begins with (a copy's prompt logprobs, from its first)."""
        events = await self.core.admit(prepared)
        return Choice(index, prepared.request_id, head or [], events, prepared.prompt_ids, echoed)

    async def _admit_first(self, index: int, prepared: Prepared, echoed: str, n: int) -> Choice:
        """A prompt's first choice; with copies to follow, read through its first token."""
        choice = await self._admit(index, prepared, echoed)
        if n > 1:
            await read_to_first_token(choice)  # raising, its stream has ended: nothing is left to close
        return choice

    def _copy(self, prepared: Prepared, copy: int) -> Prepared:
        """Choice `copy` of a prompt: a request of its own, with a seed of its own when seeded (its
        tokens differ), which scores no prompt: the first choice's prompt logprobs are its."""
        seed = prepared.params.seed
        params = dataclasses.replace(prepared.params, prompt_logprobs=None, seed=None if seed is None else (seed + copy) % 2**63)
        return self.core.prepare(list(prepared.prompt_ids), params, max_tokens_given=True)

    def _require_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        if not key_matches(request.headers.get("authorization", ""), self.api_key):
            raise ApiError(401, "a valid API key is required: Authorization: Bearer <key>", code="invalid_api_key")

    def _check_key(self, request: Request) -> Response | None:
        try:
            self._require_key(request)
        except ApiError as e:
            return error_response(e)
        return None

    def _parse(self, body: dict, chat: bool) -> ParsedRequest:
        self._check_model(body)
        parse = parse_chat if chat else parse_completion
        return parse(body, self.default_max_tokens)

    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and model != self.core.model_id:
            raise ApiError(
                404,
                f"the model {json.dumps(model)} does not exist; this server has {self.core.model_id!r}",
                param="model",
                code="model_not_found",
            )

    async def _prepare(self, prompt: Prompt, parsed: ParsedRequest) -> Prepared:
        try:
            prompt_ids = await self.core.tokenize(prompt)
            return self.core.prepare(prompt_ids, parsed.params, parsed.max_tokens_given)
        except ValueError as e:  # one naming no field is the prompt's: its template refused it, or it cannot fit
            raise ApiError(400, str(e), param=parsed.param(getattr(e, "param", "prompt"))) from None

    async def _check_structured(self, parsed: ParsedRequest) -> None:
        """The request's structured output checked once, whatever its prompts and n (its params
        validated by _prepare)."""
        try:
            await self.core.check_structured(parsed.params)
        except ParamError as e:
            raise ApiError(400, str(e), param=parsed.param(e.param)) from None

    async def _collect(self, shape: ResponseShape, choices: list[Choice], n: int, view: ChoiceView, output: ChatOutput | None) -> Response:
        outputs = await asyncio.gather(*(output_of(choice) for choice in choices))  # cancelled: each closes its stream
        if failed := next((out.final for out in outputs if out.final.finish_reason == "error"), None):
            return error_response(ApiError(503, failed.error, code="worker_failed"))
        outputs = [dataclasses.replace(out, text=choice.echoed + out.text) for choice, out in zip(choices, outputs)]
        if output is not None:
            outputs = [dataclasses.replace(out, parts=output.parse(out.text)) for out in outputs]
        body = shape.full(outputs, n, {c.index: view.logprobs(c.prompt_ids, out) for c, out in zip(choices, outputs)})
        if view.prompt_logprobs:  # vLLM's extension: per choice on completions, per response on chat
            scored = [view.format.prompt(c.prompt_ids, out.prompt_logprobs or NO_LOGPROBS) for c, out in zip(choices, outputs)]
            if shape.chat:
                body["prompt_logprobs"] = scored[0]
            else:
                for choice, prompt in zip(body["choices"], scored):
                    choice["prompt_logprobs"] = prompt
        return JSONResponse(body)

    async def _sse(self, shape: ResponseShape, choices: list[Choice], parsed: ParsedRequest, view: ChoiceView, output: ChatOutput | None):
        # a client that disconnects closes this generator, which closes every choice's events (aborting its request)
        text_lines = {choice.index: _text_line_template(shape, choice.index) for choice in choices}
        streams = {choice.index: view.stream(choice.prompt_ids) for choice in choices}
        divided = {choice.index: output.stream() for choice in choices} if output is not None else {}
        finals: dict[int, Final] = {}
        merged = merged_events(choices)
        try:
            for choice in choices:
                if shape.chat:
                    yield _sse_line(shape.chunk("", role=True, index=choice.index))
                elif choice.echoed:
                    yield _sse_line(shape.chunk(choice.echoed, index=choice.index, logprobs=streams[choice.index].echo()))
            async for index, event in merged:
                if isinstance(event, Delta):
                    logprobs = streams[index].delta(event) if view.reports else None
                    if index in divided:
                        if (parts := divided[index].feed(event.text)) or logprobs is not None:
                            yield _sse_line(shape.chunk(None, index=index, logprobs=logprobs, parts=parts.delta()))
                    elif view.reports:
                        if logprobs is not None or event.text:
                            yield _sse_line(shape.chunk(event.text, index=index, logprobs=logprobs))
                    elif event.text:
                        yield text_lines[index](event.text)
                elif event.finish_reason == "error":
                    yield _sse_line(ApiError(503, event.error, code="worker_failed").body())
                    break
                else:
                    finals[index] = event
                    called = False
                    if index in divided:
                        if parts := divided[index].flush():
                            yield _sse_line(shape.chunk(None, index=index, parts=parts.delta()))
                        called = divided[index].called
                    yield _sse_line(shape.chunk(None if shape.chat else "", reason=finish_reason(event, called), index=index))
        finally:
            await merged.aclose()  # now, not when collected: every stream still open is aborted
        if parsed.include_usage and len(finals) == len(choices):
            yield _sse_line(shape.usage_chunk([finals[c.index] for c in choices], parsed.n))
        yield "data: [DONE]\n\n"


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) unread when it declares more than `limit` bytes, or as soon as it
    streams past them (a chunked body declares nothing)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
        raise _too_large(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _too_large(limit)
    return bytes(body)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than this server's limit of {limit} bytes", code="request_too_large")


def _sse_line(body: dict) -> str:
    return f"data: {_to_json(body)}\n\n"


def _text_line_template(shape: ResponseShape, index: int) -> Callable[[str], str]:
    """The SSE line of a choice's text chunk, as _sse_line(shape.chunk(text, index=index)) writes it,
    with the request's constant fields serialized once: per event only the text is encoded."""
    chunk = _sse_line(shape.chunk(_TEXT_MARK, index=index))
    head, mark, tail = chunk.rpartition(_to_json(_TEXT_MARK))  # the text is the last field
    assert mark, "the chunk has no text field"
    return lambda text: head + encode_basestring(text) + tail
