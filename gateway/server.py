"""gateway process: OpenAI HTTP (uvicorn on uvloop) and the public gRPC API on one event loop."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import uvicorn

from pulseinfer.common import grpc_common
from pulseinfer.common.api_key import resolve_api_key
from pulseinfer.common.grammar import GrammarVocab
from pulseinfer.common.grpc_common import add_health_and_reflection, add_servicer, set_serving
from pulseinfer.common.model.meta import load_model_meta, served_name
from pulseinfer.common.tls import TlsConfig
from pulseinfer.gateway.chat_parsers import chat_parser_for
from pulseinfer.gateway.core import GatewayCore
from pulseinfer.gateway.grammar_checks import GrammarChecks
from pulseinfer.gateway.grpc_api import SERVICE, GenerationService
from pulseinfer.gateway.http_api import MAX_REQUEST_BYTES, HttpApi
from pulseinfer.gateway.metrics import GatewayMetrics
from pulseinfer.gateway.nodes import DNS_PREFIX, Nodes
from pulseinfer.gateway.router import RouterConfig
from pulseinfer.messages.limits import DEFAULT_MAX_TOKENS

log = logging.getLogger("gateway")


@dataclass(frozen=True)
class GatewayConfig:
    model: str | None = None  # for the tokenizer and the context limit; the workers load the weights
    load_format: str = "auto"  # auto | dummy: seeded random weights of the model's geometry
    served_model_name: str | None = None  # default: the --model name, or the model file's name without suffixes
    # the nodes' schedulers: comma-separated HOST:PORT or unix://PATH, and/or dns:NAME:PORT (every address
    # the name resolves to, again every few seconds: a Kubernetes headless Service)
    nodes: str = "127.0.0.1:50052"
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50051
    api_key_file: str | None = None  # the API key is this file's content; default: $PULSEINFER_API_KEY; neither: no key needed
    default_max_tokens: int = DEFAULT_MAX_TOKENS  # when a request leaves max_tokens out (capped by the context)
    max_request_bytes: int = MAX_REQUEST_BYTES  # larger HTTP bodies get 413 before they are read
    # chat outputs divided into reasoning_content, content and tool_calls: qwen3 (<think> and hermes
    # <tool_call>), hermes, llama3_json, none; auto: the model family's (docs/api.md "Tool calls and reasoning")
    chat_parser: str = "auto"
    router: RouterConfig = field(default_factory=RouterConfig)
    tls: TlsConfig = field(default_factory=TlsConfig)  # mutual TLS to the nodes (their --listen)

    def __post_init__(self) -> None:
        for target in filter(None, (t.strip() for t in self.nodes.split(","))):  # Nodes names an empty entry
            self.tls.check_plaintext(target.removeprefix(DNS_PREFIX), "--nodes")

    def resolved_api_key(self) -> str | None:
        """Never a flag's value: a command line is visible to every local user (`ps`)."""
        return resolve_api_key(self.api_key_file)


async def serve(config: GatewayConfig) -> None:
    api_key = config.resolved_api_key()  # once, first: a bad --api-key-file fails before anything starts
    meta = load_model_meta(config.model, config.load_format)
    chat_parser = chat_parser_for(config.chat_parser, meta.config.architecture)  # a bad name fails before anything listens
    model_id = config.served_model_name or served_name(config.model, meta.source)
    metrics = GatewayMetrics()
    nodes = Nodes(config.nodes, config.router, config.tls.channel, metrics)
    stops = [meta.tokenizer.eos_id] if meta.tokenizer.eos_id is not None else []
    # a grammar needs a stop token: without one, structured outputs are refused
    grammars = GrammarChecks(GrammarVocab.of(meta.tokenizer, meta.config.vocab_size, stops)) if stops else None
    core = GatewayCore(meta, model_id, nodes, metrics, grammars)
    await nodes.start()

    server = grpc_common.server()
    add_servicer(server, GenerationService(core, api_key, config.default_max_tokens), SERVICE)
    health = add_health_and_reflection(server, [SERVICE.full_name])
    grpc_address = f"{config.host}:{config.grpc_port}"
    if server.add_insecure_port(grpc_address) == 0:
        raise RuntimeError(f"cannot listen on {grpc_address}")
    await server.start()
    await set_serving(health, [SERVICE.full_name], True)

    app = HttpApi(core, api_key, config.default_max_tokens, config.max_request_bytes, chat_parser).app()
    http = uvicorn.Server(
        uvicorn.Config(app, host=config.host, port=config.http_port, loop="none", http="httptools", log_level="warning", access_log=False)
    )
    log.info(
        "gateway: model %s, HTTP http://%s:%d, gRPC %s, nodes %s (%s)",
        model_id,
        config.host,
        config.http_port,
        grpc_address,
        config.nodes,
        config.router.route,
    )
    try:
        await http.serve()  # returns on SIGINT/SIGTERM (uvicorn's handlers)
    finally:
        await server.stop(grace=1)
        await nodes.close()
        if grammars is not None:
            grammars.close()
