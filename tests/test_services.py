"""The cluster as separate OS processes (`pulseinfer serve`), driven by the official openai
client, a gRPC client generated from proto/, and raw HTTP for the error cases."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import openai
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from serving_cluster import ServingCluster

from pulseinfer.gpu_worker.config import WorkerConfig
from pulseinfer.gpu_worker.forward import dense_forward
from pulseinfer.gpu_worker.offload.config import OffloadConfig
from pulseinfer.messages.sampling import SamplingParams
from pulseinfer.proto.pulseinfer.v1 import generate_pb2, generate_pb2_grpc
from pulseinfer.scheduler.batcher import BatcherConfig

API_KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def cluster():
    # Qwen3's chat parser (reasoning, hermes tool calls): SmolLM2 writes neither unless a constraint makes it
    cluster = ServingCluster(
        "--workers", "2", "--worker-timeout-s", "2", "--host-kv-tokens", "16384", "--chat-parser", "qwen3", api_key=API_KEY
    )  # fmt: skip
    yield cluster
    assert cluster.stop() == 0


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def stub(cluster):
    with grpc.insecure_channel(cluster.grpc_address) as channel:
        yield generate_pb2_grpc.GenerationStub(channel), channel


AUTH = (("authorization", f"Bearer {API_KEY}"),)


def test_completion_equals_in_process_engine(client, engine):
    prompt = "The quick brown fox jumps over the lazy dog. Then it"
    (expected,) = engine.generate([engine.tokenizer.encode(prompt)], SamplingParams(max_tokens=24))
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    assert got.choices[0].text == expected.text
    assert got.usage.completion_tokens == expected.completion_tokens
    assert got.choices[0].finish_reason == expected.finish_reason


def test_chat_equals_pulseinfer_generate(client):
    cli = subprocess.run(
        [sys.executable, "-m", "pulseinfer.cli", "generate", "--chat", "--prompt", CHAT[0]["content"], "--max-tokens", "24", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    expected = json.loads(cli.stdout)
    got = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    assert got.choices[0].message.content == expected["text"]
    assert got.usage.prompt_tokens == expected["prompt_tokens"]
    assert got.usage.completion_tokens == expected["completion_tokens"]


def test_streaming_chat_with_usage_equals_non_streaming(client):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0)
    stream = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=20, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_stop_string_and_seeded_sampling(client):
    got = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=30, temperature=0, stop=[" 6"])
    assert got.choices[0].text.endswith("5,") and got.choices[0].finish_reason == "stop"
    runs = [
        client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0.9, seed=7).choices[0].text
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


def test_grpc_generate_streams_the_same_text(client, stub):
    generation, _ = stub
    prompt = "def fibonacci(n):\n    "
    expected = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    request = generate_pb2.GenerateRequest(text=prompt, sampling=generate_pb2.SamplingParams(max_tokens=16, temperature=0.0))
    responses = list(generation.Generate(request, metadata=AUTH))
    assert all(r.WhichOneof("event") == "chunk" for r in responses[:-1])
    final = responses[-1].final
    assert "".join(r.chunk.text for r in responses[:-1]) == expected.choices[0].text
    assert final.usage.completion_tokens == expected.usage.completion_tokens and final.timings.e2e_s > 0
    info = generation.GetModelInfo(generate_pb2.GetModelInfoRequest(), metadata=AUTH)
    assert info.id == MODEL and info.max_context == 8192


def test_a_shared_prefix_is_prefilled_once_and_reported_as_cached(client, cluster, stub):
    """The second request with a long shared prefix goes to the worker that caches it and reuses
    every full block of the prefix (usage.prompt_tokens_details.cached_tokens, gRPC usage, /metrics);
    a reset of the prefix cache frees the blocks and the next request finds none."""
    prefix = [(i * 7919) % 20000 + 100 for i in range(900)]  # token ids no other test sends

    def complete(tail: list[int]):
        return client.completions.create(model=MODEL, prompt=prefix + tail, max_tokens=4, temperature=0)

    def hits() -> float:
        return sum(cluster.metric("prefix_cache_hits_total", worker=w) or 0 for w in ("0", "1"))

    before = hits()
    cold = complete([11, 12, 13])
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    warm = complete([21, 22])
    assert warm.usage.prompt_tokens_details.cached_tokens == 896  # the prefix's 56 full blocks of 16
    assert hits() - before == 896
    generation, _ = stub
    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=prefix + [31]), sampling=generate_pb2.SamplingParams(max_tokens=2, temperature=0.0)
    )
    assert list(generation.Generate(request, metadata=AUTH))[-1].final.usage.cached_tokens == 896
    rates = [cluster.metric("prefix_cache_hit_rate", worker=w) for w in ("0", "1")]
    assert all(rate is not None and 0 <= rate <= 1 for rate in rates) and max(rates) > 0

    cluster.wait_for(lambda: cluster.metric("num_requests_running") == 0, 30, "the cluster to be idle")
    for w in ("0", "1"):  # idle: the prefix cache holds every used device block
        assert cluster.metric("worker_device_kv_blocks_used", worker=w) == cluster.metric("prefix_cache_device_blocks", worker=w)
    assert cluster.request("/reset_prefix_cache", {}, key=None)[0] == 401
    status, body = cluster.request("/reset_prefix_cache", {})
    assert status == 200 and body["freed_blocks"] >= 56
    for w in ("0", "1"):
        assert cluster.metric("worker_device_kv_blocks_used", worker=w) == 0 == cluster.metric("prefix_cache_device_blocks", worker=w)
    assert complete([41]).usage.prompt_tokens_details.cached_tokens == 0


def test_grpc_errors_health_and_reflection(stub):
    generation, channel = stub
    with pytest.raises(grpc.RpcError) as e:
        list(generation.Generate(generate_pb2.GenerateRequest(text="hi")))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    bad = generate_pb2.GenerateRequest(text="hi", sampling=generate_pb2.SamplingParams(max_tokens=0))
    with pytest.raises(grpc.RpcError) as e:
        list(generation.Generate(bad, metadata=AUTH))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:
        list(generation.Generate(generate_pb2.GenerateRequest(text="hi", model="gpt-4"), metadata=AUTH))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="pulseinfer.v1.Generation"))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    listing = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    names = {s.name for s in next(listing).list_services_response.service}
    assert {"pulseinfer.v1.Generation", "grpc.health.v1.Health"} <= names


def test_sixteen_concurrent_streams_are_batched(client, cluster):
    def run(i: int) -> tuple[str, int, str]:
        stream = client.completions.create(
            model=MODEL, prompt=f"Story number {i}:", max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True}
        )
        text, usage, reason = "", None, None
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
            usage = chunk.usage or usage
        return text, usage.completion_tokens, reason

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, range(16)))
    for text, tokens, reason in results:
        assert reason in ("stop", "length") and 0 < tokens <= 24 and text
    assert sum(r[1] for r in results) > 16
    biggest = max(cluster.metric("decode_batch_size_max", worker=w) or 0 for w in ("0", "1"))
    assert biggest >= 4, f"the 16 requests were not decoded together (largest decode batch {biggest})"


BAD_REQUESTS = [
    ("invalid JSON", "/v1/completions", b'{"prompt": "hi",', 400),
    ("invalid UTF-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400),
    ("body not an object", "/v1/completions", b"[1, 2]", 400),
    ("wrong type max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400),
    ("wrong type temperature", "/v1/completions", {"prompt": "hi", "temperature": True}, 400),
    ("wrong type prompt", "/v1/completions", {"prompt": {"text": "hi"}}, 400),
    ("missing prompt", "/v1/completions", {"max_tokens": 4}, 400),
    ("missing messages", "/v1/chat/completions", {"model": MODEL}, 400),
    ("bad role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("max_tokens zero", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400),
    ("max_tokens negative", "/v1/chat/completions", {"messages": CHAT, "max_tokens": -5}, 400),
    ("prompt over the context", "/v1/completions", {"prompt": [1] * 8200, "max_tokens": 4}, 400),
    ("prompt plus max_tokens over the context", "/v1/completions", {"prompt": [1] * 8000, "max_tokens": 500}, 400),
    ("token id out of vocabulary", "/v1/completions", {"prompt": [10**9], "max_tokens": 4}, 400),
    ("unknown model", "/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404),
    ("temperature below zero", "/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400),
    ("top_p above one", "/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400),
    ("huge n", "/v1/completions", {"prompt": "hi", "n": 100000}, 400),
    ("top_logprobs over 20", "/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400),
    ("top_logprobs without logprobs", "/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400),
    ("streamed prompt_logprobs", "/v1/completions", {"prompt": "a", "stream": True, "prompt_logprobs": 1}, 400),
    ("stream_options without stream", "/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400),
    ("unknown route", "/v1/embeddings", {"input": "hi"}, 404),
]


def test_bench_serve_drives_the_http_api(cluster, tmp_path):
    out = tmp_path / "serve.json"
    key_file = tmp_path / "key"
    key_file.write_text(API_KEY + "\n")
    flags = ("--base-url", cluster.base_url, "--api-key-file", str(key_file))  # the key in a file: argv shows in `ps`
    flags += ("--num-prompts", "4", "--input-len", "64", "--output-len", "6")
    load = ("--request-rate", "20", "--max-concurrency", "2", "--json", str(out))
    result = subprocess.run(
        [sys.executable, "-m", "pulseinfer.cli", "bench", "serve", *flags, *load],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert API_KEY not in out.read_text()
    report = json.loads(out.read_text())
    assert report["completed"] == 4 and report["failed"] == 0 and report["settings"]["model"] == MODEL
    assert report["output_token_throughput"] == pytest.approx(4 * 6 / report["duration_s"])
    assert 0 < report["ttft"]["p50_ms"] <= report["e2e"]["p50_ms"] and report["tpot"]["mean_ms"] > 0 and report["itl"]["p99_ms"] > 0


def test_bench_serve_replays_a_trace(cluster, tmp_path):
    rows = [(0, 1024, 128, [0, 1]), (200, 1300, 128, [0, 1, 2]), (400, 700, 128, [0, 3]), (600, 300, 128, [4])]  # blocks 0 and 1 shared
    keys = ("timestamp", "input_length", "output_length", "hash_ids")
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(dict(zip(keys, row))) + "\n" for row in rows))
    out = tmp_path / "trace.json"
    (tmp_path / "key").write_text(API_KEY)
    flags = ("--base-url", cluster.base_url, "--api-key-file", str(tmp_path / "key"), "--trace", str(trace), "--json", str(out))
    replay = ("--length-scale", "0.03125", "--time-scale", "2", "--max-concurrency", "2", "--slo-ttft-ms", "600000")  # blocks of 16 tokens
    command = [sys.executable, "-m", "pulseinfer.cli", "bench", "serve", *flags, *replay]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["completed"] == 4 and report["output_token_throughput"] == pytest.approx(4 * 4 / report["duration_s"])
    assert report["goodput"] == report["request_throughput"] and report["slo_attainment"] == 1.0
    assert report["prompt_tokens"] == 32 + 41 + 22 + 9 and 0 <= report["cached_tokens"] <= report["prompt_tokens"]
    trace_report = report["trace"]
    assert trace_report["max_model_len"] == 8192 and trace_report["block_tokens"] == 16 and trace_report["replay_span_s"] == 0.3
    assert trace_report["potential_block_hit_rate"] == 3 / 8  # of 2 + 3 + 2 + 1 blocks, the second's first two and the third's first


# what the OpenAI API documents that this server does not do (yet), each with a value that asks for
# it, and the extensions of other servers: each must be refused with a 400 naming it, never ignored
NOT_IMPLEMENTED = {
    "completions": {
        "best_of": 2, "suffix": "end", "guided_json": {}, "guided_regex": "a",
    },
    "chat": {
        "guided_choice": ["a"], "functions": [{"name": "f"}], "function_call": "auto",
        "audio": {"voice": "alloy"}, "modalities": ["text", "audio"], "prediction": {"type": "content", "content": "x"},
        "reasoning_effort": "low", "web_search_options": {}, "verbosity": "low",
    },
}  # fmt: skip


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_every_field_not_implemented_is_refused_naming_it_and_neutral_or_ignored_ones_pass(client, kind):
    """Through the official client (extra_body sends what its signature lacks): a 400 whose param
    is the field, for each; the neutral values a client library may send, and the fields ignored on
    purpose (docs/api.md "OpenAI API parameters"), change nothing."""
    create = client.completions.create if kind == "completions" else client.chat.completions.create
    base = {"prompt": "The capital of France is"} if kind == "completions" else {"messages": CHAT}
    base |= {"model": MODEL, "max_tokens": 4, "temperature": 0}
    for name, value in NOT_IMPLEMENTED[kind].items():
        with pytest.raises(openai.BadRequestError) as refused:
            create(**base, extra_body={name: value})
        assert refused.value.body["param"] == name and name in refused.value.body["message"], (name, refused.value.body)
    plain = create(**base)
    neutral = {
        "n": 1,
        "presence_penalty": 0,
        "frequency_penalty": 0,
        "repetition_penalty": 1,
        "logit_bias": {},
        "user": "u-1",
        "metadata": {"run": "1"},
    }
    neutral |= {"echo": False, "best_of": 1} if kind == "completions" else {"logprobs": False, "tools": [], "parallel_tool_calls": True}
    neutral |= {"store": False, "service_tier": "auto", "prompt_cache_key": "k", "safety_identifier": "s"}
    same = create(**base, extra_body=neutral)
    text = (lambda r: r.choices[0].text) if kind == "completions" else (lambda r: r.choices[0].message.content)
    assert text(same) == text(plain)


def test_logit_bias_min_p_and_min_tokens_through_the_openai_client(client, engine, stub):
    """Against what each must do: a +100 bias makes its token greedy's every time; min_p 1 keeps
    only the likeliest token, so a hot temperature samples greedy's text; min_tokens holds off the
    end-of-sequence token greedy would stop at, and the text before it is unchanged."""
    token = engine.tokenizer.encode(" Paris", add_special=False)[0]
    base = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    biased = client.completions.create(**base, logit_bias={str(token): 100})
    assert biased.choices[0].text == engine.tokenizer.decode([token] * 4) and biased.usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(**base, logit_bias={"paris": 1})
    assert bad.value.body["param"] == "logit_bias"
    sampling = generate_pb2.SamplingParams(max_tokens=4, temperature=0.0, logit_bias={token: 100.0})
    over_grpc = list(stub[0].Generate(generate_pb2.GenerateRequest(text=base["prompt"], sampling=sampling), metadata=AUTH))
    assert "".join(r.chunk.text for r in over_grpc[:-1]) == biased.choices[0].text
    greedy = client.completions.create(**{**base, "max_tokens": 12}).choices[0].text
    hot = client.completions.create(**{**base, "max_tokens": 12, "temperature": 1.5, "seed": 3}, extra_body={"min_p": 1.0})
    assert hot.choices[0].text == greedy
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Say OK."}], "max_tokens": 40, "temperature": 0}
    short = client.chat.completions.create(**chat)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 20
    longer = client.chat.completions.create(**chat, extra_body={"min_tokens": 20})
    assert longer.usage.completion_tokens >= 20 and longer.choices[0].message.content.startswith(short.choices[0].message.content)
    # vLLM's detokenization options: the end-of-turn token's text, and the stop string kept
    special = client.chat.completions.create(**chat, extra_body={"skip_special_tokens": False})
    assert special.choices[0].message.content == short.choices[0].message.content + engine.tokenizer.decode(
        [engine.tokenizer.eos_id], False
    )
    stop = greedy[3:7]
    cut = client.completions.create(**{**base, "max_tokens": 12}, stop=[stop]).choices[0].text
    kept = client.completions.create(**{**base, "max_tokens": 12}, stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert cut == greedy[: greedy.index(stop)] and kept.choices[0].text == cut + stop


def _penalized_greedy(engine, prompt_ids: list[int], steps: int, presence=0.0, frequency=0.0, repetition=1.0) -> list[int]:
    """Greedy decoding with vLLM's penalties written out by hand over the model's raw logits."""
    out: list[int] = []
    for _ in range(steps):
        hidden, _ = dense_forward(engine.runner.model, prompt_ids + out)
        logits = engine.runner.model.logits(hidden[-1:]).float()[0]
        for token in set(prompt_ids) | set(out):
            if repetition != 1:
                logits[token] = logits[token] / repetition if logits[token] > 0 else logits[token] * repetition
            count = out.count(token)
            logits[token] -= frequency * count + (presence if count else 0.0)
        out.append(int(logits.argmax()))
    return out


def test_presence_frequency_and_repetition_penalties_through_the_openai_client(client, engine, stub):
    """Each penalty, greedy, over HTTP (completions and chat), gRPC and in process, equals greedy
    decoding with the penalty computed by hand from the model's logits, and changes what plain greedy writes."""
    tok = engine.tokenizer
    prompt = "one two one two one two one two"
    prompt_ids = tok.encode(prompt)
    plain = _penalized_greedy(engine, prompt_ids, 10)
    for penalty in ({"presence": 1.5}, {"frequency": 0.7}, {"repetition": 1.3}):
        expected = _penalized_greedy(engine, prompt_ids, 10, **penalty)
        assert expected != plain, penalty  # the test could fail: the penalty changes the text
        fields = {f"{name}_penalty": value for name, value in penalty.items()}
        got = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=10, temperature=0, logprobs=0, extra_body=fields | {"ignore_eos": True}
        )
        assert got.choices[0].logprobs.tokens == [tok.decode([t], skip_special=False) for t in expected], penalty
        sampling = generate_pb2.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, **fields)
        reply = list(stub[0].Generate(generate_pb2.GenerateRequest(text=prompt, sampling=sampling), metadata=AUTH))
        assert "".join(r.chunk.text for r in reply[:-1]) == tok.decode(expected), penalty
        (local,) = engine.generate([prompt_ids], SamplingParams(max_tokens=10, ignore_eos=True, **fields))
        assert local.token_ids == expected, penalty
    chat_ids = tok.encode(tok.render_chat(CHAT), add_special=False)
    expected = _penalized_greedy(engine, chat_ids, 6, frequency=1.0, presence=0.5)
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=6, temperature=0, frequency_penalty=1.0, presence_penalty=0.5
    )
    assert chat.choices[0].message.content == tok.decode(expected[: chat.usage.completion_tokens])


