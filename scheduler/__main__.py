"""`python -m scheduler --grpc-bind HOST:PORT --workers-bind ADDR --kv-store ADDR`"""

from __future__ import annotations

import argparse

import uvloop

from pulseinfer.flags import add_flags, from_flags
from pulseinfer.proc import run_service, setup_logging
from scheduler.core import SchedulerConfig
from scheduler.server import serve


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m scheduler", description="PulseInfer scheduler")
    add_flags(parser, SchedulerConfig)
    config = from_flags(SchedulerConfig, parser.parse_args())
    setup_logging("scheduler")
    uvloop.run(serve(config))


if __name__ == "__main__":
    run_service("scheduler", main)
