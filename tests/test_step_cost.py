"""pulseinfer bench step-cost's counting on a small geometry: what is counted, not how fast."""

from __future__ import annotations

import json

import pytest
import torch

from pulseinfer.bench.step_cost import OpCounter, StepCostBenchConfig, run, table, traffic
from pulseinfer.common.model.meta import ModelLoadError

aten = torch.ops.aten


def test_views_are_ops_but_not_kernels_and_indexed_ops_count_their_rows():
    pool, rows = torch.zeros(100, 8), torch.tensor([3, 7])
    with OpCounter() as counter:
        counter.counting = True
        pool.view(800).t()  # views: ops, no kernel
        picked = pool[rows]  # a gather: the two rows read, not the pool
        pool[rows] = picked + 1  # a scatter: the two rows written
    assert counter.ops > counter.kernels == 3
    assert traffic(aten.index, (pool, [rows]), {}, picked) == 2 * picked.numel() * 2 + rows.nbytes  # floats at bf16's 2 bytes
    assert traffic(aten.mm, (pool, torch.zeros(8, 4)), {}, torch.zeros(100, 4)) == (800 + 32 + 400) * 2


@pytest.fixture(scope="module")
def result():
    config = StepCostBenchConfig(
        geometry="qwen3-0.6b", layers="1,2", contexts="64,128", batches="2,4", modes="dense,pulse", steps=1,
        sink=16, recent=16, budget_share=0.25, calibration_tokens=64, target_context=1024,
    )  # fmt: skip
    try:
        return run(config, log=lambda _: None)
    except ModelLoadError as e:
        pytest.skip(f"no tokenizer for the dummy geometry: {e}")


def test_a_dense_step_dispatches_as_many_ops_at_any_context_and_syncs_once(result):
    rows = {(r["mode"], r["batch"], r["context"]): r for r in result["rows"]}
    for batch in (2, 4):
        short, long = rows[("dense", batch, 64)]["measured"], rows[("dense", batch, 128)]["measured"]
        assert short["ops"] == long["ops"] > short["kernels"] == long["kernels"] > 0
        assert short["syncs"] == long["syncs"] == 1  # the sampler's one transfer
        assert long["bytes"] > short["bytes"]  # the attended KV
        pulse = rows[("pulse", batch, 128)]
        assert pulse["measured"]["syncs"] > 1 and pulse["measured"]["recall_bytes"] > 0  # selections, recalls: offloaded
        assert pulse["floor"]["attended_tokens"] == 16 + 32 + 16 < rows[("dense", batch, 128)]["floor"]["attended_tokens"]
    target = rows[("dense", 4, 1024)]
    assert target["extrapolated"] and target["floor"]["kv"] == 8 * rows[("dense", 4, 128)]["floor"]["kv"]
    assert "pulse_over_dense_kernels_b4_at_1024" in result["ratios"]
    assert "1024 (extrap.)" in table(result)
    json.dumps(result)
