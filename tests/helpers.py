"""Shared test helpers: run the engine's model on raw token ids and read its logits."""

from __future__ import annotations

import torch

from pulseinfer.gpu_worker.batch import build_batch
from pulseinfer.gpu_worker.forward import forward
from pulseinfer.gpu_worker.runner import ModelRunner
from pulseinfer.messages.plan import Chunk, SamplingSpec, StepPlan

GREEDY = SamplingSpec(temperature=0.0, top_p=1.0, top_k=0, seed=0, step=0)


def assert_device_idle(engine) -> None:
    """After the last request: the allocator is sound, only the prefix cache holds device blocks,
    and dropping the cache frees every one."""
    engine.allocator.check()
    assert engine.allocator.num_blocks - engine.allocator.num_free == len(engine.batcher.prefix or ())
    engine.batcher.drop_prefix_cache()
    assert engine.allocator.num_free == engine.allocator.num_blocks


def assert_host_idle(engine) -> None:
    """The same of the in-process host pool: only its prefix cache holds blocks, then none."""
    if engine.host is None:
        return
    host = engine.host.allocator
    host.allocator.check()
    assert host.allocator.num_blocks - host.allocator.num_free == len(host.prefix)
    host.drop_prefix_cache()
    assert host.allocator.num_free == host.allocator.num_blocks


def last_logits(runner: ModelRunner, ids: list[int], chunk: int | None = None) -> torch.Tensor:
    """Logits at the last position, prefilling in chunks of `chunk` tokens (one pass if None)."""
    block = runner.cache_spec.block_size
    table = tuple(range(-(-len(ids) // block)))
    chunk = chunk or len(ids)
    logits = None
    for start in range(0, len(ids), chunk):
        end = min(len(ids), start + chunk)
        plan = StepPlan(0, (Chunk("t", tuple(ids[start:end]), start, table, GREEDY if end == len(ids) else None),))
        batch = build_batch(plan, block, runner.device)
        out = forward(runner.model, batch, runner.attention.begin(plan, batch))
        logits = out[0] if out.shape[0] else logits
    return logits
