"""The GPU validation that scripts/gpu_check.sh runs once it has installed the project offline:
each step below on the CUDA device (or, with --cpu-dry-run, the same steps on the CPU with tiny
geometries, the CUDA-only ones listed as skipped), one JSON with every result, and the failed
steps named on stderr and in the exit code.

    python -m pulseinfer.gpu_check --repo DIR --work DIR --out FILE [--cpu-dry-run] [--tokenizer DIR]

Steps: install (what the shell did, and that its copy is the one imported); environment
(versions); gpu_tests (tests/test_kernels.py, which runs its kernels on CUDA when there is one,
and every `gpu`-marked test); decode_matches_cpu (greedy tokens of dense, pulse at a covering
budget and at a sparse one, on CUDA in float32 against the CPU, on dummy weights of a Qwen3 and
of a hybrid sliding-window Gemma 3 geometry); serve_stream (`pulseinfer serve --device cuda`
with a device pool small enough to offload the request, one streamed completion, recalls
through the kv_store's CUDA IPC path counted on /metrics); bench_decode (`pulseinfer bench
decode` dense/headwise/pulse on dummy weights of a Qwen3-8B geometry under memory pressure, and
on the default model when its file is present).
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import platform
import random
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

CUDA_ONLY = "CUDA only"


@dataclass(frozen=True)
class CheckConfig:
    repo: Path  # the checkout: its tests/
    work: Path  # scratch: model folders, logs (the shell removes it)
    out: Path
    cpu_dry_run: bool = False
    tokenizer: Path | None = None  # tokenizer.json (+ tokenizer_config.json) for the geometries; default: the default model's
    install_report: Path | None = None
    install_log: Path | None = None
    deadline_s: float = 480.0  # steps that would start later are skipped: the whole check fits 8 minutes on an H100
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
    serve_model: tuple[str, int]
    serve_prompt: int
    serve_device_kv_tokens: int
    bench_model: tuple[str, int]
    bench_flags: tuple[str, ...]
    default_bench_flags: tuple[str, ...] | None  # None: the default model is not benched (the CLI tests bench it on the CPU)


GPU_SIZES = Sizes(
    # Gemma 3 4B cut to its first 6 layers: 5 sliding (window 1024, head dim 256) and 1 global
    equality_models=(("qwen3-0.6b", 0), ("gemma-3-4b", 6)),
    prompt_lengths=(700, 1500),
    output_tokens=12,
    sink=64,
    recent=128,
    sparse_budget=256,
    serve_model=("qwen3-0.6b", 0),
    serve_prompt=3000,
    serve_device_kv_tokens=2048,
    bench_model=("qwen3-8b", 0),
    # 8 requests of 8k-16k tokens with the device pool at a quarter of their KV
    bench_flags=("--requests", "8", "--context", "8192-16384", "--output-tokens", "32", "--prefill-chunk", "2048"),
    default_bench_flags=("--requests", "16", "--context", "4000-6000", "--output-tokens", "32", "--prefill-chunk", "2048"),
)
DRY_SIZES = Sizes(
    equality_models=(("qwen3-0.6b", 0), ("gemma-3-4b", 0)),  # both shrunk to tiny()
    prompt_lengths=(40, 90),
    output_tokens=6,
    sink=16,
    recent=16,
    sparse_budget=32,
    serve_model=("qwen3-0.6b", 0),
    serve_prompt=400,
    serve_device_kv_tokens=256,
    bench_model=("qwen3-8b", 0),
    bench_flags=("--requests", "3", "--context", "64-128", "--output-tokens", "4", "--device-kv-tokens", "192")
    + ("--sink", "16", "--recent", "16", "--budget", "32"),
    default_bench_flags=None,
)


@dataclass
class StepResult:
    name: str
    status: str  # passed | failed | skipped
    seconds: float = 0.0
    details: dict = dataclasses.field(default_factory=dict)
    error: str = ""


class StepSkipped(Exception):
    """The step does not apply here; the message says why."""


class StepFailed(Exception):
    """A check inside a step did not hold; details says what was measured."""

    def __init__(self, message: str, details: dict):
        super().__init__(message)
        self.details = details


# ---------------------------------------------------------------- model folders


def tiny(config: dict) -> dict:
    """A geometry shrunk to a few thousand parameters per layer, its family and layer kinds kept."""
    small = dict(config, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    small["num_hidden_layers"] = 2
    if "sliding_window" in config:  # one sliding layer, then one global
        small.update(sliding_window=32, sliding_window_pattern=2, query_pre_attn_scalar=16)
    return small


def model_dir(check: CheckConfig, geometry: str, layers: int) -> Path:
    """A folder with a shipped geometry's config.json (its first `layers` layers; tiny in the dry
    run) and a tokenizer, for --load-format dummy."""
    from pulseinfer.common.model.meta import GEOMETRIES

    config = json.loads((GEOMETRIES / geometry / "config.json").read_text())
    if check.cpu_dry_run:
        config = tiny(config)
    elif layers:
        config["num_hidden_layers"] = layers
    name = f"{geometry}-{config['num_hidden_layers']}l" + ("-tiny" if check.cpu_dry_run else "")
    path = check.work / "models" / name
    if not path.is_dir():
        path.mkdir(parents=True)
        (path / "config.json").write_text(json.dumps(config, indent=1))
        copy_tokenizer(check, path)
    return path


def copy_tokenizer(check: CheckConfig, path: Path) -> None:
    if check.tokenizer is not None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (check.tokenizer / name).is_file():
                shutil.copy(check.tokenizer / name, path / name)
        return
    from pulseinfer.common.model.meta import load_model_meta

    load_model_meta().tokenizer.save_hf_dir(path)  # the default model's, where its file is installed


def random_prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    """Token ids of ordinary text pieces of the borrowed tokenizer (no special tokens), fixed by the seed."""
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(n)] for n in lengths]


# ---------------------------------------------------------------- steps


def step_install(check: CheckConfig, sizes: Sizes) -> dict:
    """What scripts/gpu_check.sh did before this process started, and that its copy is the one in use."""
    import pulseinfer

    if check.install_report is None:
        raise StepSkipped("not started by scripts/gpu_check.sh: the running Python's packages are used")
    details = json.loads(check.install_report.read_text())
    details["seconds"] = details.pop("ms") / 1e3
    installed = Path(pulseinfer.__file__).resolve().parent
    if Path(details["site"]).resolve() not in installed.parents:
        raise StepFailed(f"pulseinfer was imported from {installed}, not from the offline install in {details['site']}", details)
    details["wheels"] = sorted(p.name for p in Path(details["wheelhouse"]).glob("*.whl"))
    return details


def step_environment(check: CheckConfig, sizes: Sizes) -> dict:
    import pulseinfer

    details = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": _version("triton"),
        "protobuf": _version("google.protobuf"),
        "grpcio": _version("grpc"),
        "pulseinfer_imported_from": str(Path(pulseinfer.__file__).resolve().parent),
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        details |= {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1), "sms": props.multi_processor_count}
        details["driver"] = _nvidia_smi("driver_version")
    return details


def _version(module: str) -> str | None:
    try:
        return __import__(module, fromlist=["__version__"]).__version__
    except ImportError:
        return None


def _nvidia_smi(field: str) -> str | None:
    try:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        return done.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def step_gpu_tests(check: CheckConfig, sizes: Sizes) -> dict:
    """The kernel tests (on CUDA: the suite runs them on the CPU) and every `gpu`-marked test (each
    skips itself without CUDA, so the dry run checks they collect and run from the installed copy),
    run from the work folder so that the checkout's own folders never shadow the installed package."""
    tests = check.repo / "tests"
    marked = sorted(str(p) for p in tests.glob("test_*.py") if "pytest.mark.gpu" in p.read_text())
    runs = {"gpu_marked": ["-m", "gpu", *marked]}
    details: dict = {"skipped": {"kernels": CUDA_ONLY}} if check.cpu_dry_run else {}
    if not check.cpu_dry_run:
        runs["kernels"] = [str(tests / "test_kernels.py")]
    for name, args in runs.items():
        command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--rootdir", str(check.repo), *args]
        done = subprocess.run(command, cwd=check.work, capture_output=True, text=True, timeout=remaining(check))
        summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
        details[name] = {"rc": done.returncode, "summary": summary}
        if done.returncode != 0:
            details[name]["output_tail"] = (done.stdout + done.stderr)[-3000:]
    if failed := [name for name in runs if details[name]["rc"] != 0]:
        raise StepFailed(f"pytest failed: {', '.join(failed)}", details)
    return details


