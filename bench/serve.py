"""Load generator over the HTTP API, in the style of sglang.bench_serving and `vllm bench serve`:
prompts of random length cut from real prose, Poisson arrivals, a cap on requests in flight,
streamed completions; TTFT, TPOT, ITL and end-to-end latency (mean, p50, p99), request and
token throughput.

    pulseinfer bench serve [--base-url http://127.0.0.1:8000] [--api-key-file PATH] [--num-prompts 32] [--input-len 1024]
        [--range-ratio 0.5] [--output-len 64] [--request-rate 2] [--max-concurrency 8] [--json OUT]

The API key, when the gateway requires one: the content of --api-key-file, else $PULSEINFER_API_KEY.
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from pulseinfer.common.api_key import resolve_api_key


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

    def check(self) -> None:
        if self.num_prompts < 1 or self.input_len < 1 or self.output_len < 2 or self.max_concurrency < 1:
            raise ValueError("--num-prompts, --input-len and --max-concurrency must be >= 1 and --output-len >= 2")
        if not 0 < self.range_ratio <= 1 or self.request_rate < 0:
            raise ValueError("--range-ratio must be in (0, 1] and --request-rate >= 0")


@dataclass
class RequestResult:
    prompt_tokens: int
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = dataclasses.field(default_factory=list)  # gaps between streamed text chunks
    error: str = ""


def sample_prompts(config: ServeBenchConfig) -> list[list[int]]:
    """Token ids of the default model's tokenizer, cut at random offsets from Python's documentation."""
    import pydoc_data.topics

    from pulseinfer.common.model.meta import load_model_meta

    ids = load_model_meta().tokenizer.encode(" ".join(pydoc_data.topics.topics.values()), add_special=False)
    rng = random.Random(config.seed)
    low = max(1, int(config.input_len * config.range_ratio))
    lengths = [rng.randint(low, config.input_len) for _ in range(config.num_prompts)]
    if max(lengths) >= len(ids):
        raise ValueError(f"--input-len {config.input_len} is longer than the prompt corpus ({len(ids)} tokens)")
    return [ids[(start := rng.randrange(len(ids) - n)) : start + n] for n in lengths]


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}


def _request(config: ServeBenchConfig, headers: dict[str, str], model: str, prompt: list[int]) -> RequestResult:
    result = RequestResult(prompt_tokens=len(prompt))
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": config.output_len,
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
            if event.get("usage"):
                result.output_tokens = event["usage"]["completion_tokens"]
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


def _served_model(config: ServeBenchConfig, headers: dict[str, str]) -> str:
    parts = urlsplit(config.base_url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=30)
    try:
        connection.request("GET", "/v1/models", headers=headers)
        return json.loads(connection.getresponse().read())["data"][0]["id"]
    except (OSError, KeyError, IndexError, ValueError) as e:
        raise RuntimeError(f"cannot list the models of {config.base_url}: {e}") from e
    finally:
        connection.close()


async def _drive(config: ServeBenchConfig, headers: dict[str, str], model: str, prompts: list[list[int]]) -> list[RequestResult]:
    rng = random.Random(config.seed + 1)
    gate = asyncio.Semaphore(config.max_concurrency)

    async def one(prompt: list[int]) -> RequestResult:
        async with gate:
            return await asyncio.to_thread(_request, config, headers, model, prompt)

    tasks = []
    for prompt in prompts:
        tasks.append(asyncio.create_task(one(prompt)))
        if config.request_rate > 0:
            await asyncio.sleep(rng.expovariate(config.request_rate))
    return await asyncio.gather(*tasks)


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean_ms": 0.0, "p50_ms": 0.0, "p99_ms": 0.0}
    ordered = sorted(values)
    return {
        "mean_ms": statistics.fmean(ordered) * 1e3,
        "p50_ms": statistics.median(ordered) * 1e3,
        "p99_ms": ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))] * 1e3,
    }


def run(config: ServeBenchConfig) -> dict:
    config.check()
    headers = _headers(resolve_api_key(config.api_key_file))
    model = config.model or _served_model(config, headers)
    prompts = sample_prompts(config)
    started = time.perf_counter()
    results = asyncio.run(_drive(config, headers, model, prompts))
    duration = time.perf_counter() - started
    done = [r for r in results if not r.error]
    return {
        "settings": {**dataclasses.asdict(config), "model": model},
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "input_token_throughput": sum(r.prompt_tokens for r in done) / duration,
        "output_token_throughput": sum(r.output_tokens for r in done) / duration,
        "ttft": _summary([r.ttft_s for r in done]),
        "tpot": _summary([(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]),
        "itl": _summary([gap for r in done for gap in r.itl_s]),
        "e2e": _summary([r.e2e_s for r in done]),
    }


def main(config: ServeBenchConfig, json_path: Path | None) -> int:
    result = run(config)
    print(f"completed {result['completed']}, failed {result['failed']} in {result['duration_s']:.1f} s")
    print(f"request throughput {result['request_throughput']:.3f}/s, output tokens {result['output_token_throughput']:.1f}/s")
    for name in ("ttft", "tpot", "itl", "e2e"):
        s = result[name]
        print(f"{name.upper():5} mean {s['mean_ms']:9.1f} ms  p50 {s['p50_ms']:9.1f} ms  p99 {s['p99_ms']:9.1f} ms")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=1) + "\n")
    return 1 if result["failed"] else 0
