"""What the process split costs, side by side in one run:

1. scheduler <-> worker transport: a real StepPlan (protobuf, ZMQ ipc://) to a second process
   that answers with a StepResult without running the model; round trip in microseconds;
2. the same hop inside `pulseinfer serve`: step round trip minus the worker's forward time;
3. TTFT and TPOT of the HTTP path (gateway -> scheduler -> worker, streaming) against the
   in-process engine on the same prompts, one request at a time.

Parts 2 and 3 start a `pulseinfer serve --workers 1` of their own on free ports (no API key) and
stop it at the end.

    pulseinfer bench serving-overhead [--requests 8] [--prompt-tokens 256] [--output-tokens 32] [--json OUT]
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import multiprocessing
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import zmq

from pulseinfer.bench.cluster import ServingCluster
from pulseinfer.proto.pulseinfer.v1 import worker_pb2

MODEL = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class ServingOverheadBenchConfig:
    requests: int = 8
    prompt_tokens: int = 256
    output_tokens: int = 32


# ---------------------------------------------------------------- 1. transport


def _echo_worker(address: str, rounds: int) -> None:
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.connect(address)
    socket.send(b"ready")
    for _ in range(rounds):
        plan = worker_pb2.SchedulerMessage.FromString(socket.recv()).plan
        result = worker_pb2.StepResult(step_id=plan.step_id, handles=plan.decode, token_ids=[1] * len(plan.decode))
        socket.send(worker_pb2.WorkerMessage(result=result).SerializeToString())
    socket.close()
    context.term()


def _plan(batch: int, context_tokens: int, block_size: int = 16) -> worker_pb2.SchedulerMessage:
    """A steady decode step (docs/architecture.md): a handle per row, plus the new block of the rows that cross one."""
    crossing = [h for h in range(batch) if (context_tokens + h) % block_size == 0]
    plan = worker_pb2.StepPlan(step_id=1, decode=range(batch), grant_handles=crossing, grant_blocks=crossing)
    return worker_pb2.SchedulerMessage(plan=plan)


def transport_round_trip(batch: int, context_tokens: int, rounds: int = 2000) -> dict:
    address = f"ipc:///tmp/pulseinfer-bench-{time.monotonic_ns()}"
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.bind(address)
    worker = multiprocessing.get_context("spawn").Process(target=_echo_worker, args=(address, rounds))
    worker.start()
    identity, _ = router.recv_multipart()
    message = _plan(batch, context_tokens)
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        router.send_multipart([identity, message.SerializeToString()])  # serialize each step, as the scheduler does
        _, reply = router.recv_multipart()
        worker_pb2.WorkerMessage.FromString(reply)
        times.append(time.perf_counter() - started)
    worker.join()
    router.close()
    context.term()
    return {"batch": batch, "context_tokens": context_tokens, "plan_bytes": message.ByteSize(), **_us(times[rounds // 10 :])}


def _us(samples: list[float]) -> dict:
    ordered = sorted(samples)
    return {
        "p50_us": ordered[len(ordered) // 2] * 1e6,
        "p99_us": ordered[int(len(ordered) * 0.99)] * 1e6,
        "mean_us": statistics.fmean(ordered) * 1e6,
    }


# ---------------------------------------------------------------- 3. latency, in-process vs HTTP


def prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    import pydoc_data.topics

    ids = tokenizer.encode(" ".join(pydoc_data.topics.topics.values()), add_special=False)
    return [ids[i * length : (i + 1) * length] for i in range(count)]


def in_process(prompt_sets: list[list[int]], output_tokens: int) -> list[tuple[float, float]]:
    from pulseinfer.engine import Engine, EngineConfig
    from pulseinfer.messages.sampling import SamplingParams

    engine = Engine(EngineConfig())
    params = SamplingParams(max_tokens=output_tokens, ignore_eos=True)
    engine.generate([prompt_sets[0]], params)  # warm-up
    out = []
    for prompt in prompt_sets:
        started = time.perf_counter()
        seq_id = engine.submit(prompt, params)
        seq = engine._seqs[seq_id]
        first = None
        while engine.batcher.has_work():
            engine.step()
            first = first or (time.perf_counter() if seq.output_ids else None)
        out.append(_ttft_tpot(started, first, time.perf_counter(), output_tokens))
    return out


def over_http(cluster: ServingCluster, prompt_sets: list[list[int]], output_tokens: int) -> list[tuple[float, float]]:
    _stream(cluster, prompt_sets[0], output_tokens)  # warm-up
    return [_stream(cluster, prompt, output_tokens) for prompt in prompt_sets]


def _stream(cluster: ServingCluster, prompt: list[int], output_tokens: int) -> tuple[float, float]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": output_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    connection = http.client.HTTPConnection("127.0.0.1", cluster.http_port, timeout=300)
    started = time.perf_counter()
    connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    first = None
    for line in response:
        if line.startswith(b"data: {") and first is None:
            first = time.perf_counter()
    ended = time.perf_counter()
    connection.close()
    return _ttft_tpot(started, first, ended, output_tokens)


def _ttft_tpot(started: float, first: float, ended: float, output_tokens: int) -> tuple[float, float]:
    return first - started, (ended - first) / (output_tokens - 1)


def _median(pairs: list[tuple[float, float]]) -> dict:
    return {"ttft_ms": statistics.median(p[0] for p in pairs) * 1e3, "tpot_ms": statistics.median(p[1] for p in pairs) * 1e3}


def main(args: ServingOverheadBenchConfig, json_path: Path | None = None) -> int:
    transport = [transport_round_trip(b, c) for b, c in ((1, 512), (16, 4096), (64, 4096))]
    for t in transport:
        print(
            f"transport  batch {t['batch']:3d} ctx {t['context_tokens']:5d} plan {t['plan_bytes']:7d} B"
            f"  p50 {t['p50_us']:7.1f} us  p99 {t['p99_us']:7.1f} us"
        )

    from pulseinfer.common.model.meta import load_model_meta

    prompt_sets = prompts(load_model_meta().tokenizer, args.requests, args.prompt_tokens)
    engine = _median(in_process(prompt_sets, args.output_tokens))
    cluster = ServingCluster("--workers", "1")
    try:
        http_path = _median(over_http(cluster, prompt_sets, args.output_tokens))
        steps = cluster.metric("steps_total", worker="0")
        overhead = cluster.metric("step_overhead_seconds_total", worker="0")
    finally:
        cluster.stop()
    in_cluster_us = overhead / steps * 1e6
    print(f"in cluster: step round trip minus forward, mean over {steps:.0f} steps: {in_cluster_us:.0f} us")
    print(f"{'':12s} {'TTFT ms':>9s} {'TPOT ms':>9s}")
    print(f"{'in-process':12s} {engine['ttft_ms']:9.1f} {engine['tpot_ms']:9.1f}")
    print(f"{'HTTP path':12s} {http_path['ttft_ms']:9.1f} {http_path['tpot_ms']:9.1f}")
    ratios = {k: http_path[k] / engine[k] for k in engine}
    print(f"{'HTTP/engine':12s} {ratios['ttft_ms']:9.3f} {ratios['tpot_ms']:9.3f}")
    result = {
        "settings": dataclasses.asdict(args) | {"json": str(json_path) if json_path else None},
        "transport": transport,
        "in_cluster_step_overhead_us": in_cluster_us,
        "in_process": engine,
        "http": http_path,
        "http_over_in_process": ratios,
        "added_ms": {k: http_path[k] - engine[k] for k in engine},
    }
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=1))
    return 0
