"""Host KV pool bandwidth: write-back and read-back through a worker's mapping of the
kv_store segment, against a plain contiguous copy of the same bytes, in one run.

    pulseinfer bench host-pool [--blocks 2048] [--batch 256] [--repeats 20] [--json OUT]

Write-back: `batch` full blocks of one layer (all heads, K and V) from the device cache's
slot-major layout into their pool units (one transposing scatter for K, one for V). Read-back: one index_select of `batch` scattered units
of a layer into a reused buffer. Baseline: torch copy_ of a contiguous buffer of the same size.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pulseinfer.bench.timing import report, seconds_per_call
from pulseinfer.common.model.meta import load_model_meta
from pulseinfer.kv_store.layout import PoolGeometry
from pulseinfer.kv_store.pool import SharedPool
from pulseinfer.kv_store.server import KVStore
from pulseinfer.kv_store.view import PoolView

BLOCK = 16


@dataclass(frozen=True)
class HostPoolBenchConfig:
    blocks: int = 2048  # pool size in blocks
    batch: int = 256  # blocks per write-back round and per read-back gather
    repeats: int = 20


def main(args: HostPoolBenchConfig, json_path: Path | None = None) -> int:
    torch.set_num_threads(1)  # the I/O engine runs on one core of its own

    config = load_model_meta().config
    geometry = PoolGeometry.for_model(config, BLOCK, args.blocks * BLOCK, "float32")
    pool = SharedPool(geometry)
    layout = KVStore(pool, engine=None).layout()  # the pool's layout only: no recall engine needed
    view = PoolView.attach(layout, config.num_kv_heads, BLOCK, config.head_dim, torch.float32)
    try:
        heads, dim = config.num_kv_heads, config.head_dim
        device_k = torch.randn(args.batch, BLOCK, heads, dim)
        device_v = torch.randn(args.batch, BLOCK, heads, dim)
        blocks = torch.randperm(args.blocks)[: args.batch]
        layer = config.kv_layers // 2

        def write_back() -> None:
            view.write(blocks, layer, device_k, device_v)

        hot = torch.empty(args.batch, 2, heads, BLOCK, dim)  # the worker's reused recall buffer

        def read_back() -> None:
            view.read(blocks, layer, out=hot)

        nbytes = device_k.numel() * device_k.element_size() * 2
        source, target = torch.randn(nbytes // 4), torch.empty(nbytes // 4)
        results = {
            "unit_bytes": geometry.unit_bytes,
            "bytes_per_round": nbytes,
            "memcpy_gbps": nbytes / seconds_per_call(lambda: target.copy_(source), args.repeats) / 1e9,
            "write_back_gbps": nbytes / seconds_per_call(write_back, args.repeats) / 1e9,
            "read_back_gbps": nbytes / seconds_per_call(read_back, args.repeats) / 1e9,
        }
        results["write_back_over_memcpy"] = results["write_back_gbps"] / results["memcpy_gbps"]
        results["read_back_over_memcpy"] = results["read_back_gbps"] / results["memcpy_gbps"]
    finally:
        view.close()
        pool.close()
    report(args, results, json_path, 24)
    return 0
