"""`python -m pulseinfer.gpu_worker --scheduler ADDR --kv-store ADDR --worker-id N [--device cpu|cuda] [--model PATH]`"""

from __future__ import annotations

import logging

import zmq

from pulseinfer.common.flags import parse_config
from pulseinfer.common.model.meta import load_model_meta
from pulseinfer.common.proc import run_service, setup_logging, stop_on_signals
from pulseinfer.gpu_worker.faults import FaultPlan
from pulseinfer.gpu_worker.model.loader import load_model
from pulseinfer.gpu_worker.offload.config import HostTier
from pulseinfer.gpu_worker.runner import ModelRunner
from pulseinfer.gpu_worker.server import ServedModel, Worker, WorkerServiceConfig
from pulseinfer.gpu_worker.simulated import SimulatedRunner
from pulseinfer.kv_store.client import KVStoreClient
from pulseinfer.kv_store.segments import sweep
from pulseinfer.kv_store.view import PoolView


def main() -> None:
    config = parse_config(WorkerServiceConfig, "python -m pulseinfer.gpu_worker", "PulseInfer decode worker")
    log = setup_logging(f"gpu_worker{config.worker_id}")
    stop = stop_on_signals()
    sweep()  # e.g. the cache segment of this worker's earlier process, killed -9
    context = zmq.Context()
    try:
        worker = simulated_worker(config, log) if config.simulate_step_ms > 0 else model_worker(config, context, log)
        worker.serve(context, stop)
    finally:
        context.destroy(linger=0)


def model_worker(config: WorkerServiceConfig, context: zmq.Context, log: logging.Logger) -> Worker:
    kv_store = KVStoreClient(context, config.kv_store, config.kv_store_timeout_s)
    loaded = load_model(config.model, config.load_format)
    c, w = loaded.config, config.worker

    def attach() -> PoolView:
        layout = kv_store.register(config.worker_id)
        log.info("kv_store pool %s: %d blocks", layout.shm_name, layout.num_blocks)
        view = PoolView.attach(layout, c.num_kv_heads, w.block_size, c.head_dim, w.torch_dtype())
        if w.device == "cuda":
            view.pin()
        return view

    engine = kv_store.open_recall_engine if config.engine_recalls else None
    host = HostTier(attach(), kv_store, attach, engine, kv_store.lost, config.worker_id)
    runner = ModelRunner(loaded, config.worker, host, faults=FaultPlan.from_env())
    return Worker(config, runner, ServedModel(loaded.config, loaded.source.name, loaded.tokenizer.eos_id, loaded.tokenizer), kv_store.lost)


def simulated_worker(config: WorkerServiceConfig, log: logging.Logger) -> Worker:
    """A benchmark tool (`pulseinfer bench control-plane`): the model's config and tokenizer only, no
    weights, and no host tier (it is not registered with the kv_store, whose pool it never maps)."""
    meta = load_model_meta(config.model, config.load_format)
    log.warning("simulated forward of %.3g ms: a benchmark tool, this worker runs no model", config.simulate_step_ms)
    runner = SimulatedRunner(config.worker, meta.tokenizer, config.simulate_step_ms)
    return Worker(config, runner, ServedModel(meta.config, meta.source.name, meta.tokenizer.eos_id))


if __name__ == "__main__":
    run_service("gpu_worker", main)
