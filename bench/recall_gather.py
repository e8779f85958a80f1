"""Recall gather bandwidth: fragmented SoloHead selections vs a contiguous copy of the same
bytes vs head-wise selections, side by side in one run, on one core (the I/O engine's).

    pulseinfer bench recall-gather [--requests 8] [--context 4096] [--fraction 0.1] [--repeats 5] [--json OUT]

Every request selects `fraction` of its host blocks per layer, at random (the least
contiguous case). Per decode step and for every layer:
- pulse gather: one index_select of the selected (block, layer) units from the host pool into
  a staging buffer (what the I/O engine moves);
- pulse recall: one gather of the units scattered into the device cache's hot blocks
  (slot-major), as the worker's synchronous recall does;
- contiguous: one copy_ of a contiguous range of the same size into the staging buffer;
- head-wise recall: the same budget chosen per kv head, one (block, head) K run and V run each.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pulseinfer.bench.timing import report, seconds_per_call
from pulseinfer.common.model.meta import load_model_meta
from pulseinfer.kernels.gather_scatter import recall_ref
from pulseinfer.kv_store.view import PoolView

BLOCK = 16


@dataclass(frozen=True)
class RecallGatherBenchConfig:
    requests: int = 8
    context: int = 4096  # host tokens per request
    fraction: float = 0.1  # share of each request's host blocks selected per layer
    repeats: int = 5


def main(args: RecallGatherBenchConfig, json_path: Path | None = None) -> int:
    torch.set_num_threads(1)
    torch.manual_seed(0)

    c = load_model_meta().config
    layers, heads, dim = c.kv_layers, c.num_kv_heads, c.head_dim
    per_request = args.context // BLOCK
    chosen = max(1, round(per_request * args.fraction))
    view = PoolView.private(args.requests * per_request, layers, heads, BLOCK, dim, torch.float32)
    view.units.normal_()  # faults the pool in
    units = view.units
    hot_blocks = args.requests * chosen
    k_cache, v_cache = torch.zeros(hot_blocks * BLOCK, heads, dim), torch.zeros(hot_blocks * BLOCK, heads, dim)
    dst = torch.arange(hot_blocks)

    def selection() -> torch.Tensor:  # host blocks picked per request, the requests' blocks interleaved as an allocator leaves them
        return torch.cat([torch.randperm(per_request)[:chosen] * args.requests + r for r in range(args.requests)])

    rows = [view.unit_rows(selection(), layer) for layer in range(layers)]
    head_rows = [[view.unit_rows(selection(), layer) for _ in range(heads)] for layer in range(layers)]
    staging = torch.empty(hot_blocks, units[0].numel())
    flat = units.view(units.shape[0], -1)
    contiguous = flat[: hot_blocks * layers].view(layers, hot_blocks, -1)

    def pulse_gather() -> None:
        for layer in range(layers):
            torch.index_select(flat, 0, rows[layer], out=staging)

    def pulse_recall() -> None:
        for layer in range(layers):
            recall_ref(units, rows[layer], k_cache, v_cache, dst)

    def contiguous_copy() -> None:
        for layer in range(layers):
            staging.copy_(contiguous[layer])

    head_index = torch.arange(heads).repeat_interleave(hot_blocks)

    def headwise_recall() -> None:
        for layer in range(layers):
            recall_ref(units, torch.cat(head_rows[layer]), k_cache, v_cache, dst.repeat(heads), head_index)

    step_bytes = layers * hot_blocks * view.unit_bytes
    seconds = {
        name: seconds_per_call(fn, args.repeats)
        for name, fn in [
            ("contiguous", contiguous_copy),
            ("pulse_gather", pulse_gather),
            ("pulse_recall", pulse_recall),
            ("headwise_recall", headwise_recall),
        ]
    }
    results = {
        "bytes_per_step": step_bytes,
        "unit_bytes": view.unit_bytes,
        "pulse_transfers_per_step": layers * hot_blocks,
        "headwise_transfers_per_step": layers * hot_blocks * heads * 2,
        **{f"{name}_gbps": step_bytes / s / 1e9 for name, s in seconds.items()},
        **{f"{name}_ms_per_step": s * 1e3 for name, s in seconds.items()},
    }
    for name in ("pulse_gather", "pulse_recall", "headwise_recall"):
        results[f"{name}_over_contiguous"] = seconds["contiguous"] / seconds[name]
    report(args, results, json_path, 32)
    return 0
