"""Time the compute waits on recalls: synchronous recall, suspension alone (rows whose recalls
are in flight attend after the others), layer-ahead recall without and with suspension, and
layer-ahead recall with a per-layer deadline, side by side in one run (the same offloaded
requests decoded five times on one loaded model). With the deadline, the wait includes the
step's end, where the recalls it left behind land; the blocks attention went without are counted.

    python -m bench.layer_ahead [--requests 4] [--context 4096] [--output-tokens 32] [--budget 512]
                                [--deadline-ms 0] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import pydoc_data.topics
import time
from pathlib import Path

from bench.decode import agreement
from gpu_worker.model.loader import load_model
from gpu_worker.offload import OffloadConfig
from gpu_worker.runner import WorkerConfig
from pulseinfer.engine import Engine, EngineConfig
from scheduler.batcher import BatcherConfig
from scheduler.request import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--deadline-ms", type=float, default=0.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    loaded = load_model()
    ids = loaded.tokenizer.encode(" ".join(pydoc_data.topics.topics.values()))
    stride = (len(ids) - args.context) // args.requests
    prompts = [ids[i * stride : i * stride + args.context] for i in range(args.requests)]
    params = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True)
    results, tokens = {}, {}
    runs = (
        ("synchronous", "off", False, None),
        ("suspension", "off", True, None),
        ("layer_ahead", "on", False, None),
        ("layer_ahead_suspension", "on", True, None),
        ("layer_ahead_deadline", "on", False, args.deadline_ms),
    )
    for name, ahead, suspend, deadline in runs:
        offload = OffloadConfig(budget=args.budget, layer_ahead=ahead, suspend=suspend, recall_deadline_ms=deadline)
        worker = WorkerConfig(device_kv_tokens=65536, offload=offload)
        engine = Engine(EngineConfig(worker=worker, batcher=BatcherConfig(offload="always")), loaded)
        started = time.perf_counter()
        tokens[name] = [c.token_ids for c in engine.generate(prompts, params)]
        stats = engine.runner.offload.stats()
        steps = stats["decoded_rows"] / args.requests
        results[name] = {
            "seconds": time.perf_counter() - started,
            "io_wait_ms_per_step": stats["io_wait_seconds"] / steps * 1e3,
            "recalled_units_per_step": stats["recalled_units"] / steps,
            "prefetched_units": stats["prefetched_units"],
            "corrected_units": stats["corrected_units"],
            "truncated_units_per_step": stats["truncated_units"] / steps,
            "suspended_rows_per_step": stats["suspended_rows"] / steps,
        }
        print(name, json.dumps(results[name]), flush=True)
    synchronous = results["synchronous"]["io_wait_ms_per_step"]
    summary = {
        **{f"{name}_io_wait_ratio": results[name]["io_wait_ms_per_step"] / synchronous for name, *_ in runs[1:]},
        "identical_tokens": all(tokens[name] == tokens["synchronous"] for name, *_ in runs[1:-1]),
        "deadline_token_agreement": agreement(tokens["layer_ahead_deadline"], tokens["synchronous"]),
    }
    print(json.dumps(summary))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"settings": {k: v for k, v in vars(args).items() if k != "json"}, **results, **summary}, indent=1) + "\n"
        )


if __name__ == "__main__":
    main()
