"""The public gRPC `Generation` service (pulseinfer.v1), next to the HTTP API on one loop."""

from __future__ import annotations

import grpc

from gateway.core import FINISH_NAMES, Delta, GatewayCore, GenerationError, key_matches
from gateway.openai_api import CHAT_ROLES
from proto.pulseinfer.v1 import generate_pb2, generate_pb2_grpc
from scheduler.wire import params_from_proto

FINISH_CODES = {name: code for code, name in FINISH_NAMES.items()}
SERVICE = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


class GenerationService(generate_pb2_grpc.GenerationServicer):
    def __init__(self, core: GatewayCore, api_key: str | None, default_max_tokens: int):
        self.core = core
        self.api_key = api_key
        self.default_max_tokens = default_max_tokens

    async def Generate(self, request, context):
        await self._check_key(context)
        if request.model and request.model != self.core.model_id:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {request.model!r}; this server has {self.core.model_id!r}")
        try:
            prepared = self._prepare(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        events = self.core.generate(prepared)
        try:
            async for event in events:
                if isinstance(event, Delta):
                    chunk = generate_pb2.GenerateChunk(text=event.text, token_ids=event.token_ids)
                    yield generate_pb2.GenerateResponse(request_id=prepared.request_id, chunk=chunk)
                    continue
                final = generate_pb2.GenerateFinal(
                    finish_reason=FINISH_CODES[event.finish_reason],
                    usage=generate_pb2.Usage(prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens),
                    timings=event.timings,
                    error=event.error,
                )
                yield generate_pb2.GenerateResponse(request_id=prepared.request_id, final=final)
        except GenerationError as e:
            await context.abort(e.status, e.message)
        finally:
            await events.aclose()

    async def Abort(self, request, context):
        await self._check_key(context)
        return generate_pb2.AbortResponse(found=await self.core.abort(request.request_id))

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

    def _prepare(self, request: generate_pb2.GenerateRequest):
        kind = request.WhichOneof("prompt")
        tok = self.core.tokenizer
        if kind == "text":
            prompt_ids = tok.encode(request.text)
        elif kind == "token_ids":
            prompt_ids = list(request.token_ids.ids)
        elif kind == "chat":
            if any(m.role not in CHAT_ROLES for m in request.chat.messages):
                raise ValueError(f"chat roles must be one of {', '.join(CHAT_ROLES)}")
            prompt_ids = tok.encode_chat([{"role": m.role, "content": m.content} for m in request.chat.messages])
        else:
            raise ValueError("the request has no prompt: set text, token_ids or chat")
        params = params_from_proto(request.sampling, self.default_max_tokens)
        return self.core.prepare(prompt_ids, params, request.sampling.HasField("max_tokens"), request.request_id)

    async def _check_key(self, context) -> None:
        if self.api_key is None:
            return
        metadata = dict(context.invocation_metadata() or ())
        if not key_matches(metadata.get("authorization", ""), self.api_key):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "a valid API key is required: metadata authorization: Bearer <key>")