def _model_logprobs(engine, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """The in-process model's log-softmax at every position of `ids` (row p predicts token p + 1)."""
    hidden, _ = dense_forward(engine.runner.model, ids)
    return torch.log_softmax(engine.runner.model.logits(hidden).float() / temperature, dim=-1)


def test_logprobs_of_sampled_and_echoed_prompt_tokens_are_the_models_log_softmax(client, engine, stub):
    """Completions (echo: the prompt's tokens first, the first one null), chat, streamed, gRPC and
    vLLM's prompt_logprobs, each against the model's own log-softmax (after temperature for sampled
    tokens), within 1e-4; a scored prompt is computed whole, never taken from the prefix cache."""
    tok = engine.tokenizer
    prompt = "The capital of France is Paris. The capital of Germany is"
    prompt_ids = tok.encode(prompt)
    (greedy,) = engine.generate([prompt_ids], SamplingParams(max_tokens=5))
    ids = prompt_ids + greedy.token_ids
    expected = _model_logprobs(engine, ids)
    targets = [expected[p - 1, ids[p]].item() for p in range(1, len(ids))]
    for _ in range(2):  # the second time its blocks are cached, and not used
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=3, echo=True)
        choice = got.choices[0]
        assert choice.text == prompt + greedy.text and got.usage.prompt_tokens_details.cached_tokens == 0
        assert choice.logprobs.tokens == [tok.decode([t], skip_special=False) for t in ids]
        assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(targets, abs=1e-4)
        for p, top in enumerate(choice.logprobs.top_logprobs[1:], 1):
            values, best = expected[p - 1].topk(3)
            alternatives = {tok.decode([t], skip_special=False): v for t, v in zip(best.tolist(), values.tolist())}
            assert top == pytest.approx(alternatives | {choice.logprobs.tokens[p]: targets[p - 1]}, abs=1e-4)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=0)
    assert plain.choices[0].logprobs.token_logprobs == pytest.approx(targets[-5:], abs=1e-4)
    assert plain.choices[0].logprobs.tokens == [tok.decode([t], skip_special=False) for t in greedy.token_ids]
    vllm = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 0})
    scored = vllm.model_extra["choices"][0]["prompt_logprobs"] if vllm.model_extra.get("choices") else vllm.choices[0].prompt_logprobs
    assert scored[0] is None and len(scored) == len(prompt_ids)
    assert [entry[str(t)]["logprob"] for entry, t in zip(scored[1:], prompt_ids[1:])] == pytest.approx(
        targets[: len(prompt_ids) - 1], abs=1e-4
    )
    # a sampled token's logprob is of the distribution it was drawn from: after temperature
    hot = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0.7, seed=3, logprobs=1)
    hot_ids = tok.encode(hot.choices[0].text, add_special=False)
    if tok.decode(hot_ids) == hot.choices[0].text and len(hot_ids) == 4:  # the text re-tokenizes to the sampled tokens
        scaled = _model_logprobs(engine, prompt_ids + hot_ids, 0.7)
        drawn = [scaled[len(prompt_ids) - 1 + i, t].item() for i, t in enumerate(hot_ids)]
        assert hot.choices[0].logprobs.token_logprobs == pytest.approx(drawn, abs=1e-4)
    chat_ids = tok.encode(tok.render_chat(CHAT), add_special=False)
    (answer,) = engine.generate([chat_ids], SamplingParams(max_tokens=6))
    chat_expected = _model_logprobs(engine, chat_ids + answer.token_ids)[len(chat_ids) - 1 :]
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([chat_expected[i, t].item() for i, t in enumerate(answer.token_ids)], abs=1e-4)
    assert [[a.token for a in c.top_logprobs] for c in content] == [
        [tok.decode([t], skip_special=False) for t in chat_expected[i].topk(2).indices.tolist()] for i in range(len(content))
    ]
    streamed = []
    for chunk in client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-6)
    sampling = generate_pb2.SamplingParams(max_tokens=5, temperature=0.0, logprobs=2, prompt_logprobs=0)
    events = list(stub[0].Generate(generate_pb2.GenerateRequest(text=prompt, sampling=sampling), metadata=AUTH))
    over_grpc = [lp for e in events[:-1] for lp in e.chunk.prompt_logprobs.logprobs] + [
        lp for e in events[:-1] for lp in e.chunk.logprobs.logprobs
    ]
    assert over_grpc == pytest.approx(targets, abs=1e-4)


