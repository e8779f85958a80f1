"""Load generator over the HTTP API, in the style of sglang.bench_serving and `vllm bench serve`:
streamed completions with TTFT, TPOT, ITL and end-to-end latency (mean, p50, p99), request and
token throughput, goodput under SLOs and the prefix-cache hit rate the server reports. Two
sources of requests share the driver and the report:

random prompts (the default): lengths drawn from [input_len * range_ratio, input_len], cut from
real prose, Poisson arrivals at --request-rate, --output-len tokens each.

    pulseinfer bench serve [--base-url http://127.0.0.1:8000] [--api-key-file PATH] [--num-prompts 32] [--input-len 1024]
        [--range-ratio 0.5] [--output-len 64] [--request-rate 2] [--max-concurrency 8] [--json OUT]

a Mooncake-format trace (--trace FILE, JSONL of timestamp ms, input_length, output_length,
hash_ids: one id per 512-token block, equal ids = the same prefix block): arrivals at the
trace's timestamps divided by --time-scale, lengths from the trace times --length-scale, prompt
and output cut to fit the context the server reports (max_model_len in /v1/models; the prompt
loses its tail, so its shared prefix stays). Block i of a prompt is a function of its hash id
alone, round(512 * length_scale) tokens long, so requests share exactly the blocks whose ids they
share. A slice of the trace: --trace-start-s and --trace-duration-s (seconds of trace time from
its time 0), then the first --max-requests. Or --trace-conversations N: every request of the first
N conversations with more than one request that begin in that window (a conversation: the requests
whose prompts begin with the same two trace blocks), wherever in the trace their later turns come,
then the first --max-requests of them: the trace's reuse is mostly between turns minutes apart,
which a window small enough for one machine misses (compress their arrivals with --time-scale).
The random-mode flags are refused with --trace.

    pulseinfer bench serve --trace bench/traces/mooncake_conversation_trace.jsonl.gz [--max-requests 20]
        [--trace-start-s 0] [--trace-duration-s 60] [--time-scale 4] [--length-scale 0.25] [--json OUT]

Both modes: at most --max-concurrency requests in flight (latencies count from the send, not
the arrival); goodput = completed requests per second within --slo-ttft-ms and --slo-tpot-ms
(an unset SLO bounds nothing); prefix hit rate = usage.prompt_tokens_details.cached_tokens over
the prompt tokens (a server that does not report it counts as 0). A trace replay also reports
the trace's potential hit rate: the share of prompt blocks (and tokens) whose id an earlier
request of the slice had.

The API key, when the gateway requires one: the content of --api-key-file, else $PULSEINFER_API_KEY.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import http.client
import itertools
import json
import math
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from pulseinfer.bench.mooncake import BlockSource, TraceRow, load_trace, scaled_lengths, trace_block_size
from pulseinfer.common.api_key import resolve_api_key

RANDOM_ONLY = ("num_prompts", "input_len", "range_ratio", "output_len", "request_rate")
TRACE_ONLY = ("time_scale", "length_scale", "max_requests", "trace_start_s", "trace_duration_s", "trace_conversations")


@dataclass(frozen=True)
class ServeBenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    api_key_file: str | None = None  # its content is sent as a bearer token; default: $PULSEINFER_API_KEY
    model: str = ""  # default: the first model the server lists
    num_prompts: int = 32
    input_len: int = 1024  # longest prompt, in tokens
    range_ratio: float = 0.5  # prompt lengths drawn uniformly from [input_len * range_ratio, input_len]
    output_len: int = 64
    request_rate: float = 0.0  # Poisson arrivals per second; 0: every request at once
    max_concurrency: int = 8  # requests in flight at most
    seed: int = 0
    trace: str | None = None  # Mooncake-format JSONL: lengths, arrivals and shared prefixes come from it
    time_scale: float = 1.0  # trace arrivals run this many times faster
    length_scale: float = 1.0  # trace lengths (and its 512-token blocks) times this
    max_requests: int | None = None  # the first N requests of the trace's window; default: all
    trace_start_s: float = 0.0  # the window of trace time replayed, from the trace's time 0
    trace_duration_s: float | None = None  # default: to the end of the trace
    trace_conversations: int | None = None  # the requests of the first N multi-turn conversations beginning in the window
    slo_ttft_ms: float | None = None  # goodput counts requests within both SLOs; unset: no bound
    slo_tpot_ms: float | None = None

    def check(self) -> None:
        if self.max_concurrency < 1:
            raise ValueError("--max-concurrency must be >= 1")
        if any(slo is not None and slo <= 0 for slo in (self.slo_ttft_ms, self.slo_tpot_ms)):
            raise ValueError("--slo-ttft-ms and --slo-tpot-ms must be > 0")
        if misplaced := [_flag(name) for name in (RANDOM_ONLY if self.trace else TRACE_ONLY) if _is_set(self, name)]:
            why = "the trace gives lengths and arrivals" if self.trace else "they apply to --trace only"
            raise ValueError(f"{', '.join(misplaced)}: not with{'' if self.trace else 'out'} --trace ({why})")
        self._check_trace() if self.trace else self._check_random()

    def _check_random(self) -> None:
        if self.num_prompts < 1 or self.input_len < 1 or self.output_len < 2:
            raise ValueError("--num-prompts and --input-len must be >= 1 and --output-len >= 2")
        if not 0 < self.range_ratio <= 1 or self.request_rate < 0:
            raise ValueError("--range-ratio must be in (0, 1] and --request-rate >= 0")

    def _check_trace(self) -> None:
        if self.time_scale <= 0 or self.length_scale <= 0:
            raise ValueError("--time-scale and --length-scale must be > 0")
        if any(n is not None and n < 1 for n in (self.max_requests, self.trace_conversations)):
            raise ValueError("--max-requests and --trace-conversations must be >= 1")
        if self.trace_start_s < 0 or (self.trace_duration_s is not None and self.trace_duration_s <= 0):
            raise ValueError("--trace-start-s must be >= 0 and --trace-duration-s > 0")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _is_set(config: ServeBenchConfig, name: str) -> bool:
    """Whether a field differs from its default: the test for a flag given where it does not apply."""
    return getattr(config, name) != next(f.default for f in dataclasses.fields(config) if f.name == name)


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int]
    output_len: int
    arrival_s: float  # after the start of the run
    hash_ids: tuple[int, ...] = ()  # in a trace replay: the id of each block of the prompt


@dataclass
class RequestResult:
    prompt_tokens: int
    output_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the server's prefix cache served, as its usage reports
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = dataclasses.field(default_factory=list)  # gaps between streamed text chunks
    error: str = ""


def prose_corpus() -> list[int]:
    """Python's documentation in token ids of the default model's tokenizer."""
    import pydoc_data.topics

    from pulseinfer.common.model.meta import load_model_meta

    return load_model_meta().tokenizer.encode(" ".join(pydoc_data.topics.topics.values()), add_special=False)


def random_requests(config: ServeBenchConfig, corpus: list[int]) -> list[BenchRequest]:
    """Prompts cut at random offsets of the corpus; Poisson arrivals (all at 0 without a rate)."""
    rng = random.Random(config.seed)
    low = max(1, int(config.input_len * config.range_ratio))
    lengths = [rng.randint(low, config.input_len) for _ in range(config.num_prompts)]
    if max(lengths) >= len(corpus):
        raise ValueError(f"--input-len {config.input_len} is longer than the prompt corpus ({len(corpus)} tokens)")
    prompts = [corpus[(start := rng.randrange(len(corpus) - n)) : start + n] for n in lengths]
    arrivals = random.Random(config.seed + 1)
    gaps = [arrivals.expovariate(config.request_rate) if config.request_rate > 0 else 0.0 for _ in prompts[1:]]
    return [BenchRequest(p, config.output_len, t) for p, t in zip(prompts, itertools.accumulate(gaps, initial=0.0))]


def trace_requests(config: ServeBenchConfig, rows: list[TraceRow], corpus: list[int], max_context: int) -> tuple[list[BenchRequest], int]:
    """The replayed requests and how many were cut to fit the context."""
    source = BlockSource.of(corpus, trace_block_size(config.length_scale), config.seed)
    requests, cut = [], 0
    for row in rows:
        prompt_len, output_len, was_cut = scaled_lengths(row, config.length_scale, source.size, max_context)
        ids = row.hash_ids[: math.ceil(prompt_len / source.size)]
        prompt = [token for hash_id in ids for token in source.block(hash_id)][:prompt_len]
        arrival_s = (row.timestamp_ms - rows[0].timestamp_ms) / 1e3 / config.time_scale
        requests.append(BenchRequest(prompt, output_len, arrival_s, ids))
        cut += was_cut
    return requests, cut


def potential_hit_rate(requests: list[BenchRequest], block: int) -> tuple[float, float]:
    """Shares of prompt blocks and of prompt tokens whose hash id an earlier request had: what a
    prefix cache that forgets nothing could serve."""
    seen: set[int] = set()
    blocks = hit_blocks = tokens = hit_tokens = 0
    for request in requests:
        for i, hash_id in enumerate(request.hash_ids):
            size = min(block, len(request.prompt) - i * block)
            blocks, tokens = blocks + 1, tokens + size
            if hash_id in seen:
                hit_blocks, hit_tokens = hit_blocks + 1, hit_tokens + size
        seen.update(request.hash_ids)
    return hit_blocks / max(1, blocks), hit_tokens / max(1, tokens)


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}


def _request(config: ServeBenchConfig, headers: dict[str, str], model: str, request: BenchRequest) -> RequestResult:
    result = RequestResult(prompt_tokens=len(request.prompt))
    body = {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    parts = urlsplit(config.base_url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=3600)
    started = last = time.perf_counter()
    try:
        connection.request("POST", "/v1/completions", json.dumps(body), headers)
        response = connection.getresponse()
        if response.status != 200:
            result.error = f"HTTP {response.status}: {response.read().decode(errors='replace')[:200]}"
            return result
        for line in response:
            if not line.startswith(b"data: {"):
                continue
            now = time.perf_counter()
            event = json.loads(line[len(b"data: ") :])
            if "error" in event:
                result.error = str(event["error"])
                return result
            if usage := event.get("usage"):
                result.output_tokens = usage["completion_tokens"]
                result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            elif event["choices"] and event["choices"][0].get("text"):
                if result.ttft_s:
                    result.itl_s.append(now - last)
                else:
                    result.ttft_s = now - started
                last = now
        result.e2e_s = time.perf_counter() - started
    except OSError as e:
        result.error = f"{type(e).__name__}: {e}"
    finally:
        connection.close()
    return result


def _model_card(config: ServeBenchConfig, headers: dict[str, str]) -> dict:
    """The /v1/models entry of --model, or of the first model listed."""
    parts = urlsplit(config.base_url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=30)
    try:
        connection.request("GET", "/v1/models", headers=headers)
        cards = json.loads(connection.getresponse().read())["data"]
        listed = [card["id"] for card in cards]
    except (OSError, KeyError, TypeError, ValueError) as e:
        raise RuntimeError(f"cannot list the models of {config.base_url}: {e}") from e
    finally:
        connection.close()
    if not cards or (config.model and config.model not in listed):
        raise RuntimeError(f"{config.base_url} does not serve {config.model or 'any model'} (it lists {listed})")
    return cards[listed.index(config.model) if config.model else 0]


def _max_context(card: dict) -> int:
    if not isinstance(card.get("max_model_len"), int):
        raise RuntimeError(f"the server reports no max_model_len for {card['id']}: a trace replay needs it to fit prompts in the context")
    return card["max_model_len"]


async def _drive(config: ServeBenchConfig, headers: dict[str, str], model: str, requests: list[BenchRequest]) -> list[RequestResult]:
    loop = asyncio.get_running_loop()
    start = loop.time()
    # the pool's size is the cap on requests in flight (asyncio's default pool has min(32, cores + 4) threads)
    with concurrent.futures.ThreadPoolExecutor(config.max_concurrency) as pool:

        async def one(request: BenchRequest) -> RequestResult:
            await asyncio.sleep(start + request.arrival_s - loop.time())
            return await loop.run_in_executor(pool, _request, config, headers, model, request)

        return await asyncio.gather(*(one(r) for r in requests))


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean_ms": 0.0, "p50_ms": 0.0, "p99_ms": 0.0}
    ordered = sorted(values)
    return {
        "mean_ms": statistics.fmean(ordered) * 1e3,
        "p50_ms": statistics.median(ordered) * 1e3,
        "p99_ms": ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))] * 1e3,
    }


def _tpot_s(result: RequestResult) -> float:
    return (result.e2e_s - result.ttft_s) / (result.output_tokens - 1)


def meets_slos(config: ServeBenchConfig, result: RequestResult) -> bool:
    """Completed, and within the TTFT and TPOT SLOs that are set (vLLM's --goodput)."""
    if result.error:
        return False
    ttft_ok = config.slo_ttft_ms is None or result.ttft_s * 1e3 <= config.slo_ttft_ms
    tpot_ok = config.slo_tpot_ms is None or result.output_tokens < 2 or _tpot_s(result) * 1e3 <= config.slo_tpot_ms
    return ttft_ok and tpot_ok


def report(config: ServeBenchConfig, results: list[RequestResult], duration: float) -> dict:
    """The numbers of a run, shared by both modes (the settings and the trace's own numbers are added by run)."""
    done = [r for r in results if not r.error]
    good = sum(meets_slos(config, r) for r in results)
    prompt_tokens, cached_tokens = sum(r.prompt_tokens for r in done), sum(r.cached_tokens for r in done)
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "input_token_throughput": prompt_tokens / duration,
        "output_token_throughput": sum(r.output_tokens for r in done) / duration,
        "goodput": good / duration,  # requests per second within the SLOs
        "slo_attainment": good / len(results),  # of all requests sent, failed ones included
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "prefix_hit_rate": cached_tokens / max(1, prompt_tokens),
        "ttft": _summary([r.ttft_s for r in done]),
        "tpot": _summary([_tpot_s(r) for r in done if r.output_tokens > 1]),
        "itl": _summary([gap for r in done for gap in r.itl_s]),
        "e2e": _summary([r.e2e_s for r in done]),
    }


