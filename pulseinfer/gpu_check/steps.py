"""The check's steps, each a function of (CheckConfig, Sizes) that returns its details or raises
StepSkipped or StepFailed, and STEPS: their names in the order they run."""

from __future__ import annotations

import ast
import http.client
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pulseinfer.gpu_check.config import CheckConfig, Sizes, StepFailed, StepSkipped, remaining
from pulseinfer.gpu_check.fixtures import TOKENIZER_ENV, materialized, model_dir, random_prompts

CUDA_ONLY = "CUDA only"
# host syncs a decode step may make, sampling and selections included: the one read of its sampled tokens
MAX_DECODE_STEP_SYNCS = 1


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
    requirements = details.pop("requirements")
    details["wheels"] = Path(requirements).read_text().split() if requirements else []  # none: the dry run without a wheelhouse
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
    """The kernel tests (the files that pick CUDA where there is one) whole, on CUDA (the suite runs
    them on the CPU), then every other file's `gpu`-marked tests (each skips itself without CUDA,
    so the dry run checks they collect and run from the installed copy), run from the work folder
    so that the checkout's own folders never shadow the installed package."""
    tests = sorted((check.repo / "tests").glob("test_*.py"))
    kernels = [p for p in tests if picks_cuda(p)]
    runs = {} if check.cpu_dry_run else {"kernels": list(map(str, kernels))}
    marked = [str(p) for p in tests if "pytest.mark.gpu" in p.read_text() and str(p) not in runs.get("kernels", ())]
    runs["gpu_marked"] = ["-m", "gpu", *marked]
    details: dict = {"kernel_files": [p.name for p in kernels]}
    if check.cpu_dry_run:
        details["skipped"] = {"kernels": CUDA_ONLY}
    env = os.environ | ({TOKENIZER_ENV: str(check.tokenizer)} if check.tokenizer is not None else {})
    for name, args in runs.items():
        details[name] = pytest_run(check, args, env)
    if failed := [name for name in runs if details[name]["rc"] != 0]:
        raise StepFailed(f"pytest failed: {', '.join(failed)}", details)
    return details


def pytest_run(check: CheckConfig, args: list[str], env: dict[str, str]) -> dict:
    """pytest's exit code and summary line; where it fails, the failed tests and its output's tail
    (-v: the tail shows the tests that ran last; a test running over 60 s dumps every thread's stack)."""
    command = [sys.executable, "-m", "pytest", "-v", "-rfEs", "-p", "no:cacheprovider", "-o", "faulthandler_timeout=60"]
    command += ["--rootdir", str(check.repo), *args]
    try:
        done = subprocess.run(command, cwd=check.work, env=env, capture_output=True, text=True, timeout=remaining(check))
        rc, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:  # the tests that finished, and the one that did not
        rc, output = -1, "".join(o.decode(errors="replace") if isinstance(o, bytes) else o or "" for o in (e.stdout, e.stderr))
        output += f"\n(timed out after {e.timeout:.0f} s)"
    lines = output.strip().splitlines()
    result = {"rc": rc, "summary": lines[-1].strip("= ") if lines else ""}
    if rc != 0:
        result["failed"] = [line for line in lines if line.startswith(("FAILED ", "ERROR "))][:30]
        result["output_tail"] = output[-3000:]
    return result


def picks_cuda(test_file: Path) -> bool:
    """Whether a test file runs its tests on CUDA where there is one: it picks its device with
    `"cuda" if torch.cuda.is_available() else ...` (the kernel tests against their references; the
    other files' CUDA tests are `gpu`-marked)."""
    for node in ast.walk(ast.parse(test_file.read_text())):
        if isinstance(node, ast.IfExp) and isinstance(node.body, ast.Constant) and node.body.value == "cuda":
            if isinstance(node.test, ast.Call) and ast.unparse(node.test.func) == "torch.cuda.is_available":
                return True
    return False


