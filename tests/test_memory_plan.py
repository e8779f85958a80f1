"""The device memory planner (gpu_worker/memory_plan.py): its arithmetic by hand, Qwen3-8B's plan at
batch 64 x 32k against 80 GB, `pulseinfer plan`, and a worker refusing a plan its device cannot hold."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pulseinfer import cli
from pulseinfer.common.model.config import ModelConfig
from pulseinfer.common.model.meta import load_model_config
from pulseinfer.gpu_worker.config import WorkerConfig
from pulseinfer.gpu_worker.memory_plan import Workload, parse_bytes, plan_memory, worker_plan
from pulseinfer.gpu_worker.model.loader import LoadedModel
from pulseinfer.gpu_worker.offload.config import HostTier, OffloadConfig
from pulseinfer.gpu_worker.runner import ModelRunner
from pulseinfer.kv_store.prefix_cache import HostBlocks
from pulseinfer.kv_store.view import PoolView

SMALL = ModelConfig(
    architecture="llama",
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position=1024,
    rms_eps=1e-6,
    tie_embeddings=False,
    qkv_bias=False,
)
SMALL_OFFLOAD = OffloadConfig(sink=8, recent=16, budget=32, hot_extra=8)
SMALL_WORKER = WorkerConfig(dtype="bfloat16", block_size=8, device_kv_tokens=0, offload=SMALL_OFFLOAD)
QWEN3_8B_32K = WorkerConfig(device="cuda", device_kv_tokens=0, offload=OffloadConfig(budget=2048))


def test_parse_bytes():
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("1.5GiB") == 3 * 2**29
    assert parse_bytes("4096") == 4096
    with pytest.raises(ValueError, match="--device-memory"):
        parse_bytes("80 parsecs")


def test_the_terms_of_a_small_geometry_by_hand():
    plan = plan_memory(SMALL, SMALL_WORKER, Workload(batch=3, context=200, prefill_chunk=16), 10**6, offloading=True)
    terms = {t.name: t.nbytes for t in plan.terms}
    # a layer: q, k, v 64 x (64 + 2 x 32), o 64 x 64, MLP 3 x 64 x 128, two norms of 64; embeddings and
    # the untied lm_head 1000 x 64 each; the final norm 64: 202,048 parameters, 2 bytes each
    assert terms["weights"] == (2 * 1000 * 64 + 2 * (64 * 128 + 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64) * 2 == 404_096
    # a block: K and V x 2 layers x 8 tokens x 2 kv heads x 16 dims x 2 bytes = 2,048 bytes. A row of 25
    # blocks is offloaded to sink 1 + ring 2 + hot 5 (budget 4 + hot extra 1) = 8 device blocks
    assert plan.pool_tokens == 3 * 8 * 8
    assert terms["hot buffers"] == 3 * 5 * 2048
    assert terms["device KV pool"] == 3 * (1 + 2) * 2048
    # the host blocks past the sink (200 // 8 - 1 = 24), each summarized at rank 16 // 4 = 4:
    # 2 kv heads x 4 x 8 tokens x 2 layers x 2 bytes = 256 bytes
    assert terms["block summaries"] == 3 * 24 * 256
    assert terms["lowrank bases"] == 2 * 2 * 16 * 4 * 4  # fp32 [layers, kv heads, head dim, rank]
    # 19 tokens x (2 x 64 hidden + 2 x 64 q and attention output + 2 x 32 k, v + 3 x 128 MLP) x 2 bytes,
    # and the 3 rows' logits over 1000 ids in bfloat16 and fp32
    assert terms["activations (estimate)"] == 19 * 704 * 2 + 3 * 1000 * 6
    assert plan.total == sum(terms.values()) == 517_456 and plan.fits
    assert "fits, 0.00 GB spare" in plan.table()

    dense = plan_memory(SMALL, SMALL_WORKER, Workload(batch=3, context=200, prefill_chunk=16), 10**6, offloading=False)
    assert {t.name: t.nbytes for t in dense.terms}["device KV pool"] == 3 * 25 * 2048  # the whole context of every row
    assert "block summaries" not in {t.name for t in dense.terms}

    short = plan_memory(SMALL, SMALL_WORKER, Workload(batch=3, context=60, prefill_chunk=16), 10**6, offloading=True)
    assert "hot buffers" not in {t.name for t in short.terms}  # 8 blocks: no longer than the footprint, resident


def test_the_term_that_does_not_fit_is_named():
    workload = Workload(batch=3, context=200, prefill_chunk=16)
    plan = plan_memory(SMALL, SMALL_WORKER, workload, 450_000, offloading=True)
    assert not plan.fits
    with pytest.raises(ValueError, match="hot buffers: .* left of"):  # weights and the pool's 18,432 bytes leave 27,472 of 30,720
        plan.check()
    small_pool = plan_memory(SMALL, replace(SMALL_WORKER, device_kv_tokens=128), workload, 10**6, offloading=True)
    assert small_pool.overflow() == "device KV pool: 128 tokens (--device-kv-tokens) hold 2 of the 3 rows of 200 tokens"


def test_qwen3_8b_batch_64_at_32k_budget_2048_on_80_gb():
    plan = plan_memory(load_model_config("qwen3-8b"), QWEN3_8B_32K, Workload(64, 32768, 512), parse_bytes("80GB"), offloading=True)
    print(plan.table())
    terms = {t.name: t.nbytes for t in plan.terms}
    assert terms["weights"] == 8_190_735_360 * 2
    assert terms["device KV pool"] + terms["hot buffers"] == 64 * (4 + 16 + 128) * 2 * 36 * 16 * 8 * 128 * 2
    assert terms["block summaries"] == 64 * (2048 - 4) * 8 * 32 * 16 * 36 * 2  # lowrank at rank 128 // 4
    assert max(plan.terms, key=lambda t: t.nbytes).name == "block summaries"
    assert plan.fits, plan.overflow()  # with today's defaults, 2.57 GB spare


def test_plan_command(capsys):
    args = ["plan", "--model", "qwen3-8b", "--batch", "64", "--context", "32768", "--budget", "2048"]
    assert cli.main([*args, "--device-memory", "80GB"]) == 0
    assert "block summaries" in capsys.readouterr().out
    assert cli.main([*args, "--device-memory", "80GB", "--mode", "dense"]) == 1
    assert "does not fit: device KV pool:" in capsys.readouterr().out
    assert cli.main(args) == 1
    assert "plan needs --device-memory" in capsys.readouterr().err


def _geometry_only(name: str) -> LoadedModel:
    """A model's config without weights: the plan is checked before any is read."""
    return LoadedModel(load_model_config(name), {}, None, Path(name))


def test_a_worker_refuses_a_plan_its_device_cannot_hold():
    # 64 offloaded rows held at Qwen3-8B's longest context (40,960 tokens), their summaries included, need about 87 GB
    config = WorkerConfig(dtype="bfloat16", device_kv_tokens=64 * 148 * 16, device_memory="80GB", offload=OffloadConfig(budget=2048))
    loaded = _geometry_only("qwen3-8b")
    assert worker_plan(loaded.config, config, parse_bytes("80GB"), offloading=True).workload == Workload(64, 40960, 512)
    host = HostTier(PoolView.private(16, 36, 8, 16, 128, torch.bfloat16), HostBlocks(16))
    with pytest.raises(ValueError, match="does not fit: block summaries: .* left of 80.00 GB"):
        ModelRunner(loaded, config, host)
    with pytest.raises(ValueError, match="does not fit: weights"):
        ModelRunner(loaded, WorkerConfig(device_memory="16GB"))


def test_a_worker_that_fits_starts(model):
    runner = ModelRunner(model, WorkerConfig(device_kv_tokens=2048, device_memory="2GB"))
    assert runner.cache_spec.num_tokens == 2048
    runner.close()
