"""`pulseinfer bench serve --trace`: the Mooncake trace's slice, lengths, prompt blocks and arrivals,
and the report's goodput and hit rates, without a PulseInfer server (a stub answers the HTTP API)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pulseinfer.bench import serve
from pulseinfer.bench.mooncake import BlockSource, TraceRow, load_trace, scaled_lengths, trace_block_size
from pulseinfer.bench.serve import RequestResult, ServeBenchConfig

CORPUS = list(range(100, 5100))  # distinct tokens: two blocks are equal only where the same offset was cut


def write_trace(path: Path, rows: list[tuple[int, int, int, list[int]]]) -> str:
    keys = ("timestamp", "input_length", "output_length", "hash_ids")
    path.write_text("".join(json.dumps(dict(zip(keys, row))) + "\n" for row in rows))
    return str(path)


def plan(tmp_path: Path, rows, max_context: int = 100_000, **settings) -> list[serve.BenchRequest]:
    config = ServeBenchConfig(trace=write_trace(tmp_path / "trace.jsonl", rows), **settings)
    config.check()
    rows = serve.trace_rows(config)
    return serve.trace_requests(config, rows, CORPUS, max_context)[0]


SIX = [(1000 * i, 600, 8, [2 * i, 2 * i + 1]) for i in range(6)]  # one arrival a second of trace time


def test_the_slice_is_the_first_max_requests_of_the_time_window(tmp_path):
    assert [r.arrival_s for r in plan(tmp_path, SIX, max_requests=3)] == [0.0, 1.0, 2.0]
    window = plan(tmp_path, SIX, trace_start_s=1.5, trace_duration_s=2.0)  # trace time [1.5, 3.5) s: the requests at 2 and 3 s
    assert [r.hash_ids[0] for r in window] == [4, 6] and [r.arrival_s for r in window] == [0.0, 1.0]
    assert len(plan(tmp_path, SIX, trace_start_s=1.5, max_requests=1)) == 1


def test_a_conversation_slice_takes_every_turn_of_the_first_multi_turn_conversations_in_the_window(tmp_path):
    rows = [
        (0, 600, 8, [0, 1]),  # conversation (0, 1): one request only, skipped
        (1000, 600, 8, [0, 2]),  # (0, 2), begins in the window
        (2000, 1100, 8, [0, 3, 4]),  # (0, 3), begins in the window
        (3000, 1100, 8, [0, 2, 5]),  # (0, 2)'s second turn
        (9000, 1600, 8, [0, 3, 4, 6]),  # (0, 3)'s second turn, after the window
        (9500, 1100, 8, [0, 7, 8]),  # (0, 7): begins after the window
        (9600, 1600, 8, [0, 7, 8, 9]),
    ]
    got = plan(tmp_path, rows, trace_start_s=0.5, trace_duration_s=3.0, trace_conversations=5)
    assert [r.hash_ids for r in got] == [(0, 2), (0, 3, 4), (0, 2, 5), (0, 3, 4, 6)]
    assert [r.arrival_s for r in got] == [0.0, 1.0, 2.0, 8.0]
    assert [r.hash_ids for r in plan(tmp_path, rows, trace_start_s=0.5, trace_duration_s=3.0, trace_conversations=1)] == [(0, 2), (0, 2, 5)]
    assert len(plan(tmp_path, rows, trace_start_s=0.5, trace_conversations=5, max_requests=3)) == 3


def test_arrivals_are_divided_by_the_time_scale(tmp_path):
    assert [r.arrival_s for r in plan(tmp_path, SIX, time_scale=4.0)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.25]


def test_lengths_scale_by_block_and_are_cut_to_fit_the_context():
    row = TraceRow(0, 1100, 300, (1, 2, 3))  # two full blocks and 76 tokens
    assert scaled_lengths(row, 0.5, 256, 10_000) == (2 * 256 + 38, 150, False)
    assert scaled_lengths(row, 0.5, 256, 600) == (450, 150, True)  # the prompt loses its tail, the output stays
    assert scaled_lengths(TraceRow(0, 10, 1, (1,)), 0.01, 5, 100) == (1, 2, False)  # >= 1 prompt token, >= 2 outputs for TPOT
    assert scaled_lengths(TraceRow(0, 10, 2000, (1,)), 1.0, 512, 1000) == (1, 999, True)
    assert trace_block_size(0.25) == 128 and trace_block_size(0.0001) == 1


def test_a_cut_prompt_keeps_only_the_ids_of_its_remaining_blocks(tmp_path):
    (request,) = plan(tmp_path, [(0, 1536, 100, [7, 8, 9])], max_context=250, length_scale=0.25)
    assert (len(request.prompt), request.output_len, request.hash_ids) == (225, 25, (7, 8))


def test_equal_hash_ids_give_equal_blocks_and_different_ids_different_ones():
    source = BlockSource.of(CORPUS, 64, seed=0)
    assert source.block(7) == BlockSource.of(CORPUS, 64, seed=0).block(7) and len(source.block(7)) == 64
    assert source.block(7) != source.block(8) and source.block(7) != BlockSource.of(CORPUS, 64, seed=1).block(7)
    tiny = BlockSource.of(list(range(10)), 2, seed=0)  # 9 offsets for 100 ids: only the id's tag tells them apart
    assert len({tuple(tiny.block(i)) for i in range(100)}) == 100


def test_requests_share_exactly_the_blocks_whose_ids_they_share(tmp_path):
    first, second, third = plan(tmp_path, [(0, 1536, 8, [1, 2, 3]), (0, 1300, 8, [1, 2, 4]), (0, 100, 8, [5])], length_scale=0.125)
    assert (len(first.prompt), len(second.prompt), len(third.prompt)) == (192, 128 + 34, 12)  # 276 * 0.125 = 34.5 rounds to 34
    shared = next(i for i, (a, b) in enumerate(zip(first.prompt, second.prompt)) if a != b)
    assert shared == 128  # two blocks of 64 tokens, and not one token more
    assert first.prompt[0] != third.prompt[0]
    block_rate, token_rate = serve.potential_hit_rate([first, second, third], 64)
    assert block_rate == pytest.approx(2 / 7) and token_rate == pytest.approx(128 / (192 + 162 + 12))


def result(ttft_s: float, tpot_s: float, prompt: int = 100, cached: int = 0, error: str = "") -> RequestResult:
    return RequestResult(prompt, output_tokens=5, cached_tokens=cached, ttft_s=ttft_s, e2e_s=ttft_s + 4 * tpot_s, error=error)


def test_goodput_counts_requests_within_both_slos_and_the_hit_rate_is_cached_over_prompt_tokens():
    results = [
        result(0.1, 0.1, cached=50),
        result(0.5, 0.1),  # TTFT over 200 ms
        result(0.1, 0.3, prompt=200, cached=100),  # TPOT over 200 ms
        result(0.1, 0.1, cached=999, error="HTTP 500"),  # failed: in no SLO and no token count
    ]
    strict = serve.report(ServeBenchConfig(slo_ttft_ms=200, slo_tpot_ms=200), results, duration=2.0)
    assert (strict["goodput"], strict["slo_attainment"], strict["completed"], strict["failed"]) == (0.5, 0.25, 3, 1)
    assert (strict["prompt_tokens"], strict["cached_tokens"], strict["prefix_hit_rate"]) == (400, 150, 0.375)
    assert serve.report(ServeBenchConfig(slo_ttft_ms=200), results, 2.0)["slo_attainment"] == 0.5
    unbounded = serve.report(ServeBenchConfig(), results, 2.0)
    assert unbounded["goodput"] == unbounded["request_throughput"] == 1.5


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"trace": "t.jsonl", "time_scale": 0.0}, "--time-scale and --length-scale must be > 0"),
        ({"trace": "t.jsonl", "length_scale": -1.0}, "--time-scale and --length-scale must be > 0"),
        ({"trace": "t.jsonl", "max_requests": 0}, "--max-requests and --trace-conversations must be >= 1"),
        ({"trace": "t.jsonl", "trace_conversations": 0}, "--max-requests and --trace-conversations must be >= 1"),
        ({"trace_conversations": 3}, "--trace-conversations: not without --trace"),
        ({"trace": "t.jsonl", "trace_duration_s": 0.0}, "--trace-duration-s > 0"),
        ({"trace": "t.jsonl", "num_prompts": 5, "request_rate": 1.0}, "--num-prompts, --request-rate: not with --trace"),
        ({"time_scale": 2.0}, "--time-scale: not without --trace"),
        ({"slo_tpot_ms": 0.0}, "must be > 0"),
    ],
)
def test_bad_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        ServeBenchConfig(**settings).check()


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\nnot json\n', r"trace.jsonl:2: not a trace record"),
        ('{"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1]}\n', r"trace.jsonl:1: .* one hash id per 512"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 2}\n', r"trace.jsonl:1: not a trace record \(KeyError"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 0, "hash_ids": [1]}\n', r"trace.jsonl:1: .* integers >= 1"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": ["a"]}\n', r"trace.jsonl:1: .* hash_ids integers"),
    ],
)
def test_malformed_lines_are_refused_with_their_line_number(tmp_path, lines, message):
    (tmp_path / "trace.jsonl").write_text(lines)
    with pytest.raises(ValueError, match=message):
        load_trace(str(tmp_path / "trace.jsonl"))


def test_a_missing_file_an_empty_window_and_a_block_longer_than_the_corpus_are_refused(tmp_path):
    with pytest.raises(ValueError, match="cannot read --trace .*nope.jsonl: No such file"):
        load_trace(str(tmp_path / "nope.jsonl"))
    with pytest.raises(ValueError, match="no request of .* arrives in the window"):
        plan(tmp_path, SIX, trace_start_s=60.0)
    with pytest.raises(ValueError, match="longer than the prompt corpus"):
        plan(tmp_path, SIX, length_scale=20.0)


class StubServer(BaseHTTPRequestHandler):
    """/v1/models with a context of 300 tokens; completions stream two chunks and a usage chunk
    that reports half the prompt as cached."""

    bodies: list[dict] = []

    def do_GET(self):
        self._send("application/json", json.dumps({"data": [{"id": "stub", "max_model_len": 300}]}).encode())

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        n = len(body["prompt"])
        usage = {"prompt_tokens": n, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": n // 2}}
        events = [{"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]}, {"choices": [], "usage": usage}]
        self._send("text/event-stream", b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n")

    def _send(self, kind: str, data: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


def test_a_replay_sends_the_planned_requests_and_reads_cached_tokens_from_the_usage_chunk(tmp_path, monkeypatch):
    monkeypatch.setattr(serve, "prose_corpus", lambda: CORPUS)
    server = ThreadingHTTPServer(("127.0.0.1", 0), StubServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    trace = write_trace(tmp_path / "trace.jsonl", [(0, 1024, 40, [1, 2]), (100, 2000, 40, [1, 2, 3, 4])])
    config = ServeBenchConfig(base_url=f"http://127.0.0.1:{server.server_address[1]}", trace=trace, length_scale=0.25, time_scale=10.0)
    try:
        got = serve.run(config)
    finally:
        server.shutdown()
    assert [len(b["prompt"]) for b in StubServer.bodies] == [256, 300 - 10] and [b["max_tokens"] for b in StubServer.bodies] == [10, 10]
    assert got["completed"] == 2 and got["settings"]["model"] == "stub" and got["cached_tokens"] == 128 + 145
    assert got["trace"]["cut_to_fit_context"] == 1 and got["trace"]["max_model_len"] == 300 and got["trace"]["replay_span_s"] == 0.01
    assert got["trace"]["potential_block_hit_rate"] == pytest.approx(2 / 5)  # the second request's first two blocks; its 4th was cut