def step_decode_matches_cpu(check: CheckConfig, sizes: Sizes) -> dict:
    """Greedy tokens on the device under test in float32 equal the CPU's, per model and mode; pulse
    at a covering budget also equals dense on each device."""
    from pulseinfer.gpu_worker.model.loader import load_model

    prompts = random_prompts(sizes.prompt_lengths)
    full_budget = max(sizes.prompt_lengths) + sizes.output_tokens
    modes = {"dense": None, "pulse_full": full_budget, "pulse_sparse": sizes.sparse_budget}
    details, failures = {}, []
    for geometry, layers in sizes.equality_models:
        path = model_dir(check, geometry, layers)
        loaded = load_model(path, "dummy")
        devices = dict.fromkeys(("cpu", check.device))  # the dry run compares the CPU with itself: one run
        tokens = {(mode, device): greedy(loaded, prompts, sizes, device, budget) for mode, budget in modes.items() for device in devices}
        rows = {}
        for mode in modes:
            cpu, tested = tokens[(mode, "cpu")], tokens[(mode, check.device)]
            rows[mode] = {"equal": cpu == tested, "first_difference": first_difference(cpu, tested), "tokens": tested}
            if cpu != tested:
                failures.append(f"{path.name} {mode}: {check.device} differs from cpu at {rows[mode]['first_difference']}")
        for device in devices:
            if tokens[("pulse_full", device)] != tokens[("dense", device)]:
                failures.append(f"{path.name} on {device}: pulse at a covering budget differs from dense")
        details[path.name] = rows
    if check.cpu_dry_run:
        details["skipped"] = {"the CUDA side (the CPU is compared with itself)": CUDA_ONLY}
    if failures:
        raise StepFailed("; ".join(failures), details)
    return details


