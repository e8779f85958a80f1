"""`python -m gateway --scheduler HOST:PORT [--http-port 8000] [--grpc-port 50051] [--api-key K] [--model PATH]`"""

from __future__ import annotations

import argparse

import uvloop

from gateway.server import GatewayConfig, serve
from pulseinfer.flags import add_flags, from_flags
from pulseinfer.proc import run_service, setup_logging


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m gateway", description="PulseInfer gateway: OpenAI HTTP and gRPC")
    add_flags(parser, GatewayConfig)
    config = from_flags(GatewayConfig, parser.parse_args())
    setup_logging("gateway")
    uvloop.run(serve(config))


if __name__ == "__main__":
    run_service("gateway", main)