def _trace_plan(config: ServeBenchConfig, rows: list[TraceRow], corpus: list[int], max_context: int) -> tuple[list[BenchRequest], dict]:
    """The replayed requests and the trace's own numbers for the report."""
    requests, cut = trace_requests(config, rows, corpus, max_context)
    block = trace_block_size(config.length_scale)
    block_rate, token_rate = potential_hit_rate(requests, block)
    return requests, {
        "requests": len(requests),
        "max_model_len": max_context,
        "block_tokens": block,
        "cut_to_fit_context": cut,
        "trace_span_s": (rows[-1].timestamp_ms - rows[0].timestamp_ms) / 1e3,
        "replay_span_s": requests[-1].arrival_s,
        "potential_block_hit_rate": block_rate,
        "potential_token_hit_rate": token_rate,
    }


def trace_rows(config: ServeBenchConfig) -> list[TraceRow]:
    """The rows of the configured window of --trace (none without one)."""
    if not config.trace:
        return []
    return load_trace(
        config.trace,
        start_s=config.trace_start_s,
        duration_s=config.trace_duration_s,
        conversation_count=config.trace_conversations,
        max_requests=config.max_requests,
    )


def run(config: ServeBenchConfig) -> dict:
    config.check()
    rows = trace_rows(config)  # a bad file is refused before the server is asked
    headers = _headers(resolve_api_key(config.api_key_file))
    card = _model_card(config, headers)
    corpus = prose_corpus()
    requests, trace = _trace_plan(config, rows, corpus, _max_context(card)) if rows else (random_requests(config, corpus), None)
    started = time.perf_counter()
    results = asyncio.run(_drive(config, headers, card["id"], requests))
    duration = time.perf_counter() - started
    return {"settings": {**dataclasses.asdict(config), "model": card["id"]}, **report(config, results, duration), "trace": trace}