def greedy(loaded, prompts: list[list[int]], sizes: Sizes, device: str, budget: int | None) -> list[list[int]]:
    """Greedy tokens of one engine: dense (budget None) or every request offloaded at `budget`."""
    from pulseinfer.engine import Engine, EngineConfig
    from pulseinfer.gpu_worker.offload.config import OffloadConfig
    from pulseinfer.gpu_worker.runner import WorkerConfig
    from pulseinfer.scheduler.batcher import BatcherConfig
    from pulseinfer.scheduler.request import SamplingParams

    tokens = sum(len(p) + sizes.output_tokens for p in prompts) + 64 * len(prompts)
    offload = OffloadConfig(sink=sizes.sink, recent=sizes.recent, budget=budget or sizes.sparse_budget)
    mode = "dense" if budget is None else "pulse"
    worker = WorkerConfig(mode=mode, device=device, dtype="float32", device_kv_tokens=tokens, offload=offload)
    batcher = BatcherConfig(offload="never" if budget is None else "always")
    engine = Engine(EngineConfig(worker=worker, batcher=batcher, host_kv_tokens=tokens), loaded=loaded)
    try:
        return [c.token_ids for c in engine.generate(prompts, SamplingParams(max_tokens=sizes.output_tokens, ignore_eos=True))]
    finally:
        del engine
        if device == "cuda":
            torch.cuda.empty_cache()


