"""The check's driver: each step in a process of its own under its time limit (python -m
pulseinfer.gpu_check ... --step NAME), and the JSON of the results, rewritten after every step."""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from pulseinfer import gpu_check
from pulseinfer.gpu_check.config import DRY_SIZES, GPU_SIZES, CheckConfig, Sizes, StepFailed, StepSkipped
from pulseinfer.gpu_check.steps import STEPS

# a step's own time limits end this much before the check ends its process, so that it still reports
STEP_GRACE_S = 10.0


@dataclass
class StepResult:
    name: str
    status: str  # passed | failed | skipped
    seconds: float = 0.0
    details: dict = dataclasses.field(default_factory=dict)
    error: str = ""


def run_step(check: CheckConfig, sizes: Sizes, name: str) -> StepResult:
    """One step in this process: its failure (or crash) is its result."""
    started = time.perf_counter()
    try:
        details, status, error = dict(STEPS)[name](check, sizes), "passed", ""
    except StepSkipped as e:
        details, status, error = {}, "skipped", str(e)
    except StepFailed as e:
        details, status, error = e.details, "failed", str(e)
    except Exception as e:
        details, status, error = {"traceback": traceback.format_exc()[-3000:]}, "failed", f"{type(e).__name__}: {e}"
    return StepResult(name, status, time.perf_counter() - started, details, error)


def step_limit(check: CheckConfig, sizes: Sizes, name: str) -> float:
    """A step's seconds: at least its budget, more where earlier steps left time that the later
    steps' budgets do not claim, never past the deadline."""
    names = [n for n, _ in STEPS]
    later = sum(sizes.budgets_s[n] for n in names[names.index(name) + 1 :])
    left = check.deadline_s - (time.monotonic() - check.started)
    return min(left, max(sizes.budgets_s[name], left - later))


def run_isolated(check: CheckConfig, argv: list[str], name: str, limit_s: float) -> StepResult:
    """One step in a child process of its own session (python -m pulseinfer.gpu_check ... --step
    NAME), ended with every process it started when it outlives `limit_s`; a child that ends
    without a result fails the step with its exit code and its output's tail."""
    result_path, log_path = check.work / f"step_{name}.json", check.work / f"step_{name}.log"
    result_path.unlink(missing_ok=True)
    own = ["--step", name, "--out", str(result_path), "--deadline-s", str(max(1.0, limit_s - STEP_GRACE_S))]
    command = [sys.executable, "-m", "pulseinfer.gpu_check", *argv, *own]  # argparse: the last of a flag wins
    started = time.perf_counter()
    with log_path.open("w") as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            error = "" if child.wait(timeout=limit_s) == 0 else f"its process exited {child.returncode}"
        except subprocess.TimeoutExpired:
            error = f"timed out after {limit_s:.0f} s: ended with the processes it started"
        end_session(child)
    if not error and result_path.is_file():
        return StepResult(**json.loads(result_path.read_text()))
    error = error or "its process ended without a result"
    return StepResult(name, "failed", time.perf_counter() - started, {"output_tail": log_path.read_text(errors="replace")[-6000:]}, error)


def end_session(child: subprocess.Popen) -> None:
    """SIGTERM to a step's session if its process still runs (servers shut down), then SIGKILL to
    whatever of the session is left: no step leaves a process holding the GPU to the next."""
    if child.poll() is None:
        _signal_group(child.pid, signal.SIGTERM)
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    _signal_group(child.pid, signal.SIGKILL)
    child.wait()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:  # the session has ended
        pass


def skipped(results: list[StepResult]) -> dict[str, str]:
    """Steps skipped, and the parts of steps that ran, with why: 'step' or 'step: part' -> reason."""
    out = {r.name: r.error for r in results if r.status == "skipped"}
    for r in results:
        out |= {f"{r.name}: {part}": why for part, why in r.details.get("skipped", {}).items()}
    return out


def write_report(check: CheckConfig, results: list[StepResult], running: str | None) -> list[str]:
    """The JSON of the steps so far (`running`: the one under way); returns the failed steps."""
    failed = [r.name for r in results if r.status == "failed"]
    report = {
        "device": check.device,
        "cpu_dry_run": check.cpu_dry_run,
        "seconds": time.monotonic() - check.started,
        "failed": failed,
        "skipped": skipped(results),
        "steps": [dataclasses.asdict(r) for r in results],
    }
    if running is not None:
        report["running"] = running
    check.out.parent.mkdir(parents=True, exist_ok=True)
    check.out.write_text(json.dumps(report, indent=1) + "\n")
    return failed


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m pulseinfer.gpu_check", description=gpu_check.__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cpu-dry-run", action="store_true")
    parser.add_argument("--tokenizer", type=Path)
    parser.add_argument("--install-report", type=Path)
    parser.add_argument("--deadline-s", type=float, default=CheckConfig.deadline_s)
    parser.add_argument("--step", choices=[name for name, _ in STEPS], help="run this step alone, in this process; its result to --out")
    args = vars(parser.parse_args(argv))
    step = args.pop("step")
    check = CheckConfig(**args)
    if not check.cpu_dry_run and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu-dry-run to check the steps on the CPU", file=sys.stderr)
        return 2
    sizes = DRY_SIZES if check.cpu_dry_run else GPU_SIZES
    if step is not None:
        # a hang's stacks, every thread's, in the output the check keeps before it ends this process
        faulthandler.dump_traceback_later(check.deadline_s + STEP_GRACE_S / 2)
        check.out.write_text(json.dumps(dataclasses.asdict(run_step(check, sizes, step))))
        return 0
    results: list[StepResult] = []
    for name, _ in STEPS:
        limit_s = step_limit(check, sizes, name)
        if limit_s < 1:
            result = StepResult(name, "skipped", error=f"the check's {check.deadline_s:.0f} s were spent before it started")
        else:
            write_report(check, results, running=name)
            result = run_isolated(check, argv, name, limit_s)
        print(f"step {name}: {result.status} ({result.seconds:.1f} s){' - ' + result.error if result.error else ''}", flush=True)
        results.append(result)
    failed = write_report(check, results, running=None)
    verdict = f"FAILED: {', '.join(failed)}" if failed else "all steps passed"
    print(f"{verdict}; results in {check.out}", file=sys.stderr if failed else sys.stdout)
    return 1 if failed else 0
