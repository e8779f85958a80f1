"""OpenAI-compatible HTTP API (Starlette on uvicorn/uvloop)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from json.encoder import encode_basestring

import grpc
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from pulseinfer.gateway.core import Delta, Final, GatewayCore, GenerationError, Prepared, key_matches
from pulseinfer.gateway.openai_api import ApiError, ParsedRequest, ResponseShape, finish_reason, parse_body, parse_chat, parse_completion

MAX_REQUEST_BYTES = 2 << 20  # a prompt filling a 32k context is well under 1 MiB of JSON
_to_json = json.JSONEncoder(ensure_ascii=False).encode  # json.dumps with options builds an encoder per call
_TEXT_MARK = "\x00text\x00"
GRPC_TO_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
}


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def generation_error(error: GenerationError) -> ApiError:
    status = GRPC_TO_HTTP.get(error.status, 503)
    return ApiError(status, error.message, code="rate_limited" if status == 429 else None)


class HttpApi:
    def __init__(self, core: GatewayCore, api_key: str | None, default_max_tokens: int, max_request_bytes: int = MAX_REQUEST_BYTES):
        self.core = core
        self.api_key = api_key
        self.default_max_tokens = default_max_tokens
        self.max_request_bytes = max_request_bytes

    def app(self) -> Starlette:
        routes = [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/reset_prefix_cache", self.reset_prefix_cache, methods=["POST"]),  # vLLM's path
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
        stats = await self.core.cluster_stats()
        problems = []
        if stats is None:
            problems.append("the scheduler is not answering")
        else:
            if stats.workers_alive == 0:
                problems.append("no worker is alive")
            if not stats.kv_store_alive:
                problems.append("the kv_store is not answering")
            corrupt = [stats.host_integrity_error] + [
                f"worker {w.worker_id}: {w.integrity_error}" for w in stats.workers if w.integrity_error
            ]
            problems += [p for p in corrupt if p]
        if problems:
            return JSONResponse({"status": "unavailable", "problems": problems}, status_code=503)
        return JSONResponse({"status": "ok", "workers_alive": stats.workers_alive})

    async def metrics(self, request: Request) -> Response:
        await self.core.cluster_stats()
        return PlainTextResponse(self.core.metrics.render(), media_type="text/plain; version=0.0.4")

    async def reset_prefix_cache(self, request: Request) -> Response:
        """Drops every worker's cached prefix blocks (those requests hold stay theirs)."""
        if (denied := self._check_key(request)) is not None:
            return denied
        try:
            freed = await self.core.reset_prefix_cache()
        except grpc.aio.AioRpcError as e:
            return error_response(ApiError(503, f"the scheduler is not answering: {e.details()}"))
        return JSONResponse({"freed_blocks": freed})

    async def _not_found(self, request: Request, exc) -> Response:
        return error_response(ApiError(404, f"no route {request.url.path}", code="not_found"))

    async def _not_allowed(self, request: Request, exc) -> Response:
        return error_response(ApiError(405, f"{request.method} is not allowed on {request.url.path}"))

    # ------------------------------------------------------------ generation

    async def _generate(self, request: Request, chat: bool) -> Response:
        try:
            self._require_key(request)
            parsed = self._parse(parse_body(await read_body(request, self.max_request_bytes)), chat)
            prepared = await self._prepare(parsed)
            events = self.core.generate(prepared)
            first = await self._first_event(events)
        except ApiError as e:
            self.core.metrics.errors.inc(code=str(e.status))
            return error_response(e)
        shape = ResponseShape(chat, self.core.model_id, prepared.request_id)
        if parsed.stream:
            return StreamingResponse(self._sse(shape, first, events, parsed.include_usage), media_type="text/event-stream")
        return await self._until_done_or_disconnect(request, self._collect(shape, first, events))

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
        model = body.get("model")
        if model is not None and model != self.core.model_id:
            raise ApiError(
                404,
                f"the model {json.dumps(model)} does not exist; this server has {self.core.model_id!r}",
                param="model",
                code="model_not_found",
            )
        parse = parse_chat if chat else parse_completion
        return parse(body, self.default_max_tokens)

    async def _prepare(self, parsed: ParsedRequest) -> Prepared:
        try:
            prompt_ids = await self.core.tokenize(parsed.prompt)
            return self.core.prepare(prompt_ids, parsed.params, parsed.max_tokens_given)
        except ValueError as e:
            raise ApiError(400, str(e)) from None

    async def _first_event(self, events: AsyncIterator[Delta | Final]) -> Delta | Final:
        """Admission errors must become an HTTP status before any byte of the body is sent."""
        try:
            return await anext(events)
        except GenerationError as e:
            raise generation_error(e) from None

    async def _collect(self, shape: ResponseShape, first: Delta | Final, events: AsyncIterator[Delta | Final]) -> Response:
        text = []
        event = first
        try:
            while isinstance(event, Delta):
                text.append(event.text)
                event = await anext(events)
        finally:
            await events.aclose()  # also when cancelled: core.generate's finally aborts the request
        if event.finish_reason == "error":
            return error_response(ApiError(503, event.error, code="worker_failed"))
        return JSONResponse(shape.full("".join(text), event))

    async def _until_done_or_disconnect(self, request: Request, work) -> Response:
        """A non-streaming request whose client hangs up is aborted, not finished for nobody."""
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(_disconnected(request))
        await asyncio.wait([task, gone], return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not task.done():
            task.cancel()  # the generator's finally aborts the request
            return Response(status_code=499)
        return task.result()

    async def _sse(self, shape: ResponseShape, first: Delta | Final, events: AsyncIterator[Delta | Final], include_usage: bool):
        # a client that disconnects cancels this generator; core.generate's finally aborts the request
        if shape.chat:
            yield _sse_line(shape.chunk("", role=True))
        text_line = _text_line_template(shape)
        event = first
        try:
            while isinstance(event, Delta):
                if event.text:
                    yield text_line(event.text)
                event = await anext(events)
        finally:
            await events.aclose()
        if event.finish_reason == "error":
            yield _sse_line(ApiError(503, event.error, code="worker_failed").body())
        else:
            yield _sse_line(shape.chunk(None if shape.chat else "", reason=finish_reason(event)))
            if include_usage:
                yield _sse_line(shape.usage_chunk(event))
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


def _text_line_template(shape: ResponseShape) -> Callable[[str], str]:
    """The SSE line of a text chunk, as _sse_line(shape.chunk(text)) writes it, with the request's
    constant fields serialized once: per event only the text is encoded."""
    head, mark, tail = _sse_line(shape.chunk(_TEXT_MARK)).rpartition(_to_json(_TEXT_MARK))  # the text is the last field
    assert mark, "the chunk has no text field"
    return lambda text: head + encode_basestring(text) + tail


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
