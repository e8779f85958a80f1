"""`python -m scheduler --grpc-bind HOST:PORT --workers-bind ADDR --kv-store ADDR`"""

from __future__ import annotations

import uvloop

from pulseinfer.flags import parse_config
from pulseinfer.proc import run_service, setup_logging
from scheduler.core import SchedulerConfig
from scheduler.server import serve


def main() -> None:
    config = parse_config(SchedulerConfig, "python -m scheduler", "PulseInfer scheduler")
    setup_logging("scheduler")
    uvloop.run(serve(config))


if __name__ == "__main__":
    run_service("scheduler", main)
