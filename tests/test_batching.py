"""Batched decode equals decoding each request alone; preemption loses nothing."""

from __future__ import annotations

from conftest import PROMPTS
from helpers import assert_device_idle

from pulseinfer.engine import Engine, EngineConfig
from pulseinfer.gpu_worker.config import WorkerConfig
from pulseinfer.messages.sampling import SamplingParams
from pulseinfer.scheduler.batcher import BatcherConfig

GREEDY_24 = SamplingParams(max_tokens=24, ignore_eos=True)


def _prompts(engine) -> list[list[int]]:
    # very different lengths: 1 token up to a few hundred
    long = engine.tokenizer.encode(" ".join(PROMPTS) * 12)
    return [engine.tokenizer.encode(p) for p in PROMPTS] + [long[:1], long[:97], long[:300]]


def test_batched_decode_equals_alone(engine):
    prompts = _prompts(engine)
    alone = [engine.generate([p], GREEDY_24)[0].token_ids for p in prompts]
    together = [c.token_ids for c in engine.generate(prompts, GREEDY_24)]
    assert together == alone
    assert_device_idle(engine)


def test_chunked_prefill_and_preemption_keep_tokens(model, engine):
    prompts = _prompts(engine)
    expected = [c.token_ids for c in engine.generate(prompts, GREEDY_24)]
    # a pool too small for all sequences at once and tiny prefill chunks: preemption + recompute
    small = Engine(
        EngineConfig(worker=WorkerConfig(device_kv_tokens=512), batcher=BatcherConfig(prefill_chunk=64)),
        loaded=model,
    )
    got = small.generate(prompts, GREEDY_24)
    assert [c.token_ids for c in got] == expected
    assert small.batcher.num_preemptions > 0
    assert_device_idle(small)
