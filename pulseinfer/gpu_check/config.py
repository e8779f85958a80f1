"""What the check is given: its settings and deadline, the sizes each step runs at on the GPU and
in the dry run, and the two ways a step ends without passing."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CheckConfig:
    repo: Path  # the checkout: its tests/
    work: Path  # scratch: model folders, logs (the shell removes it)
    out: Path
    cpu_dry_run: bool = False
    tokenizer: Path | None = None  # tokenizer.json (+ tokenizer_config.json) for the geometries; default: the default model's
    install_report: Path | None = None
    # the whole check fits 8 minutes on an H100; in a step's own process: that step's limit
    deadline_s: float = 480.0
    started: float = dataclasses.field(default_factory=time.monotonic)

    @property
    def device(self) -> str:
        return "cpu" if self.cpu_dry_run else "cuda"


@dataclass(frozen=True)
class Sizes:
    """What the steps run, on the GPU and in the dry run."""

    equality_models: tuple[tuple[str, int], ...]  # (shipped geometry, layers kept: 0 = all)
    prompt_lengths: tuple[int, ...]
    output_tokens: int
    sink: int
    recent: int
    sparse_budget: int
    syncs_model: tuple[str, int]
    serve_model: tuple[str, int]
    serve_prompt: int
    serve_device_kv_tokens: int
    bench_model: tuple[str, int]
    bench_settings: dict  # DecodeBenchConfig's fields
    default_bench_settings: dict | None  # None: the default model is not benched (the CLI tests bench it on the CPU)
    budgets_s: dict[str, float]  # the seconds each step is given at least (while the deadline allows): STEPS' order


GPU_SIZES = Sizes(
    # Gemma 3 4B cut to its first 6 layers: 5 sliding (window 1024, head dim 256) and 1 global
    equality_models=(("qwen3-0.6b", 0), ("gemma-3-4b", 6)),
    prompt_lengths=(700, 1500),
    output_tokens=12,
    sink=64,
    recent=128,
    sparse_budget=256,
    syncs_model=("qwen3-0.6b", 0),
    serve_model=("qwen3-0.6b", 0),
    serve_prompt=3000,
    serve_device_kv_tokens=2048,
    # Qwen3-8B cut to 6 layers: its dummy weights (2.4 B, embeddings 1.2 B of them) take ~40 s to
    # make on one core, all 36 layers would take 160 s
    bench_model=("qwen3-8b", 6),
    # 8 requests of 8k-16k tokens with the device pool at a quarter of their KV
    bench_settings={"requests": 8, "context": "8192-16384", "output_tokens": 32, "prefill_chunk": 2048},
    default_bench_settings={"requests": 16, "context": "4000-6000", "output_tokens": 32, "prefill_chunk": 2048},
    # 480 s in all. Besides the work itself: each step's process imports torch and sets up CUDA
    # (~5 s); the kernel tests and the first model steps compile their kernels (Triton's disk cache
    # serves a later process what an earlier one compiled); each model's dummy weights are made on
    # one CPU core (~20 s per billion), once per step (materialized())
    budgets_s={
        "install": 10,
        "environment": 20,
        "gpu_tests": 120,
        "decode_matches_cpu": 100,
        "decode_syncs": 50,
        "serve_stream": 60,
        "bench_decode": 120,
    },
)
DRY_SIZES = Sizes(
    equality_models=(("qwen3-0.6b", 0), ("gemma-3-4b", 0)),  # both shrunk to tiny()
    prompt_lengths=(40, 90),
    output_tokens=6,
    sink=16,
    recent=16,
    sparse_budget=32,
    syncs_model=("qwen3-0.6b", 0),
    serve_model=("qwen3-0.6b", 0),
    serve_prompt=400,
    serve_device_kv_tokens=256,
    bench_model=("qwen3-8b", 0),
    bench_settings={"requests": 3, "context": "64-128", "output_tokens": 4, "device_kv_tokens": 192}
    | {"sink": 16, "recent": 16, "budget": 32},
    default_bench_settings=None,
    # a shared CI CPU, several times what a step takes there alone
    budgets_s={
        "install": 20,
        "environment": 20,
        "gpu_tests": 80,
        "decode_matches_cpu": 60,
        "decode_syncs": 60,
        "serve_stream": 100,
        "bench_decode": 100,
    },
)


class StepSkipped(Exception):
    """The step does not apply here; the message says why."""


class StepFailed(Exception):
    """A check inside a step did not hold; details says what was measured."""

    def __init__(self, message: str, details: dict):
        super().__init__(message)
        self.details = details


def remaining(check: CheckConfig) -> float:
    return max(1.0, check.deadline_s - (time.monotonic() - check.started))