def first_difference(a: list[list[int]], b: list[list[int]]) -> list[int] | None:
    """(request, position) of the first token that differs, or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        for j, (s, t) in enumerate(zip(x, y)):
            if s != t:
                return [i, j]
        if len(x) != len(y):
            return [i, min(len(x), len(y))]
    return None


def step_serve_stream(check: CheckConfig, sizes: Sizes) -> dict:
    """`pulseinfer serve` on the device with a pool smaller than the request: it is offloaded and
    its decode steps recall blocks through the kv_store's I/O engine (CUDA IPC on a GPU)."""
    from pulseinfer.bench.cluster import ServingCluster

    path = model_dir(check, *sizes.serve_model)
    flags = ["--model", str(path), "--load-format", "dummy", "--device", check.device]
    flags += ["--device-kv-tokens", str(sizes.serve_device_kv_tokens)]
    flags += ["--sink", str(sizes.sink), "--recent", str(sizes.recent), "--budget", str(sizes.sparse_budget), "--layer-ahead", "on"]
    cluster = ServingCluster(*flags, startup_timeout_s=remaining(check))
    try:
        details = {"flags": flags, **stream_one(cluster, path.name, random_prompts((sizes.serve_prompt,), seed=1)[0], 8)}
        for metric in ("offloaded_admissions_total", "recall_units_total", "recall_bytes_total"):
            details[metric] = cluster.metric(metric, worker="0")
        # the kv_store's counters reach /metrics with its next stats report
        details["kv_store_engine_recalls_total"] = poll(lambda: cluster.metric("kv_store_engine_recalls_total"), timeout_s=15)
    finally:
        details_rc = cluster.stop(timeout_s=60)
    details["serve_exit_code"] = details_rc
    if check.cpu_dry_run:
        details["skipped"] = {"CUDA IPC (recalls land in the worker's shared-memory segment)": CUDA_ONLY}
    counters = ("offloaded_admissions_total", "recall_units_total", "kv_store_engine_recalls_total")
    wrong = [f"{k} = {details[k]}" for k in counters if not details[k]]
    if details["completion_tokens"] != 8 or details["finish_reason"] != "length" or wrong or details_rc != 0:
        raise StepFailed(f"the streamed request or the recall path did not hold: {', '.join(wrong) or 'see details'}", details)
    return details


