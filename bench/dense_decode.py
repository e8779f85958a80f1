"""Dense decode throughput: PulseInfer's engine vs HF transformers `generate`, side by side.

    pulseinfer bench dense-decode [--batches 1,8] [--contexts 512,2048,4096] [--output-tokens 32] [--json OUT]

Decode tokens/s counts only the decode phase (after prefill), for both engines.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pulseinfer.common.model.meta import default_model_path
from pulseinfer.engine import Engine, EngineConfig
from pulseinfer.gpu_worker.config import WorkerConfig
from pulseinfer.gpu_worker.model.loader import load_model
from pulseinfer.messages.sampling import SamplingParams
from pulseinfer.scheduler.batcher import BatcherConfig


def corpus_ids(tokenizer) -> list[int]:
    import pydoc_data.topics

    return tokenizer.encode(" ".join(pydoc_data.topics.topics.values()))


def bench_ours(engine: Engine, prompts: list[list[int]], output_tokens: int) -> float:
    params = SamplingParams(max_tokens=output_tokens + 1, ignore_eos=True)
    for prompt in prompts:
        engine.submit(prompt, params)
    while any(not s.output_ids for s in [*engine.batcher.waiting, *engine.batcher.running]):
        engine.step()  # prefill, which samples the first token
    started = time.perf_counter()
    decoded = 0
    while engine.batcher.has_work():
        decoded += len(engine.batcher.running)
        engine.step()
    return decoded / (time.perf_counter() - started)


def bench_hf(model, prompts: list[list[int]], output_tokens: int) -> float:
    """HF's own forward with its KV cache, greedy, timed over the decode phase only (as ours)."""
    with torch.inference_mode():
        out = model(torch.tensor(prompts), use_cache=True, logits_to_keep=1)  # equal lengths: no padding
        started = time.perf_counter()
        for _ in range(output_tokens):
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            out = model(token, past_key_values=out.past_key_values, use_cache=True, logits_to_keep=1)
    return len(prompts) * output_tokens / (time.perf_counter() - started)


@dataclass(frozen=True)
class DenseDecodeBenchConfig:
    batches: str = "1,8"  # comma-separated batch sizes
    contexts: str = "512,2048,4096"  # comma-separated prompt lengths, in tokens
    output_tokens: int = 32


def main(args: DenseDecodeBenchConfig, json_path: Path | None = None) -> int:
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]

    started = time.perf_counter()
    loaded = load_model()
    capacity = max(batches) * (max(contexts) + args.output_tokens + 16)
    engine = Engine(
        EngineConfig(worker=WorkerConfig(device_kv_tokens=capacity), batcher=BatcherConfig(max_batch_size=max(batches))), loaded
    )
    ours_load = time.perf_counter() - started

    import transformers

    path = default_model_path()
    started = time.perf_counter()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    hf_load = time.perf_counter() - started

    corpus = corpus_ids(engine.tokenizer)  # tokenized once; prompts are slices at distinct offsets
    rows = []
    for context in contexts:
        for batch in batches:
            prompts = [corpus[997 * i : 997 * i + context] for i in range(batch)]
            ours = bench_ours(engine, prompts, args.output_tokens)
            ref = bench_hf(hf, prompts, args.output_tokens)
            rows.append({"context": context, "batch": batch, "pulseinfer_tok_s": ours, "hf_tok_s": ref, "ratio": ours / ref})
            print(
                f"context {context:5d} batch {batch:2d}: pulseinfer {ours:7.1f} tok/s  hf {ref:7.1f} tok/s  ratio {ours / ref:5.2f}",
                flush=True,
            )

    print(f"\nmodel load: pulseinfer {ours_load:.1f} s, hf transformers {hf_load:.1f} s")
    print("\n| context | batch | pulseinfer tok/s | HF tok/s | ratio |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['context']} | {r['batch']} | {r['pulseinfer_tok_s']:.1f} | {r['hf_tok_s']:.1f} | {r['ratio']:.2f} |")
    result = {
        "output_tokens": args.output_tokens,
        "threads": torch.get_num_threads(),
        "load_seconds": {"pulseinfer": ours_load, "hf": hf_load},
        "rows": rows,
    }
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=1))
    return 0
