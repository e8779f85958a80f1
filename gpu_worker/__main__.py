"""`python -m gpu_worker --scheduler ADDR --kv-store ADDR --worker-id N [--device cpu|cuda] [--model PATH]`"""

from __future__ import annotations

import argparse

import zmq

from gpu_worker.model.loader import load_model
from gpu_worker.server import Worker, WorkerServiceConfig, register_with_kv_store
from pulseinfer.flags import add_flags, from_flags
from pulseinfer.proc import exit_on_signals, run_service, setup_logging


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m gpu_worker", description="PulseInfer decode worker")
    add_flags(parser, WorkerServiceConfig)
    config = from_flags(WorkerServiceConfig, parser.parse_args())
    log = setup_logging(f"gpu_worker{config.worker_id}")
    exit_on_signals()
    context = zmq.Context()
    try:
        layout = register_with_kv_store(context, config)
        log.info("kv_store pool %s: %d blocks", layout.shm_name, layout.num_blocks)
        Worker(config, load_model(config.model)).serve(context)
    finally:
        context.destroy(linger=0)


if __name__ == "__main__":
    run_service("gpu_worker", main)
