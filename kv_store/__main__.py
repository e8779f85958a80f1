"""`python -m pulseinfer.kv_store --bind ADDR [--model PATH] [--host-kv-tokens N]`"""

from __future__ import annotations

from pulseinfer.common.flags import parse_config
from pulseinfer.common.model.meta import load_model_config
from pulseinfer.common.proc import run_service, setup_logging, stop_on_signals
from pulseinfer.kv_store.layout import PoolGeometry
from pulseinfer.kv_store.server import KVStoreConfig, serve


def main() -> None:
    config = parse_config(KVStoreConfig, "python -m pulseinfer.kv_store", "PulseInfer host KV store")
    setup_logging("kv_store")
    stop = stop_on_signals()
    geometry = PoolGeometry.for_model(
        load_model_config(config.model, config.load_format), config.block_size, config.host_kv_tokens, config.kv_dtype
    )
    serve(config, geometry, stop)


if __name__ == "__main__":
    run_service("kv_store", main)
