"""The public gRPC `Generation` service (pulseinfer.v1), next to the HTTP API on one loop."""

from __future__ import annotations

import re

import grpc

from pulseinfer.gateway.core import FINISH_NAMES, Delta, GatewayCore, GenerationError, Prepared, Prompt, key_matches
from pulseinfer.gateway.openai_requests import CHAT_ROLES
from pulseinfer.messages.wire import logprobs_to_proto, params_from_proto
from pulseinfer.proto.pulseinfer.v1 import generate_pb2, generate_pb2_grpc

FINISH_CODES = {name: code for code, name in FINISH_NAMES.items()}
SERVICE = generate_pb2.DESCRIPTOR.services_by_name["Generation"]
MAX_REQUEST_ID = 128
REQUEST_ID = re.compile(rf"[A-Za-z0-9_.:-]{{1,{MAX_REQUEST_ID}}}")


class GenerationService(generate_pb2_grpc.GenerationServicer):
    """A request belongs to the connection that started it: only that connection can abort it, and
    the ids clients choose are theirs alone (the cluster names every request with its own id)."""

    def __init__(self, core: GatewayCore, api_key: str | None, default_max_tokens: int):
        self.core = core
        self.api_key = api_key
        self.default_max_tokens = default_max_tokens
        self.owned: dict[tuple[str, str], str] = {}  # (connection, the client's request id) -> the cluster's id

    async def Generate(self, request, context):
        await self._check_key(context)
        if request.model and request.model != self.core.model_id:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {shown(request.model)}; this server has {self.core.model_id!r}")
        try:
            prepared = await self._prepare(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        request_id = request.request_id or prepared.request_id
        owner = (context.peer(), request_id)
        if owner in self.owned:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {request_id!r} is already running on this connection")
        self.owned[owner] = prepared.request_id
        events = self.core.generate(prepared)
        try:
            async for event in events:
                if isinstance(event, Delta):
                    chunk = generate_pb2.GenerateChunk(text=event.text, token_ids=event.token_ids)
                    for field, logprobs in (("logprobs", event.logprobs), ("prompt_logprobs", event.prompt_logprobs)):
                        if logprobs is not None:
                            logprobs_to_proto(logprobs, getattr(chunk, field))
                    yield generate_pb2.GenerateResponse(request_id=request_id, chunk=chunk)
                    continue
                final = generate_pb2.GenerateFinal(
                    finish_reason=FINISH_CODES[event.finish_reason],
                    usage=generate_pb2.Usage(
                        prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens, cached_tokens=event.cached_tokens
                    ),
                    timings=event.timings,
                    error=event.error,
                )
                yield generate_pb2.GenerateResponse(request_id=request_id, final=final)
        except GenerationError as e:
            await context.abort(e.status, e.message)
        finally:
            del self.owned[owner]
            await events.aclose()

    async def Abort(self, request, context):
        await self._check_key(context)
        request_id = self.owned.get((context.peer(), request.request_id))
        return generate_pb2.AbortResponse(found=request_id is not None and await self.core.abort(request_id))

    async def GetModelInfo(self, request, context):
        await self._check_key(context)
        c = self.core.meta.config
        return generate_pb2.ModelInfo(
            id=self.core.model_id,
            max_context=c.max_position,
            vocab_size=c.vocab_size,
            num_layers=c.num_layers,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
        )

    async def _prepare(self, request: generate_pb2.GenerateRequest) -> Prepared:
        if request.request_id and not REQUEST_ID.fullmatch(request.request_id):
            raise ValueError(f"request_id must be 1-{MAX_REQUEST_ID} characters of ASCII letters, digits, '_', '.', ':' and '-'")
        prompt_ids = await self.core.tokenize(_prompt(request))
        params = params_from_proto(request.sampling, self.default_max_tokens)
        prepared = self.core.prepare(prompt_ids, params, request.sampling.HasField("max_tokens"))
        await self.core.check_structured(prepared.params)
        return prepared

    async def _check_key(self, context) -> None:
        if self.api_key is None:
            return
        metadata = dict(context.invocation_metadata() or ())
        if not key_matches(metadata.get("authorization", ""), self.api_key):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "a valid API key is required: metadata authorization: Bearer <key>")


def _prompt(request: generate_pb2.GenerateRequest) -> Prompt:
    kind = request.WhichOneof("prompt")
    if kind == "text":
        return Prompt(text=request.text)
    if kind == "token_ids":
        return Prompt(token_ids=list(request.token_ids.ids))
    if kind == "chat":
        if not request.chat.messages:
            raise ValueError("chat needs at least one message")
        if any(m.role not in CHAT_ROLES for m in request.chat.messages):
            raise ValueError(f"chat roles must be one of {', '.join(CHAT_ROLES)}")
        return Prompt(chat=[{"role": m.role, "content": m.content} for m in request.chat.messages])
    raise ValueError("the request has no prompt: set text, token_ids or chat")


def shown(value: str, limit: int = 64) -> str:
    """A client's string quoted in an error, cut short: gRPC status details travel in headers."""
    return repr(value if len(value) <= limit else value[:limit] + "...")
