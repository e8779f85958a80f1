"""Time the compute waits on recalls: synchronous recall, suspension alone (rows whose recalls
are in flight attend after the others), layer cursors alone (those rows resume from their layer
after the others have run every layer), layer-ahead recall without suspension, with it and with
layer cursors, and layer-ahead recall with a per-layer deadline, side by side in one run (the same offloaded
requests decoded again and again on one loaded model), for each recall path:
- `worker`: the worker's own I/O thread copies from its mapping of the pool (the in-process engine);
- `engine`: a kv_store process's I/O engine copies into the worker's cache (as `pulseinfer serve` runs).
With the deadline, the wait includes the step's end, where the recalls it left behind land; the
blocks attention went without are counted.

    pulseinfer bench layer-ahead [--requests 4] [--context 4096] [--output-tokens 32] [--budget 512]
                                 [--hot-extra 0] [--deadline-ms 0] [--paths worker,engine] [--json OUT]
"""

from __future__ import annotations

import json
import pydoc_data.topics
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import zmq

from pulseinfer.bench.decode import agreement, serve
from pulseinfer.bench.timing import write_results
from pulseinfer.engine import Engine, EngineConfig
from pulseinfer.gpu_worker.config import WorkerConfig
from pulseinfer.gpu_worker.model.loader import LoadedModel, load_model
from pulseinfer.gpu_worker.offload.config import HostTier, OffloadConfig
from pulseinfer.kv_store.client import KVStoreClient
from pulseinfer.kv_store.view import PoolView
from pulseinfer.launcher import start_kv_store
from pulseinfer.messages.sampling import SamplingParams
from pulseinfer.scheduler.batcher import BatcherConfig

RUNS = (  # name, --layer-ahead, --suspend, with --deadline-ms
    ("synchronous", "off", "off", False),
    ("suspension", "off", "layer", False),
    ("cursors", "off", "cursor", False),
    ("layer_ahead", "on", "off", False),
    ("layer_ahead_suspension", "on", "layer", False),
    ("layer_ahead_cursors", "on", "cursor", False),
    ("layer_ahead_deadline", "on", "off", True),
)
WORKER_ID = 0


@dataclass(frozen=True)
class LayerAheadBenchConfig:
    requests: int = 4
    context: int = 4096
    output_tokens: int = 32
    budget: int = 512
    hot_extra: int = 0  # hot-buffer tokens beyond the budget (layer-ahead fills them)
    deadline_ms: float = 0.0
    paths: str = "worker,engine"  # recall paths to compare: worker, engine


@contextmanager
def kv_store_tier(loaded: LoadedModel, worker: WorkerConfig, host_kv_tokens: int) -> Iterator[HostTier]:
    """A kv_store process of its own, its pool mapped here and its I/O engine doing the recalls."""
    c, context = loaded.config, zmq.Context()
    with tempfile.TemporaryDirectory() as run_dir:
        address = f"ipc://{run_dir}/kv_store"
        child = start_kv_store(address, host_kv_tokens)
        client, view = None, None
        try:
            client = KVStoreClient(context, address, timeout_s=60)
            view = PoolView.attach(client.register(WORKER_ID), c.num_kv_heads, worker.block_size, c.head_dim, worker.torch_dtype())
            if worker.device == "cuda":  # the worker's write-backs reach the pool through UVA
                view.pin()
            yield HostTier(view, client, None, client.open_recall_engine)
        finally:
            if view is not None:
                view.close()
            if client is not None:
                client.close()
            child.stop()
            child.wait_or_kill(time.monotonic() + 30)
            context.destroy(linger=0)


def decode(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], list[float]]:
    """The requests' tokens, and the seconds of every decode-only step."""
    ids = [engine.submit(p, params) for p in prompts]
    tokens, steps = serve(engine)
    return [tokens[i] for i in ids], [s.seconds for s in steps if all(len(c.token_ids) == 1 for c in s.plan.chunks)]


def run_path(loaded: LoadedModel, host: HostTier | None, args: LayerAheadBenchConfig, prompts: list[list[int]]) -> tuple[dict, list]:
    """Each run's measurements, and the synchronous run's tokens."""
    params = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True)
    results, tokens = {}, {}
    for name, ahead, suspend, deadline in RUNS:
        deadline_ms = args.deadline_ms if deadline else None
        offload = OffloadConfig(
            budget=args.budget, hot_extra=args.hot_extra, layer_ahead=ahead, suspend=suspend, recall_deadline_ms=deadline_ms
        )
        worker = WorkerConfig(device_kv_tokens=65536, offload=offload)
        engine = Engine(EngineConfig(worker=worker, batcher=BatcherConfig(offload="always")), loaded, host)
        started = time.perf_counter()
        tokens[name], step_s = decode(engine, prompts, params)
        stats = engine.runner.offload.stats()
        engine.close()
        steps, recall = stats["decoded_rows"] / args.requests, stats["recall"]
        results[name] = {
            "seconds": time.perf_counter() - started,
            "io_wait_ms_per_step": recall["wait_s"] / steps * 1e3,
            "decode_step_ms_p50": statistics.median(step_s) * 1e3,
            "recalled_units_per_step": recall["units"] / steps,
            "prefetched_units": recall["prefetched_units"],
            "corrected_units": recall["corrected_units"],
            "truncated_units_per_step": recall["truncated_units"] / steps,
            "suspended_rows_per_step": recall["suspended_rows"] / steps,
            "resumed_layers_per_step": recall["resumed_layers"] / steps,
        }
        print(name, json.dumps(results[name]), flush=True)
    synchronous = results["synchronous"]
    for name, *_ in RUNS[1:]:
        results[name]["io_wait_ratio"] = results[name]["io_wait_ms_per_step"] / synchronous["io_wait_ms_per_step"]
        results[name]["decode_step_ratio"] = results[name]["decode_step_ms_p50"] / synchronous["decode_step_ms_p50"]
    exact = [name for name, *rest in RUNS[1:] if not rest[-1]]
    results["identical_tokens"] = all(tokens[name] == tokens["synchronous"] for name in exact)
    results["deadline_token_agreement"] = agreement(tokens["layer_ahead_deadline"], tokens["synchronous"])
    return results, tokens["synchronous"]


def main(args: LayerAheadBenchConfig, json_path: Path | None = None) -> int:
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if not paths or set(paths) - {"worker", "engine"}:
        raise ValueError(f"--paths takes worker and/or engine, got {args.paths!r}")
    loaded = load_model()
    ids = loaded.tokenizer.encode(" ".join(pydoc_data.topics.topics.values()))
    stride = (len(ids) - args.context) // args.requests
    prompts = [ids[i * stride : i * stride + args.context] for i in range(args.requests)]
    results, tokens = {}, {}
    for path in paths:
        print(f"recall path: {path}", flush=True)
        if path == "worker":
            results[path], tokens[path] = run_path(loaded, None, args, prompts)
        else:
            pool_tokens = args.requests * (args.context + args.output_tokens) + 4096  # what the requests need, and a margin
            with kv_store_tier(loaded, WorkerConfig(), pool_tokens) as host:
                results[path], tokens[path] = run_path(loaded, host, args, prompts)
    results["paths_agree"] = len({json.dumps(t) for t in tokens.values()}) == 1  # every path decodes the same tokens
    print(json.dumps({p: {n: results[p][n]["io_wait_ratio"] for n, *_ in RUNS[1:]} for p in paths}))
    write_results(args, results, json_path)
    return 0