def poll(read: Callable[[], float | None], timeout_s: float) -> float | None:
    """The first truthy value `read` returns within the timeout, else its last."""
    deadline = time.monotonic() + timeout_s
    while not (value := read()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return value


def stream_one(cluster, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    connection = http.client.HTTPConnection("127.0.0.1", cluster.http_port, timeout=300)
    started = time.perf_counter()
    chunks, finish, usage, ttft = 0, None, {}, None
    try:
        connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise StepFailed(f"HTTP {response.status}", {"body": response.read().decode(errors="replace")[:500]})
        for line in response:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[len(b"data: ") :])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                chunks += 1
                ttft = ttft if ttft is not None else time.perf_counter() - started
                finish = choice.get("finish_reason") or finish
    finally:
        connection.close()
    return {
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "chunks": chunks,
        "finish_reason": finish,
        "ttft_s": ttft,
        "e2e_s": time.perf_counter() - started,
    }


def step_bench_decode(check: CheckConfig, sizes: Sizes) -> dict:
    """dense/headwise/pulse side by side on dummy weights of a realistic geometry, and on the default
    model when its file is installed; decode tok/s per mode and the ratios."""
    from pulseinfer.common.model.meta import ModelLoadError, default_model_path

    runs = {"dummy": ["--model", str(model_dir(check, *sizes.bench_model)), "--load-format", "dummy", *sizes.bench_flags]}
    try:
        if sizes.default_bench_flags is not None and default_model_path().is_file():
            runs["default_model"] = list(sizes.default_bench_flags)
    except ModelLoadError:
        pass
    details = {"default_model": "default_model" in runs or "not installed or a dry run: skipped"}
    for name, flags in runs.items():
        out = check.work / f"bench_{name}.json"
        command = [sys.executable, "-m", "pulseinfer.cli", "bench", "decode", "--device", check.device, "--modes", "dense,headwise,pulse"]
        done = subprocess.run([*command, *flags, "--json", str(out)], capture_output=True, text=True, timeout=remaining(check))
        if done.returncode != 0:
            raise StepFailed(f"bench decode ({name}) exited {done.returncode}", details | {name: (done.stdout + done.stderr)[-3000:]})
        result = json.loads(out.read_text())
        details[name] = {"settings": result["settings"], "ratios": result["ratios"], "modes": [_mode_summary(m) for m in result["modes"]]}
    return details


def _mode_summary(row: dict) -> dict:
    keys = ("mode", "decode_tok_s", "tpot_p50_s", "tpot_p99_s", "mean_decode_batch", "recall_bytes_per_step", "recall_transfers_per_step")
    return {k: row[k] for k in keys if k in row} | {"agreement_with_dense": row.get("agreement_with_dense")}


STEPS: tuple[tuple[str, Callable[[CheckConfig, Sizes], dict]], ...] = (
    ("install", step_install),
    ("environment", step_environment),
    ("gpu_tests", step_gpu_tests),
    ("decode_matches_cpu", step_decode_matches_cpu),
    ("serve_stream", step_serve_stream),
    ("bench_decode", step_bench_decode),
)


def remaining(check: CheckConfig) -> float:
    return max(1.0, check.deadline_s - (time.monotonic() - check.started))


def run_step(check: CheckConfig, sizes: Sizes, name: str, step: Callable[[CheckConfig, Sizes], dict]) -> StepResult:
    if time.monotonic() - check.started > check.deadline_s:
        return StepResult(name, "skipped", error=f"the check's {check.deadline_s:.0f} s were spent before it started")
    started = time.perf_counter()
    try:
        details, status, error = step(check, sizes), "passed", ""
    except StepSkipped as e:
        details, status, error = {}, "skipped", str(e)
    except StepFailed as e:
        details, status, error = e.details, "failed", str(e)
    except Exception as e:  # a step's crash is its failure, and the next steps still run
        details, status, error = {"traceback": traceback.format_exc()[-3000:]}, "failed", f"{type(e).__name__}: {e}"
    return StepResult(name, status, time.perf_counter() - started, details, error)


def skipped(results: list[StepResult]) -> dict[str, str]:
    """Steps skipped, and the parts of steps that ran, with why: 'step' or 'step: part' -> reason."""
    out = {r.name: r.error for r in results if r.status == "skipped"}
    for r in results:
        out |= {f"{r.name}: {part}": why for part, why in r.details.get("skipped", {}).items()}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pulseinfer.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cpu-dry-run", action="store_true")
    parser.add_argument("--tokenizer", type=Path)
    parser.add_argument("--install-report", type=Path)
    parser.add_argument("--install-log", type=Path)
    parser.add_argument("--deadline-s", type=float, default=CheckConfig.deadline_s)
    args = parser.parse_args(argv)
    check = CheckConfig(**vars(args))
    if not check.cpu_dry_run and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu-dry-run to check the steps on the CPU", file=sys.stderr)
        return 2
    sizes = DRY_SIZES if check.cpu_dry_run else GPU_SIZES
    results = []
    for name, step in STEPS:
        result = run_step(check, sizes, name, step)
        print(f"step {name}: {result.status} ({result.seconds:.1f} s){' - ' + result.error if result.error else ''}", flush=True)
        results.append(result)
    failed = [r.name for r in results if r.status == "failed"]
    report = {
        "device": check.device,
        "cpu_dry_run": check.cpu_dry_run,
        "seconds": time.monotonic() - check.started,
        "failed": failed,
        "skipped": skipped(results),
        "steps": [dataclasses.asdict(r) for r in results],
    }
    check.out.parent.mkdir(parents=True, exist_ok=True)
    check.out.write_text(json.dumps(report, indent=1) + "\n")
    verdict = f"FAILED: {', '.join(failed)}" if failed else "all steps passed"
    print(f"{verdict}; results in {check.out}", file=sys.stderr if failed else sys.stdout)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