def step_decode_matches_cpu(check: CheckConfig, sizes: Sizes) -> dict:
    """Greedy tokens on the device under test in float32 equal the CPU's, per model and mode; pulse
    at a covering budget also equals dense on each device."""
    from pulseinfer.gpu_worker.config import WorkerConfig
    from pulseinfer.gpu_worker.model.loader import load_model

    prompts = random_prompts(sizes.prompt_lengths)
    block = WorkerConfig.block_size  # make_engine's: a budget is whole blocks
    full_budget = -(-(max(sizes.prompt_lengths) + sizes.output_tokens) // block) * block
    modes = {"dense": None, "pulse_full": full_budget, "pulse_sparse": sizes.sparse_budget}
    details, failures = {}, []
    for geometry, layers in sizes.equality_models:
        path = model_dir(check, geometry, layers)
        loaded = materialized(load_model(path, "dummy"))
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


def make_engine(loaded, prompts: list[list[int]], sizes: Sizes, device: str, budget: int | None, dtype: str):
    """An in-process engine sized for the prompts: dense (budget None) or every request offloaded at `budget`."""
    from pulseinfer.engine import Engine, EngineConfig
    from pulseinfer.gpu_worker.config import WorkerConfig
    from pulseinfer.gpu_worker.offload.config import OffloadConfig
    from pulseinfer.scheduler.batcher import BatcherConfig

    tokens = sum(len(p) + sizes.output_tokens for p in prompts) + 64 * len(prompts)
    offload = OffloadConfig(sink=sizes.sink, recent=sizes.recent, budget=budget or sizes.sparse_budget)
    mode = "dense" if budget is None else "pulse"
    worker = WorkerConfig(mode=mode, device=device, dtype=dtype, device_kv_tokens=tokens, offload=offload)
    batcher = BatcherConfig(offload="never" if budget is None else "always")
    return Engine(EngineConfig(worker=worker, batcher=batcher, host_kv_tokens=tokens), loaded=loaded)


def greedy(loaded, prompts: list[list[int]], sizes: Sizes, device: str, budget: int | None) -> list[list[int]]:
    """Greedy tokens in float32 of one engine: dense (budget None) or every request offloaded at `budget`."""
    from pulseinfer.messages.sampling import SamplingParams

    engine = make_engine(loaded, prompts, sizes, device, budget, dtype="float32")
    try:
        return [c.token_ids for c in engine.generate(prompts, SamplingParams(max_tokens=sizes.output_tokens, ignore_eos=True))]
    finally:
        engine.close()  # unpins its host pool: the next engine maps one at the same address
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


def step_decode_syncs(check: CheckConfig, sizes: Sizes) -> dict:
    """Host syncs per decode step in the model's own dtype, counted by count_host_syncs (CUDA's sync
    debug mode), dense and pulse with every request offloaded at a sparse budget: each step's whole
    count, sampling and the offloaded rows' selections included, at most MAX_DECODE_STEP_SYNCS in
    every mode. The selections per step are reported beside the counts, not subtracted from them."""
    from pulseinfer.gpu_worker.model.loader import load_model

    loaded = materialized(load_model(model_dir(check, *sizes.syncs_model), "dummy"))
    prompts = random_prompts(sizes.prompt_lengths, seed=2)
    details: dict = {"limit_per_step": MAX_DECODE_STEP_SYNCS}
    failures = []
    for mode, budget in (("dense", None), ("pulse", sizes.sparse_budget)):
        engine = make_engine(loaded, prompts, sizes, check.device, budget, dtype="auto")
        try:
            counts, selections, other_threads, completions = decode_step_syncs(engine, prompts, sizes.output_tokens)
        finally:
            engine.close()
            if check.device == "cuda":
                torch.cuda.empty_cache()
        details[mode] = {
            "decode_steps": len(counts),
            "syncs_per_step": counts,
            "syncs_max": max(counts, default=0),
            "syncs_mean": sum(counts) / max(1, len(counts)),
            "selections_per_step": selections,  # why a pulse step may count more: each reads its misses back
            "other_threads": other_threads,  # the I/O thread's recalls: off the decode step's path
            "offloaded_requests": sum(c.offloaded for c in completions),
        }
        if not counts:
            failures.append(f"{mode}: no step decoded alone")
        if budget is not None and details[mode]["offloaded_requests"] != len(prompts):
            failures.append(f"{mode}: {details[mode]['offloaded_requests']} of {len(prompts)} requests were offloaded")
        if not check.cpu_dry_run and (over := syncs_over_limit(mode, counts)):
            failures.append(over)
    if check.cpu_dry_run:
        details["skipped"] = {"the sync count (torch.cuda.set_sync_debug_mode)": CUDA_ONLY}
    if failures:
        raise StepFailed("; ".join(failures), details)
    return details


def syncs_over_limit(mode: str, counts: list[int]) -> str | None:
    """Why `mode`'s decode steps fail: the most syncs one step made, when above MAX_DECODE_STEP_SYNCS
    (its whole count: nothing is subtracted); None when every step is within it."""
    most = max(counts, default=0)
    if most <= MAX_DECODE_STEP_SYNCS:
        return None
    return f"{mode}: up to {most} host syncs per decode step (the limit: {MAX_DECODE_STEP_SYNCS})"


def decode_step_syncs(engine, prompts: list[list[int]], max_tokens: int) -> tuple[list[int], list[int], int, list]:
    """Runs the prompts to their end one engine step at a time, each under count_host_syncs: for the
    steps that only decode, their syncs and their selections; the syncs of other threads in every
    step; and the completions."""
    from pulseinfer.common.syncs import count_host_syncs
    from pulseinfer.gpu_worker.offload.selection import RowSelector
    from pulseinfer.messages.sampling import SamplingParams

    for prompt in prompts:
        engine.submit(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    counts, selections, other_threads, completions = [], [], 0, []
    select, calls = RowSelector.select, [0]

    def counted_select(self, *args):
        calls[0] += 1
        return select(self, *args)

    RowSelector.select = counted_select  # this check's own process: restored below
    try:
        while len(completions) < len(prompts) or engine.batcher.released:
            calls[0] = 0
            with count_host_syncs() as syncs:
                completions += engine.step()
            other_threads += syncs.other_threads
            plan = engine.last_plan
            if plan is not None and plan.chunks and len(plan.decode_chunks) == len(plan.chunks):
                counts.append(syncs.count)
                selections.append(calls[0])
    finally:
        RowSelector.select = select
    return counts, selections, other_threads, completions


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
    """dense/headwise/pulse side by side (bench.decode: `pulseinfer bench decode`, its weights made once
    for every mode) on dummy weights of a realistic geometry, and on the default model when its file
    is installed; decode tok/s per mode and the ratios."""
    from pulseinfer.bench.decode import DecodeBenchConfig, run
    from pulseinfer.common.model.meta import ModelLoadError, default_model_path
    from pulseinfer.gpu_worker.model.loader import load_model

    runs = {"dummy": {"model": str(model_dir(check, *sizes.bench_model)), "load_format": "dummy", **sizes.bench_settings}}
    try:
        if sizes.default_bench_settings is not None and default_model_path().is_file():
            runs["default_model"] = sizes.default_bench_settings
    except ModelLoadError:
        pass
    details = {"default_model": "default_model" in runs or "not installed or a dry run: skipped"}
    for name, settings in runs.items():
        config = DecodeBenchConfig(device=check.device, modes="dense,headwise,pulse", **settings)
        result = run(config, materialized(load_model(config.model, config.load_format)))
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
    ("decode_syncs", step_decode_syncs),
    ("serve_stream", step_serve_stream),
    ("bench_decode", step_bench_decode),
)
