"""Soak: a long mix of normal, hostile, poisoned and abandoned requests against a running server.

    pulseinfer bench soak [--base-url http://127.0.0.1:8000] [--api-key-file PATH] [--requests 240] [--concurrency 8] [--json OUT]

Each normal request is greedy and must return the text it returned alone before the soak; every
malformed one must get a 4xx with an OpenAI error body; a request with a tiny temperature must
finish; a client that hangs up must cost nothing. At the end the server must be idle again:
nothing running, no device KV block used but those the prefix cache names, no host KV block
used. Exits 1 on any violation (the CI suite runs the short version: tests/test_hostile_inputs.py, tests/test_offload_services.py).
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from pulseinfer.common.api_key import resolve_api_key

PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colors:", "Once upon a time"]
HOSTILE = [
    b'{"prompt": "a\\ud800b", "max_tokens": 2}',
    b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
    b'{"prompt": ' + b"[" * 60000 + b"]" * 60000 + b"}",
    b'{"prompt": "hi", "top_k": 4294967296}',
    b'{"prompt": "hi", "temperature": NaN}',
    b'{"prompt": [49152], "max_tokens": 2}',
    b'{"prompt": "hi", "stop": [""]}',
    b"\xff\xfe",
    b'{"prompt": "' + b"x" * (3 << 20) + b'"}',
]


@dataclass(frozen=True)
class SoakConfig:
    base_url: str = "http://127.0.0.1:8000"
    api_key_file: str | None = None  # default: $PULSEINFER_API_KEY
    requests: int = 240
    concurrency: int = 8
    max_tokens: int = 16
    seed: int = 0


class Soak:
    def __init__(self, config: SoakConfig):
        self.config = config
        self.url = urlsplit(config.base_url)
        key = resolve_api_key(config.api_key_file)
        self.headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})

    def post(self, body: bytes, timeout: float = 120) -> tuple[int, dict]:
        connection = http.client.HTTPConnection(self.url.hostname, self.url.port, timeout=timeout)
        try:
            connection.request("POST", "/v1/completions", body, self.headers)
            response = connection.getresponse()
            raw = response.read()
            try:
                return response.status, json.loads(raw)
            except ValueError:
                return response.status, {"raw": raw[:200].decode(errors="replace")}
        finally:
            connection.close()

    def normal(self, prompt: str, **extra) -> tuple[int, dict]:
        return self.post(json.dumps({"prompt": prompt, "max_tokens": self.config.max_tokens, "temperature": 0, **extra}).encode())

    def abandon(self, prompt: str) -> None:
        """Sends a request and hangs up before its answer."""
        try:
            self.post(json.dumps({"prompt": prompt, "max_tokens": 200, "temperature": 0}).encode(), timeout=0.3)
        except TimeoutError:
            pass

    def one(self, kind: str, index: int, expected: dict[str, str]) -> str | None:
        """Runs request `index` of `kind`; returns what went wrong, or None."""
        prompt = PROMPTS[index % len(PROMPTS)]
        if kind == "normal":
            status, body = self.normal(prompt)
            text = body.get("choices", [{}])[0].get("text")
            return None if status == 200 and text == expected[prompt] else f"normal: {status} {text!r} != {expected[prompt]!r}"
        if kind == "poisoned":
            status, body = self.normal(prompt, temperature=1e-40)
            return None if status == 200 else f"poisoned: {status} {body}"
        if kind == "abandoned":
            self.abandon(prompt)
            return None
        payload = HOSTILE[index % len(HOSTILE)]
        status, body = self.post(payload)
        error = body.get("error") if isinstance(body, dict) else None
        return None if 400 <= status < 500 and error and error.get("message") else f"hostile #{index % len(HOSTILE)}: {status} {body}"

    def metric(self, name: str) -> float:
        connection = http.client.HTTPConnection(self.url.hostname, self.url.port, timeout=30)
        try:
            connection.request("GET", "/metrics")
            text = connection.getresponse().read().decode()
        finally:
            connection.close()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"pulseinfer:{name}"))

    def idle(self, timeout_s: float = 60) -> dict[str, float]:
        """What is still held (all 0 when idle): running requests, device and host blocks beyond the prefix cache's."""
        deadline = time.monotonic() + timeout_s
        while True:
            values = {
                "num_requests_running": self.metric("num_requests_running"),
                "device_kv_blocks_held_by_requests": self.metric("worker_device_kv_blocks_used")
                - self.metric("prefix_cache_device_blocks"),
                "host_kv_blocks_held_by_requests": self.metric("host_kv_blocks_used") - self.metric("prefix_cache_host_blocks"),
            }
            if not any(values.values()) or time.monotonic() > deadline:
                return values
            time.sleep(0.5)


def main(config: SoakConfig, json_path: str | None = None) -> int:
    soak = Soak(config)
    expected = {p: soak.normal(p)[1]["choices"][0]["text"] for p in PROMPTS}  # each alone, before the soak
    rng = random.Random(config.seed)
    kinds = [rng.choice(["normal"] * 5 + ["hostile"] * 3 + ["poisoned", "abandoned"]) for _ in range(config.requests)]
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(config.concurrency) as pool:
        problems = [p for p in pool.map(lambda job: soak.one(job[1], job[0], expected), enumerate(kinds)) if p]
    report = {
        "requests": config.requests,
        "by_kind": {kind: kinds.count(kind) for kind in sorted(set(kinds))},
        "duration_s": round(time.monotonic() - started, 1),
        "problems": problems,
        "idle_after": soak.idle(),
    }
    print(json.dumps(report, indent=1))
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1) + "\n")
    return 1 if problems or any(report["idle_after"].values()) else 0
