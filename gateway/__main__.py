"""`python -m pulseinfer.gateway --nodes HOST:PORT[,...] [--http-port 8000] [--grpc-port 50051] [--api-key-file PATH] [--model PATH]`

The API key: the content of --api-key-file, else $PULSEINFER_API_KEY (never a flag's value)."""

from __future__ import annotations

import uvloop

from pulseinfer.common.flags import parse_config
from pulseinfer.common.proc import run_service, setup_logging
from pulseinfer.gateway.server import GatewayConfig, serve


def main() -> None:
    config = parse_config(GatewayConfig, "python -m pulseinfer.gateway", "PulseInfer gateway: OpenAI HTTP and gRPC")
    setup_logging("gateway")
    uvloop.run(serve(config))


if __name__ == "__main__":
    run_service("gateway", main)
