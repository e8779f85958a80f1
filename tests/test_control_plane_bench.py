"""`pulseinfer bench control-plane`'s parts without a cluster: the simulated runner's accounting,
tokens and step time, and the bench's client, window and arithmetic on synthetic timelines."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from pulseinfer.bench import control_plane as cp
from pulseinfer.bench.stream_client import Timeline, parse_metrics, stream_all
from pulseinfer.common.model.meta import load_model_meta
from pulseinfer.gateway.http_api import _sse_line
from pulseinfer.gateway.metrics import GatewayMetrics
from pulseinfer.gateway.openai_responses import ResponseShape
from pulseinfer.gpu_worker.config import WorkerConfig
from pulseinfer.gpu_worker.simulated import SimulatedRunner, simulated_token
from pulseinfer.messages.plan import Chunk, SamplingSpec, StepPlan
from pulseinfer.proto.pulseinfer.v1 import generate_pb2

STEP_MS = 20.0
FOOTPRINT = (64 + 256 + 1024) // 16  # OffloadConfig's defaults: sink + recent + budget, in blocks


@pytest.fixture(scope="module")
def tokenizer():
    return load_model_meta(cp.MODEL, "dummy").tokenizer


def runner(tokenizer, mode: str = "pulse") -> SimulatedRunner:
    return SimulatedRunner(WorkerConfig(mode=mode, device_kv_tokens=4096), tokenizer, STEP_MS)  # 256 blocks of 16


def chunk(seq_id: str, tokens: int, table: tuple[int, ...], offloaded: bool = False, step: int = 0) -> Chunk:
    return Chunk(seq_id, (5,) * tokens, 0, table, SamplingSpec(0.0, 1.0, 0, seed=7, step=step), offloaded)


# ---------------------------------------------------------------- the simulated runner


def test_simulated_runner_reports_a_real_workers_footprint(tokenizer):
    assert runner(tokenizer).offload_blocks == FOOTPRINT and runner(tokenizer).cache_spec.num_blocks == 256
    assert runner(tokenizer, "dense").offload_blocks == 0  # a dense worker offloads nothing: the scheduler keeps all resident
    with pytest.raises(ValueError, match="--simulate-step-ms"):
        SimulatedRunner(WorkerConfig(), tokenizer, 0.0)


def test_simulated_runner_fails_chunks_whose_blocks_do_not_hold_them(tokenizer):
    fits = chunk("fits", 33, (0, 1, 2))
    short = chunk("short", 33, (3, 4))  # 32 tokens of blocks for 33
    outside = chunk("outside", 1, (256,))
    offloaded = chunk("offloaded", 4000, tuple(range(10, 10 + FOOTPRINT)), offloaded=True)
    wrong_footprint = chunk("wrong", 4000, tuple(range(100, 100 + FOOTPRINT - 1)), offloaded=True)
    outcome = runner(tokenizer).launch(StepPlan(1, (fits, short, outside, offloaded, wrong_footprint))).wait()
    assert set(outcome.failed) == {"short", "outside", "wrong"}
    assert "holds 32 tokens" in outcome.failed["short"] and "outside the device KV pool" in outcome.failed["outside"]
    assert f"holds {FOOTPRINT} device blocks" in outcome.failed["wrong"]
    assert {t.seq_id for t in outcome.tokens} == {"fits", "offloaded"}  # failed chunks sample nothing
    dense = runner(tokenizer, "dense").launch(StepPlan(2, (offloaded,))).wait()
    assert dense.failed == {"offloaded": "this worker has no host KV pool to offload to"} and not dense.tokens


def test_simulated_step_takes_the_step_time_and_an_empty_one_none(tokenizer):
    sim = runner(tokenizer)
    started = time.perf_counter()
    outcome = sim.launch(StepPlan(1, (chunk("a", 1, (0,)),))).wait()
    assert STEP_MS / 1e3 <= time.perf_counter() - started < STEP_MS / 1e3 + 0.05
    assert outcome.compute_s == STEP_MS / 1e3
    started = time.perf_counter()
    assert sim.launch(StepPlan(2, (), released=("a",))).wait().tokens == []
    assert sim.launch(StepPlan(3, (chunk("short", 17, (0,)),))).wait().failed  # all failed: no forward either
    assert time.perf_counter() - started < STEP_MS / 1e3


def test_simulated_tokens_are_deterministic_ordinary_words(tokenizer):
    words = runner(tokenizer).words
    special = set(tokenizer.backend.get_added_tokens_decoder()) | {tokenizer.eos_id}
    tokens = [simulated_token(words, SamplingSpec(0.0, 1.0, 0, seed, step)) for seed in range(50) for step in range(50)]
    assert tokens == [simulated_token(words, SamplingSpec(1.0, 0.9, 5, seed, step)) for seed in range(50) for step in range(50)]
    assert not special & set(tokens) and len(set(tokens)) == len(words)  # every word is drawn, never a special id
    assert all(tokenizer.decode([t]).strip() for t in set(tokens))  # each streams as text
    assert len(set(tokens[:50])) > 1  # a request's tokens vary with the step


# ---------------------------------------------------------------- the client


def sse(*events: str) -> list[bytes]:
    return [e.encode().removesuffix(b"\n\n") for e in events]


def gateway_events(tokens: int) -> tuple[str, ...]:
    """What the gateway streams for one completion, from its own formatting code."""
    from pulseinfer.gateway.core import Final

    shape = ResponseShape(chat=False, model="m", request_id="r")
    final = Final("length", 3, tokens, None, None, 0)
    texts = [_sse_line(shape.chunk(' "usage" error')) for _ in range(tokens - 1)]  # text that looks like keys stays text
    return (*texts, _sse_line(shape.chunk("", reason="length")), _sse_line(shape.usage_chunk([final], 1)), "data: [DONE]\n\n")


def test_timeline_reads_the_gateways_events():
    timeline = Timeline()
    kinds = [timeline.add(float(i), event) for i, event in enumerate(sse(*gateway_events(5)))]
    assert kinds == ["text"] * 4 + ["finish", None, None]
    assert timeline.events == [0.0, 1.0, 2.0, 3.0] and timeline.finished == 4.0 and timeline.completion_tokens == 5
    assert timeline.error is None
    failed = Timeline()
    failed.add(0.0, b'data: {"error": {"message": "the worker failed", "code": "worker_failed"}}')
    assert failed.error == "the worker failed"


def test_tpot_counts_tokens_from_usage_not_events():
    merged = Timeline(events=[1.0, 1.02, 1.04], finished=1.04, completion_tokens=5)  # 4 gaps of 10 ms in 2 events
    assert merged.tpot_s == pytest.approx(0.01)
    assert Timeline(events=[1.0], completion_tokens=1).tpot_s is None


def test_percentile_interpolates_between_ranks():
    assert cp.percentile([5.0, 1.0, 3.0, 2.0, 4.0], 50) == 3.0
    assert cp.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 99) == pytest.approx(4.96)
    assert cp.percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        cp.percentile([], 50)


def timeline(first: float, steps: int, step_s: float = 0.01) -> Timeline:
    events = [first + i * step_s for i in range(steps)]
    return Timeline(events=events, finished=events[-1], completion_tokens=steps)


def test_steady_window_is_from_the_last_first_token_to_the_first_finish():
    early, late = timeline(0.0, 100), timeline(0.3, 100)
    assert cp.steady_window([early, late]) == (0.3, pytest.approx(0.99))
    assert cp.steady_window([early, timeline(1.0, 10)]) is None  # the first finished before the last started


def test_client_stats_over_requests():
    slow = timeline(0.0, 11, step_s=0.02)
    stats = cp.client_stats([timeline(0.0, 11), timeline(0.0, 11), slow], step_ms=10.0)
    assert stats["tpot_p50_ms"] == pytest.approx(10.0) and stats["tpot_p99_ms"] == pytest.approx(19.8)
    assert stats["tpot_p99_over_step"] == pytest.approx(1.98) and stats["itl_p99_ms"] == pytest.approx(20.0)
    assert stats["client_tokens_per_s"] == pytest.approx(100 + 100 + 50) and stats["completion_tokens"] == 33


def scrape_of(busy: float, idle: float, steps: int, steady: int, steady_bytes: int, peak: int, cpu: float, tokens: int) -> dict:
    """/metrics as the gateway renders it, for two workers holding half of everything each."""
    metrics = GatewayMetrics()
    workers = [
        generate_pb2.WorkerStats(
            worker_id=i,
            busy_s=busy / 2,
            idle_s=idle / 2,
            steps=steps // 2,
            steady_steps=steady // 2,
            steady_plan_bytes=steady_bytes // 2,
            steady_plan_bytes_max=peak - i,
            offloaded=3,
        )
        for i in range(2)
    ]
    metrics.set_cluster(generate_pb2.SchedulerStats(workers_alive=2, workers=workers, cpu_s=cpu, overlap=True))
    metrics.generation_tokens.inc(tokens)
    return parse_metrics(metrics.render())


def test_window_stats_from_two_metrics_reads():
    before = scrape_of(busy=10, idle=1, steps=1000, steady=800, steady_bytes=800 * 100, peak=150, cpu=5, tokens=10_000)
    after = scrape_of(busy=11.9, idle=1.1, steps=1100, steady=900, steady_bytes=800 * 100 + 100 * 120, peak=160, cpu=5.2, tokens=16_400)
    assert after["pulseinfer:steady_decode_plan_bytes_max"] == 160 and after["pulseinfer:worker_requests_offloaded"] == 6
    stats = cp.window_stats((100.0, before), (101.0, after), step_ms=10.0)
    assert stats["busy"] == pytest.approx(1.9 / 2.0) and stats["busy_of_wall"] == pytest.approx(1.9 / 2)
    assert stats["steps_per_s"] == pytest.approx(100) and stats["ideal_steps_per_s"] == 200  # two workers
    assert stats["plan_bytes_per_step"] == pytest.approx(120) and stats["plan_bytes_max"] == 160
    assert stats["scheduler_cpu_ms_per_step"] == pytest.approx(2.0) and stats["gateway_tokens_per_s"] == pytest.approx(6400)
    assert stats["offloaded"] == 6 and stats["overlap_reported"]


def test_acceptance_checks_the_issues_numbers():
    row = {"overlap": "on", "batch": 256, "context": 32768, "busy": 0.97, "plan_bytes_max": 8256, "tpot_p99_ms": 12.4}
    assert all(c["passed"] for c in cp.acceptance([row], step_ms=10.0))
    failing = row | {"busy": 0.94, "plan_bytes_max": 8257, "tpot_p99_ms": 12.6}
    assert not any(c["passed"] for c in cp.acceptance([failing], step_ms=10.0))
    assert cp.acceptance([row | {"overlap": "off"}], step_ms=10.0) is None
    assert "| on | 256 | 32768 |" in cp.markdown([row])


def test_config_refuses_bad_lists_and_orders_points_by_batch():
    with pytest.raises(ValueError, match="--contexts"):
        cp.ControlPlaneBenchConfig(contexts="4k")
    with pytest.raises(ValueError, match="--overlap"):
        cp.ControlPlaneBenchConfig(overlap="on,auto")
    config = cp.ControlPlaneBenchConfig(batches="16,1", contexts="32768,4096")
    assert config.points == [(1, 4096), (1, 32768), (16, 4096), (16, 32768)]
    flags = config.serve_flags("off")
    assert flags[flags.index("--overlap") + 1] == "off" and flags[flags.index("--max-batch-size") + 1] == "16"


def test_requests_are_distinct_prompts_of_ordinary_ids(tokenizer):
    pool = cp.ordinary_ids(tokenizer, vocab_size=151936)
    assert pool.min() == 17 and pool.max() == 49151  # SmolLM2's 17 special tokens first
    first, second = cp.build_requests(pool, batch=2, context=300, output_tokens=8, seed=0)
    assert first.startswith(b"POST /v1/completions HTTP/1.1\r\n") and first != second
    assert first == cp.build_requests(pool, batch=2, context=300, output_tokens=8, seed=0)[0]
    body = first.partition(b"\r\n\r\n")[2]
    assert len(body) == int(first.split(b"Content-Length: ")[1].split(b"\r\n")[0])
    parsed = json.loads(body)
    prompt = parsed.pop("prompt")
    assert len(prompt) == 300 and set(prompt) <= set(pool.tolist())
    assert parsed == {"max_tokens": 8, "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


@pytest.mark.parametrize("chunked", [False, True])
def test_streams_and_window_reads_against_a_fake_gateway(chunked):
    """Two requests over real sockets, events split across reads (and across the chunks' framing):
    the window reads /metrics after the second request's first token and at the first finish."""
    scrapes = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        if head.startswith(b"GET /metrics"):
            scrapes.append(time.perf_counter())
            writer.write(b'HTTP/1.1 200 OK\r\n\r\npulseinfer:steps_total{worker="0"} %d\n' % len(scrapes))
        else:
            await reader.readexactly(int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0]))
            framing = b"Transfer-Encoding: chunked\r\n" if chunked else b""
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n" + framing + b"\r\n")
            body = [e.encode() for e in gateway_events(3)]
            if chunked:
                body = [b"%x\r\n%s\r\n" % (len(e), e) for e in body] + [b"0\r\n\r\n"]
            for event in body:
                for half in (event[:3], event[3:20], event[20:]):
                    writer.write(half)
                    await writer.drain()
                    await asyncio.sleep(0.005)
        writer.close()

    async def run():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            return await stream_all(port, [b"POST /v1/completions HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}"] * 2)

    timelines, start, end = asyncio.run(run())
    assert [len(t.events) for t in timelines] == [2, 2] and all(t.completion_tokens == 3 for t in timelines)
    assert start[1] == {"pulseinfer:steps_total": 1.0} and end[1] == {"pulseinfer:steps_total": 2.0}
    assert start[0] >= max(t.events[0] for t in timelines) and end[0] >= min(t.finished for t in timelines)