LM_EVAL_TASK = Path(__file__).parent / "data" / "lm_eval"  # pulseinfer_facts: 12 questions, 4 choices each, no download


def test_lm_evaluation_harness_scores_a_loglikelihood_task_as_pulseinfer_eval_does(cluster, model, monkeypatch):
    """lm-eval's local-completions (echo + logprobs at every prompt token, its remote tokenizer on
    /tokenize and /tokenizer_info) against the served pulse cluster gives each choice the
    loglikelihood `pulseinfer eval choice` computes in process, dense, and pulse scored by
    teacher-forced decode steps; and so the same accuracy."""
    import lm_eval  # a test dependency: imported here, since importing it takes seconds
    from lm_eval.tasks import TaskManager

    from pulseinfer.engine import EngineConfig
    from pulseinfer.evals import ChoiceConfig, evaluate

    monkeypatch.chdir(LM_EVAL_TASK)  # the task's data_files is relative
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    args = f"base_url={cluster.base_url}/v1/completions,model={MODEL},tokenizer_backend=remote,auth_token={API_KEY},batch_size=16"
    served = lm_eval.simple_evaluate(
        model="local-completions", model_args=args, tasks=["pulseinfer_facts"], task_manager=TaskManager(include_path=str(LM_EVAL_TASK)),
        log_samples=True,
    )  # fmt: skip
    samples = sorted(served["samples"]["pulseinfer_facts"], key=lambda s: s["doc_id"])
    served_lls = [[resp[0][0] for resp in sample["resps"]] for sample in samples]
    task = ChoiceConfig(file=LM_EVAL_TASK / "facts.jsonl")
    in_process = evaluate("choice", EngineConfig(worker=WorkerConfig(mode="dense")), task, loaded=model)
    assert served["results"]["pulseinfer_facts"]["acc,none"] == in_process["accuracy"] > 0.5
    assert [ll for lls in served_lls for ll in lls] == pytest.approx(
        [ll for c in in_process["cases"] for ll in c["loglikelihoods"]], abs=1e-3
    )
    # teacher-forced decode steps of the offloaded pulse path from position 3 on: these prompts fit the
    # device footprint of an offloaded request, so the sparse path attends everything and must agree
    decoding = BatcherConfig(score_prompt_with="decode", score_from=3)
    pulse = WorkerConfig(mode="pulse", offload=OffloadConfig(scorer="quest"))  # quest: no calibration pass to wait for
    decoded = evaluate(
        "choice", EngineConfig(worker=pulse, batcher=decoding, host_kv_tokens=8192), dataclasses.replace(task, limit=2), loaded=model
    )
    assert decoded["settings"]["score_prompt_with"] == "decode" and decoded["selection"]["decoded_rows"] > 0
    assert [ll for lls in served_lls[:2] for ll in lls] == pytest.approx(
        [ll for c in decoded["cases"] for ll in c["loglikelihoods"]], abs=1e-3
    )


