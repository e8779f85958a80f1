"""A step that raises fails only its culprit: the worker runs the step's chunks again in halves down
to the request that raises, which ends with the cause; every other request gets the tokens a run
without the fault gives it, and no block is left held in either tier. Faults are injected at each
point of a step (gpu_worker/faults.py), in process, in every mode."""

from __future__ import annotations

import os
import pydoc_data.topics
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from helpers import assert_device_idle, assert_host_idle
from serving_cluster import ServingCluster

from pulseinfer.engine import Engine, EngineConfig
from pulseinfer.gpu_worker.config import WorkerConfig
from pulseinfer.gpu_worker.faults import ENV, POINTS, FaultPlan
from pulseinfer.gpu_worker.offload.config import OffloadConfig
from pulseinfer.messages.sampling import SamplingParams
from pulseinfer.scheduler.batcher import BatcherConfig

MARKERS = {point: 49100 + i for i, point in enumerate(POINTS)}  # tokens no test prompt holds otherwise
# the faults fire at decode steps, from the chosen request's third token on; a recall's at its first
# decode step (the first sampled token comes from its prefill), when every selected block is recalled
AFTER = {point: 0 if point == "recall" else 2 for point in POINTS}
FIRED_AFTER = {point: max(AFTER[point], 1) for point in POINTS}  # tokens it has when its fault fires
# what makes each point run for the chosen request: a grammar for its masks, logprobs to report
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)
CHOSEN = {"mask": SamplingParams(max_tokens=6, structured=("regex", "[a-z ]{1,40}")), "logprobs": SamplingParams(max_tokens=6, logprobs=2)}
# dense runs no selection and no recall
MODE_POINTS = {"dense": POINTS[:4], "pulse": POINTS, "headwise": POINTS}


@pytest.fixture(scope="module")
def prompts(model) -> list[list[int]]:
    ids = model.tokenizer.encode(" ".join(pydoc_data.topics.topics.values())[:40_000])
    assert not set(MARKERS.values()) & set(ids)
    return [ids[i * 300 : i * 300 + 150 + 11 * i] for i in range(8)]  # 150-227 tokens: offloaded past a 16+32-token footprint


def _engine(model, mode: str) -> Engine:
    faults = FaultPlan.parse(",".join(f"{point}:{marker}@{AFTER[point]}" for point, marker in MARKERS.items()))
    # headwise selects per kv head from a narrow margin: the last-bit differences of a smaller batch's
    # matmuls flip its near ties, so it selects every host block here (still recalled, into hot buffers)
    offload = OffloadConfig(sink=16, recent=32, budget=256 if mode == "headwise" else 32, scorer="quest")
    worker = WorkerConfig(mode=mode, device_kv_tokens=8192, offload=offload)
    batcher = BatcherConfig(offload="never" if mode == "dense" else "always")
    return Engine(EngineConfig(worker=worker, batcher=batcher, host_kv_tokens=16384), loaded=model, faults=faults)


def _run(engine: Engine, prompts: list[list[int]], chosen: SamplingParams) -> list:
    return engine.generate(prompts, [chosen] + [PARAMS] * (len(prompts) - 1))


@pytest.mark.parametrize("mode", list(MODE_POINTS))
def test_a_fault_at_any_point_of_a_step_fails_only_its_request(model, prompts, mode):
    with _engine(model, mode) as engine:
        clean = _run(engine, prompts, PARAMS)  # the first prompt holds no marker: no fault
        assert all(c.finish_reason == "length" and not c.error for c in clean)
        for point in MODE_POINTS[mode]:
            chosen = CHOSEN.get(point, PARAMS)
            doomed = [MARKERS[point], *prompts[0]]
            faulted = _run(engine, [doomed, *prompts[1:]], chosen)
            assert faulted[0].finish_reason == "error", point
            assert f"injected fault at {point}" in faulted[0].error
            assert len(faulted[0].token_ids) == FIRED_AFTER[point], point  # it ran until its fault was due
            assert [c.token_ids for c in faulted[1:]] == [c.token_ids for c in clean[1:]], point
            assert all(c.finish_reason == "length" for c in faulted[1:])
            assert_device_idle(engine)
            assert_host_idle(engine)
        assert engine.runner.offload is None or engine.runner.offload.seqs == {}
        # still serving: a request after the faults runs as before them
        assert [c.token_ids for c in _run(engine, prompts, PARAMS)[1:]] == [c.token_ids for c in clean[1:]]


def test_a_step_of_one_failing_request_fails_it_alone_and_counts_it(model, prompts):
    with _engine(model, "pulse") as engine:
        (alone,) = engine.generate([[MARKERS["sampling"], *prompts[0]]], PARAMS)
        assert alone.finish_reason == "error" and "injected fault at sampling" in alone.error
        assert_device_idle(engine)
        assert_host_idle(engine)


