"""gateway process: OpenAI HTTP (uvicorn on uvloop) and the public gRPC API on one event loop."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import grpc
import uvicorn

from gateway.core import GatewayCore
from gateway.grpc_api import SERVICE, GenerationService
from gateway.http_api import HttpApi
from gateway.metrics import GatewayMetrics
from gpu_worker.model.loader import load_model_meta
from proto.pulseinfer.v1 import generate_pb2_grpc
from pulseinfer.grpc_common import add_health_and_reflection, set_serving

log = logging.getLogger("gateway")
API_KEY_ENV = "PULSEINFER_API_KEY"


@dataclass(frozen=True)
class GatewayConfig:
    model: str | None = None  # for the tokenizer and the context limit; the workers load the weights
    served_model_name: str | None = None  # default: the model file's name without suffixes
    scheduler: str = "127.0.0.1:50052"
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50051
    api_key: str | None = None  # default: $PULSEINFER_API_KEY; unset: no key needed
    default_max_tokens: int = 256  # when a request leaves max_tokens out (capped by the context)

    def resolved_api_key(self) -> str | None:
        return self.api_key or os.environ.get(API_KEY_ENV) or None


async def serve(config: GatewayConfig) -> None:
    meta = load_model_meta(config.model)
    model_id = config.served_model_name or meta.source.name.split(".")[0]
    channel = grpc.aio.insecure_channel(config.scheduler)
    core = GatewayCore(meta, model_id, generate_pb2_grpc.SchedulerStub(channel), GatewayMetrics())
    api_key = config.resolved_api_key()

    server = grpc.aio.server()
    generate_pb2_grpc.add_GenerationServicer_to_server(GenerationService(core, api_key, config.default_max_tokens), server)
    health = add_health_and_reflection(server, [SERVICE])
    grpc_address = f"{config.host}:{config.grpc_port}"
    if server.add_insecure_port(grpc_address) == 0:
        raise RuntimeError(f"cannot listen on {grpc_address}")
    await server.start()
    await set_serving(health, [SERVICE], True)

    app = HttpApi(core, api_key, config.default_max_tokens).app()
    http = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.http_port, loop="none", log_level="warning", access_log=False))
    log.info(
        "gateway: model %s, HTTP http://%s:%d, gRPC %s, scheduler %s",
        model_id,
        config.host,
        config.http_port,
        grpc_address,
        config.scheduler,
    )
    try:
        await http.serve()  # returns on SIGINT/SIGTERM (uvicorn's handlers)
    finally:
        await server.stop(grace=1)
        await channel.close()
