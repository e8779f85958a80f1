"""`python -m pulseinfer.gpu_worker --scheduler ADDR --kv-store ADDR --worker-id N [--device cpu|cuda] [--model PATH]`"""

from __future__ import annotations

import zmq

from pulseinfer.common.flags import parse_config
from pulseinfer.common.proc import run_service, setup_logging, stop_on_signals
from pulseinfer.gpu_worker.model.loader import load_model
from pulseinfer.gpu_worker.offload.config import HostTier
from pulseinfer.gpu_worker.server import Worker, WorkerServiceConfig
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
        Worker(config, loaded, HostTier(attach(), kv_store, attach, engine, kv_store.lost)).serve(context, stop)
    finally:
        context.destroy(linger=0)


if __name__ == "__main__":
    run_service("gpu_worker", main)
