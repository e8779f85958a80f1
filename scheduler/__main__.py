"""`python -m pulseinfer.scheduler --grpc-bind HOST:PORT --workers-bind ADDR --kv-store ADDR`"""

from __future__ import annotations

import uvloop

from pulseinfer.common.flags import parse_config
from pulseinfer.common.proc import run_service, setup_logging
from pulseinfer.scheduler.core import SchedulerConfig
from pulseinfer.scheduler.server import serve


def main() -> None:
    config = parse_config(SchedulerConfig, "python -m pulseinfer.scheduler", "PulseInfer scheduler")
    setup_logging("scheduler")
    uvloop.run(serve(config))


if __name__ == "__main__":
    run_service("scheduler", main)