def test_a_point_runs_again_with_more_tokens_until_its_window_is_long_enough(monkeypatch):
    tried = []

    async def once(port, config, pool, batch, context, tokens):
        tried.append(tokens)
        return {"output_tokens": tokens} | ({"window_steps": tokens - 300} if tokens > 300 else {})  # a ramp of 300 steps

    monkeypatch.setattr(cp, "measure_once", once)
    config = cp.ControlPlaneBenchConfig(output_tokens=64)
    row = asyncio.run(cp.measure_point(0, config, None, 256, 32768, max_position=40960))
    assert tried == [64, 128, 256, 512] and row["window_steps"] == 212
    tried.clear()
    row = asyncio.run(cp.measure_point(0, config, None, 256, 40600, max_position=40960))
    assert tried == [64, 128, 256, 360] and row["window_steps"] == 60  # no more tokens than the context leaves


def test_a_tiny_run_through_the_real_cluster(tmp_path):
    """`pulseinfer bench control-plane` end to end, one small point: the simulated worker serves the
    real scheduler and gateway, and the window's numbers come from the real /metrics."""
    config = cp.ControlPlaneBenchConfig(batches="2", contexts="256", overlap="on", output_tokens=48, min_window_steps=0)
    assert cp.main(config, tmp_path / "cp.json", tmp_path / "cp.md") == 0
    result = json.loads((tmp_path / "cp.json").read_text())
    (row,) = result["rows"]
    assert row["completion_tokens"] == 2 * 48 and row["offloaded"] == 2 and row["overlap_reported"]  # --offload always
    assert row["window_steps"] > 10 and row["steps_per_s"] <= 1.05 * row["ideal_steps_per_s"]
    assert row["tpot_p50_ms"] >= 0.95 * config.simulate_step_ms and row["gateway_tokens_per_s"] > 0
    assert 0 < row["busy"] <= 1 and row["plan_bytes_max"] <= cp.plan_bytes_bound(2)
    assert result["command"].startswith("pulseinfer bench control-plane --simulate-step-ms 10.0 --batches 2")
    assert "| on | 2 | 256 | 48 |" in (tmp_path / "cp.md").read_text()
