"""What every gRPC server in the cluster carries: standard health checking and reflection, and
services registered so that an undecodable request is the client's error (INVALID_ARGUMENT)."""

from __future__ import annotations

from collections.abc import Callable

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pulseinfer.common.tls import SERVER_KEEPALIVE

# gRPC core queues calls that arrive faster than the event loop takes them, and past 1,000 such
# (its default) cancels new ones at random: a burst of 1,300 calls got 9-14 CANCELLED that nobody
# asked for. Above this bound the servers' own limits (the scheduler's queue: RESOURCE_EXHAUSTED)
# decide; the hard limit bounds the memory such a queue can take.
SERVER_OPTIONS = (("grpc.server.max_pending_requests", 16384), ("grpc.server.max_pending_requests_hard_limit", 32768))


def server() -> grpc.aio.Server:
    """A gRPC server of the cluster, with gRPC core's queue of pending calls raised (SERVER_OPTIONS),
    taking the keepalive pings by which its clients notice a lost host (tls.py)."""
    return grpc.aio.server(options=SERVER_OPTIONS + SERVER_KEEPALIVE)


def add_health_and_reflection(server: grpc.aio.Server, service_names: list[str]) -> health.aio.HealthServicer:
    """Registers grpc.health.v1 (SERVING for "" and each service) and server reflection."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return servicer


async def set_serving(servicer: health.aio.HealthServicer, service_names: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        await servicer.set(name, status)


class Undecodable:
    """What a request that does not parse as its message becomes (grpc would answer UNKNOWN); a
    bidirectional method meets it in its request stream, to answer as its protocol says."""

    def __init__(self, error: DecodeError):
        self.error = error


def add_servicer(server: grpc.aio.Server, servicer: object, service: ServiceDescriptor) -> None:
    """Registers `servicer`'s methods for `service`, as the generated add_*_to_server does, except
    that a payload that does not decode is answered INVALID_ARGUMENT before a unary-request method
    runs (a bidirectional one gets an Undecodable in its stream: one bad message need not end it)."""
    handlers = {}
    for method in service.methods:
        kind = (method.client_streaming, method.server_streaming)
        if kind not in _HANDLERS:
            raise ValueError(f"{method.full_name}: client-streaming methods with a single response are not supported")
        behavior = getattr(servicer, method.name)
        handlers[method.name] = _HANDLERS[kind](
            behavior if method.client_streaming else _checked(behavior, method.server_streaming),
            request_deserializer=_lenient(message_factory.GetMessageClass(method.input_type)),
            response_serializer=message_factory.GetMessageClass(method.output_type).SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


_HANDLERS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _lenient(message_class: type[Message]) -> Callable[[bytes], Message | Undecodable]:
    def decode(raw: bytes) -> Message | Undecodable:
        try:
            return message_class.FromString(raw)
        except DecodeError as e:
            return Undecodable(e)

    return decode


def _checked(method: Callable, streaming: bool) -> Callable:
    async def refuse(request, context) -> None:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request does not decode as its message: {request.error}")

    if streaming:

        async def stream(request, context):
            if isinstance(request, Undecodable):
                await refuse(request, context)
            async for response in method(request, context):
                yield response

        return stream

    async def unary(request, context):
        if isinstance(request, Undecodable):
            await refuse(request, context)
        return await method(request, context)

    return unary