def test_the_fault_plan_is_parsed_strictly():
    plan = FaultPlan.parse("forward:12, recall:7@3")
    assert [(f.point, f.marker, f.after) for f in plan.faults] == [("forward", 12, 0), ("recall", 7, 3)]
    for bad in ("nowhere:1", "forward", "forward:x", "forward:1@y"):
        with pytest.raises(ValueError, match="POINT:TOKEN"):
            FaultPlan.parse(bad)
    assert FaultPlan.parse("").faults == ()


# ---------------------------------------------------------------- served

API_KEY = "step-isolation-key"
MODEL = "SmolLM2-135M-Instruct"

SERVED_FLAGS = ("--workers", "1", "--offload", "always", "--sink", "16", "--recent", "32", "--scorer", "quest", "--host-kv-tokens", "16384")
SCORE_FROM = 560  # prompts of 600 tokens: their last 40 scored by decode steps, as lm-eval's local-completions asks


@pytest.fixture(scope="module", params=["pulse", "headwise"])
def served(request):
    """A cluster scoring prompts by decode steps, its worker with the forward fault armed."""
    mode = request.param
    budget = "256" if mode == "headwise" else "32"  # headwise: see _engine
    os.environ[ENV] = f"forward:{MARKERS['forward']}@{AFTER['forward']}"
    try:
        flags = ("--mode", mode, "--budget", budget, "--score-prompt-with", "decode", "--score-from", str(SCORE_FROM))
        cluster = ServingCluster(*SERVED_FLAGS, *flags, api_key=API_KEY)
    finally:
        del os.environ[ENV]
    yield mode, budget, cluster
    cluster.stop()


def test_lm_eval_loglikelihood_scored_by_decode_steps_equals_in_process(served, model, prompts):
    """lm-eval's local-completions request for a loglikelihood (token ids, max_tokens 1, logprobs 1,
    echo) returns the echoed prompt logprobs, equal to the same scoring in process."""
    mode, budget, cluster = served
    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key=API_KEY)
    context = (prompts[0] * 4)[:600]
    body = {"model": MODEL, "prompt": [context], "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0.0, "seed": 1234}
    served_logprobs = client.completions.create(**body).choices[0].logprobs.token_logprobs
    offload = OffloadConfig(sink=16, recent=32, budget=int(budget), scorer="quest")
    batcher = BatcherConfig(offload="always", score_prompt_with="decode", score_from=SCORE_FROM)
    config = EngineConfig(worker=WorkerConfig(mode=mode, offload=offload), batcher=batcher, host_kv_tokens=16384)
    with Engine(config, loaded=model) as engine:
        (done,) = engine.generate([context], SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert served_logprobs[0] is None and len(served_logprobs) == len(context) + 1
    assert served_logprobs[1 : len(context)] == pytest.approx(done.prompt_logprobs, abs=1e-4)


def test_a_served_request_failing_in_its_step_fails_alone(served, prompts):
    """8 requests in flight, one made to fail in its forward: it ends with an error naming the cause,
    the other 7 get the tokens of a run without it, the failure is counted, nothing is left held,
    and the server goes on serving."""
    _, _, cluster = served
    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key=API_KEY, max_retries=0)

    def complete(prompt: list[int]):
        return client.completions.create(model=MODEL, prompt=[prompt], max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True})

    doomed = [MARKERS["forward"], *prompts[0]]
    with ThreadPoolExecutor(8) as pool:
        clean = list(pool.map(complete, prompts))
        ended = list(pool.map(lambda p: _outcome(complete, p), [doomed, *prompts[1:]]))
    assert isinstance(ended[0], openai.APIError) and "injected fault at forward" in str(ended[0])
    assert [c.choices[0].text for c in ended[1:]] == [c.choices[0].text for c in clean[1:]]
    assert cluster.metric("step_isolated_failures_total", worker="0") == 1
    cluster.wait_for(lambda: cluster.metric("num_requests_running") == 0, what="no request running")
    assert cluster.request("/reset_prefix_cache", {})[0] == 200  # then no block is held in either tier

    def idle() -> bool:  # as the next poll of the node's stats shows it
        return cluster.metric("worker_device_kv_blocks_used", worker="0") == cluster.metric("host_kv_blocks_used") == 0

    cluster.wait_for(idle, timeout_s=10, what="no KV block used in either tier")
    assert complete(prompts[1]).choices[0].text == clean[1].choices[0].text


def _outcome(call, *args):
    try:
        return call(*args)
    except openai.APIError as e:
        return e