def _prefix_hits(cluster) -> float:
    return sum(cluster.metric("prefix_cache_hits_total", worker=w) or 0 for w in ("0", "1"))


def test_n_choices_share_one_prefill_and_several_prompts_answer_in_order(client, cluster):
    """n=3 with a seed: three choices, the same again for the same request, streamed or not; the
    two copies reuse the first choice's prompt blocks (the prompt is computed once, and counted
    once in usage). A batch of prompts answers each as a request of its own would, in order."""
    prompt = "Once upon a time, in a land far away, there lived a " + "very " * 40
    base = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 1.0, "seed": 11, "extra_body": {"ignore_eos": True}}
    hits = _prefix_hits(cluster)
    three = client.completions.create(**base, n=3)
    full_blocks = (three.usage.prompt_tokens - 1) // 16 * 16
    assert _prefix_hits(cluster) - hits >= 2 * full_blocks > 0
    assert [c.index for c in three.choices] == [0, 1, 2] and len({c.text for c in three.choices}) > 1
    single = client.completions.create(**{**base, "max_tokens": 1})
    assert three.usage.prompt_tokens == single.usage.prompt_tokens and three.usage.completion_tokens == 3 * 8
    again = client.completions.create(**base, n=3)
    assert [c.text for c in again.choices] == [c.text for c in three.choices]
    streamed = {0: "", 1: "", 2: ""}
    for chunk in client.completions.create(**base, n=3, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert [streamed[i] for i in range(3)] == [c.text for c in three.choices]
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, n=2, temperature=1.0, seed=5)
    assert [c.index for c in chat.choices] == [0, 1] and all(c.message.content for c in chat.choices)
    prompts = ["The capital of France is", "1, 2, 3, 4,", "def add(a, b):"]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0).choices[0].text for p in prompts]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [c.text for c in batch.choices] == [text for text in alone for _ in range(2)]
    assert [c.index for c in batch.choices] == list(range(6))