def main(config: ServeBenchConfig, json_path: Path | None) -> int:
    result = run(config)
    print(f"completed {result['completed']}, failed {result['failed']} in {result['duration_s']:.1f} s")
    print(f"request throughput {result['request_throughput']:.3f}/s, output tokens {result['output_token_throughput']:.1f}/s")
    slos = [f"{name} <= {bound:g} ms" for name, bound in (("TTFT", config.slo_ttft_ms), ("TPOT", config.slo_tpot_ms)) if bound is not None]
    print(f"goodput {result['goodput']:.3f}/s: {result['slo_attainment']:.1%} of requests completed within {', '.join(slos) or 'no SLO'}")
    print(f"prefix cache: {result['cached_tokens']} of {result['prompt_tokens']} prompt tokens cached ({result['prefix_hit_rate']:.1%})")
    if trace := result["trace"]:
        span = f"{trace['trace_span_s']:.1f} s of trace time replayed over {trace['replay_span_s']:.1f} s"
        print(f"trace: {trace['requests']} requests, {span}, {trace['cut_to_fit_context']} cut to fit {trace['max_model_len']} tokens")
        rates = f"{trace['potential_block_hit_rate']:.1%} of blocks, {trace['potential_token_hit_rate']:.1%} of tokens"
        print(f"trace: blocks of {trace['block_tokens']} tokens; potential prefix hit rate {rates}")
    for name in ("ttft", "tpot", "itl", "e2e"):
        s = result[name]
        print(f"{name.upper():5} mean {s['mean_ms']:9.1f} ms  p50 {s['p50_ms']:9.1f} ms  p99 {s['p99_ms']:9.1f} ms")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=1) + "\n")
    return 1 if result["failed"] else 0