def test_tokenize_detokenize_and_version(cluster, client, engine):
    """vLLM's shapes: the ids a completion's prompt (or a chat's messages) becomes, and back."""
    text = "The quick brown fox"
    status, got = cluster.request("/tokenize", {"model": MODEL, "prompt": text})
    assert status == 200 and got["tokens"] == engine.tokenizer.encode(text) and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == 8192
    status, back = cluster.request("/detokenize", {"tokens": got["tokens"]})
    assert status == 200 and back["prompt"] == engine.tokenizer.decode(got["tokens"])
    status, chat = cluster.request("/tokenize", {"messages": CHAT})
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
    assert status == 200 and chat["count"] == reply.usage.prompt_tokens
    bad = [
        ("/tokenize", {"prompt": text, "messages": CHAT}, "prompt"),
        ("/tokenize", {"prompt": text, "truncate": 4}, "truncate"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": "12"}, "tokens"),
    ]
    for path, body, param in bad:
        status, error = cluster.request(path, body)
        assert status == 400 and error["error"]["param"] == param, (body, error)
    assert cluster.request("/tokenize", {"prompt": text}, key=None)[0] == 401
    status, version = cluster.request("/version")
    assert status == 200 and version["version"] == "0.1.0"


@pytest.mark.parametrize(("path", "body", "status"), [b[1:] for b in BAD_REQUESTS], ids=[b[0] for b in BAD_REQUESTS])
def test_bad_input_gets_status_and_error_body(cluster, path, body, status):
    got_status, got = cluster.request(path, body)
    assert got_status == status, got
    assert isinstance(got, dict) and got["error"]["message"] and got["error"]["type"]


@pytest.mark.parametrize("key", [None, "wrong-key"], ids=["missing key", "wrong key"])
def test_api_key_is_required(cluster, key):
    status, body = cluster.request("/v1/completions", {"prompt": "hi", "max_tokens": 2}, key=key)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert cluster.request("/v1/models", key=key)[0] == 401
    assert cluster.request("/health", key=key)[0] == 200  # probes need no key


def test_api_key_is_on_no_command_line_and_only_in_the_gateways_environment(cluster):
    pids = {"launcher": cluster.process.pid, **cluster.children()}
    assert {"kv_store", "scheduler", "gpu_worker0", "gpu_worker1", "gateway"} <= set(pids)
    for name, pid in pids.items():
        assert API_KEY.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes(), name  # what `ps` shows every user
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")  # readable by the same user only
        assert (f"PULSEINFER_API_KEY={API_KEY}".encode() in environ) == (name in ("launcher", "gateway")), name


def test_server_keeps_serving_after_bad_inputs(cluster, client):
    for _, path, body, _ in BAD_REQUESTS:
        cluster.request(path, body)
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0).usage.completion_tokens >= 1
    assert cluster.metric("num_requests_running") == 0


def test_client_disconnect_aborts_its_request(cluster, client):
    stream = client.completions.create(
        model=MODEL, prompt="Write a long story:", max_tokens=2000, temperature=0, extra_body={"ignore_eos": True}, stream=True
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    cluster.wait_for(lambda: cluster.metric("num_requests_running") == 0, 30, "the abandoned request to be aborted")


def test_kill_9_of_a_worker_fails_its_stream_and_the_cluster_recovers(cluster, client):
    stream = client.completions.create(
        model=MODEL, prompt="Write a long story:", max_tokens=2000, temperature=0, extra_body={"ignore_eos": True}, stream=True
    )
    events = iter(stream)
    next(events)
    busy = cluster.wait_for(
        lambda: next((w for w in "01" if cluster.metric("worker_requests_running", worker=w)), None), 10, "a busy worker"
    )
    victim = cluster.children()[f"gpu_worker{busy}"]
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(openai.APIError) as error:
        for _ in events:
            pass
    assert "worker" in str(error.value)
    assert cluster.request("/health")[1]["workers_alive"] == 1  # the restarted worker is still loading its model
    # the other worker serves at once; the launcher brings the killed one back
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0).choices[0].text
    cluster.wait_for(lambda: cluster.children().get(f"gpu_worker{busy}") not in (None, victim), 30, "the worker restart")
    cluster.wait_for(lambda: cluster.request("/health")[1].get("workers_alive") == 2, 120, "two live workers")
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0).choices[0].text


SCHEMAS = json.loads((Path(__file__).parent / "data" / "json_schemas.json").read_text())


def _structured_chat(client, schema: dict, temperature: float, stream: bool, seed: int) -> tuple[str, str]:
    """The content and finish_reason of a chat constrained to `schema`, streamed or not."""
    request = dict(
        model=MODEL, messages=[{"role": "user", "content": f"Give an example of a {schema.get('title', 'value')} as JSON."}],
        max_tokens=200, temperature=temperature, seed=seed,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}},
    )  # fmt: skip
    if not stream:
        got = client.chat.completions.create(**request)
        return got.choices[0].message.content, got.choices[0].finish_reason
    chunks = [c for c in client.chat.completions.create(**request, stream=True) if c.choices]
    return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason


def test_every_json_schema_output_parses_and_validates_greedy_sampled_streamed_or_not(client):
    """55 schemas (nested objects, arrays, enums, required fields, bounded numbers, anyOf, $ref),
    each greedy and sampled, streamed and not: every output is complete JSON that validates against
    its schema. Sent 110 at a time (the workers batch their masks; on 2 cores a batch of 16 at a time
    takes 10x as long)."""
    jsonschema = pytest.importorskip("jsonschema")
    cases = [(i, temperature, stream) for stream in (False, True) for i in range(len(SCHEMAS)) for temperature in (0.0, 1.0)]
    with concurrent.futures.ThreadPoolExecutor(2 * len(SCHEMAS)) as pool:
        outputs = list(pool.map(lambda case: _structured_chat(client, SCHEMAS[case[0]], case[1], case[2], case[0]), cases))
    unfinished = [(case, content) for case, (content, reason) in zip(cases, outputs) if reason != "stop"]
    assert not unfinished, unfinished
    for (i, _, _), (content, _) in zip(cases, outputs):
        jsonschema.validate(json.loads(content), SCHEMAS[i])


def _constrained_text(client, chat: bool, prompt: str, constraint: dict, temperature: float, stream: bool) -> str:
    """A completion's or a chat's text under vLLM's structured_outputs `constraint`, streamed or not."""
    common = dict(model=MODEL, max_tokens=40, temperature=temperature, seed=2, stream=stream, extra_body={"structured_outputs": constraint})
    if chat:
        got = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **common)
        parts = [c.choices[0].delta.content or "" for c in got if c.choices] if stream else [got.choices[0].message.content]
    else:
        got = client.completions.create(prompt=prompt, **common)
        parts = [c.choices[0].text for c in got if c.choices] if stream else [got.choices[0].text]
    return "".join(parts)


def test_regex_choice_grammar_and_json_object_constrain_completions_and_chat(client, engine, stub):
    """vLLM's structured_outputs (regex and choice greedy and sampled, streamed and not; a Lark
    grammar, json_object) and OpenAI's json_object, over completions, chat, gRPC and in process; a
    bad constraint is a 400 before anything is queued."""
    date, choices = r"[0-9]{4}-[0-9]{2}-[0-9]{2}", ["yes", "no", "maybe so"]
    for temperature in (0.0, 0.8):
        for stream in (False, True):
            text = _constrained_text(client, False, "Today's date is", {"regex": date}, temperature, stream)
            assert re.fullmatch(date, text), (temperature, stream, text)
            assert _constrained_text(client, True, CHAT[0]["content"], {"choice": choices}, temperature, stream) in choices
    base = {"model": MODEL, "prompt": "Today's date is", "max_tokens": 40, "temperature": 0.8, "seed": 1}
    lark = 'start: expr\nexpr: NUMBER | expr "+" NUMBER\nNUMBER: /[1-9][0-9]?/'
    sums = client.completions.create(**base, extra_body={"structured_outputs": {"grammar": lark}})
    assert re.fullmatch(r"[1-9][0-9]?(\+[1-9][0-9]?)*", sums.choices[0].text), sums.choices[0].text
    any_object = {"type": "json_object"}
    anything = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=100, temperature=0, response_format=any_object)
    assert anything.choices[0].finish_reason == "stop" and isinstance(json.loads(anything.choices[0].message.content), dict)
    sampling = generate_pb2.SamplingParams(
        max_tokens=10, structured=generate_pb2.StructuredOutput(kind="choice", value=json.dumps(choices))
    )
    reply = list(stub[0].Generate(generate_pb2.GenerateRequest(text="Is it?", sampling=sampling), metadata=AUTH))
    assert "".join(r.chunk.text for r in reply[:-1]) in choices
    (local,) = engine.generate(
        [engine.tokenizer.encode("Is it?")], SamplingParams(max_tokens=10, structured=("choice", json.dumps(choices)))
    )
    assert local.text in choices
    for bad, param in (
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs"),
        ({"structured_outputs": {"json": {"type": "integer", "minimum": 5, "maximum": 1}}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, extra_body=bad)
        assert refused.value.body["param"] == param, (bad, refused.value.body)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
}


def test_a_forced_tool_choice_returns_calls_valid_against_the_functions_schema_streamed_alike(client):
    """tool_choice naming a function, and "required": the constrained output parses into tool_calls
    whose arguments validate against the function's parameters; streamed deltas reassemble to the
    same calls; the finish reason is tool_calls."""
    jsonschema = pytest.importorskip("jsonschema")
    messages = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for tool_choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        request = dict(model=MODEL, messages=messages, tools=[WEATHER, TIME], tool_choice=tool_choice, max_tokens=120, temperature=0)
        full = client.chat.completions.create(**request)
        choice = full.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), schemas[name])
        if isinstance(tool_choice, dict):
            assert [name for name, _ in calls] == ["get_weather"]
        streamed: dict[int, list] = {}
        reasons = []
        for chunk in client.chat.completions.create(**request, stream=True):
            if not chunk.choices:
                continue
            reasons.append(chunk.choices[0].finish_reason)
            for delta in chunk.choices[0].delta.tool_calls or []:
                entry = streamed.setdefault(delta.index, [None, ""])
                entry[0] = delta.function.name or entry[0]
                entry[1] += delta.function.arguments or ""
        assert [tuple(streamed[i]) for i in sorted(streamed)] == calls and reasons[-1] == "tool_calls"
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL, messages=messages, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}
        )
    assert refused.value.body["param"] == "tool_choice"


def test_reasoning_and_tool_calls_in_the_models_own_format_divide_whole_and_streamed(client):
    """With tools offered (tool_choice auto) the output is parsed in the served parser's format (qwen3:
    <think> reasoning, hermes <tool_call> JSON). A regex constraint makes SmolLM2 write that format:
    the reasoning goes to reasoning_content, the call to tool_calls with the finish reason tool_calls,
    and the streamed deltas add up to the same; without tools the call stays content."""
    written = r"<think>\nI should look it up\.\n</think>\n\n" + (
        r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Lyon)", "days": [1-7]\}\}\n</tool_call>'
    )
    messages = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
    request = dict(model=MODEL, messages=messages, max_tokens=80, temperature=0, extra_body={"structured_outputs": {"regex": written}})
    full = client.chat.completions.create(**request, tools=[WEATHER])
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "\nI should look it up.\n"
    ((call,),) = [choice.message.tool_calls]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Lyon")
    reasoning, calls, reasons = "", {}, []
    for chunk in client.chat.completions.create(**request, tools=[WEATHER], stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            assert not delta.content
            for part in delta.tool_calls or []:
                entry = calls.setdefault(part.index, ["", ""])
                entry[0] += part.function.name or ""
                entry[1] += part.function.arguments or ""
            reasons.append(chunk.choices[0].finish_reason)
    assert reasoning == "\nI should look it up.\n" and reasons[-1] == "tool_calls"
    assert calls == {0: [call.function.name, call.function.arguments]}
    plain = client.chat.completions.create(**request).choices[0]  # no tools offered: no call parsed
    assert plain.finish_reason == "stop" and plain.message.content.startswith("\n\n<tool_call>") and not plain.message.tool_calls
