"""scripts/gpu_check.sh: its CPU dry run takes every step but the CUDA-only ones, a failure is
named in the exit code, on stderr and in the JSON, and a step that outlives its limit fails alone;
scripts/gpu_wheels.sh targets every CPython the check may meet."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pulseinfer.gpu_check import steps as check_steps
from pulseinfer.gpu_check.config import DRY_SIZES, GPU_SIZES, CheckConfig
from pulseinfer.gpu_check.harness import run_isolated, step_limit
from pulseinfer.gpu_check.steps import picks_cuda, syncs_over_limit

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
STEPS = ("install", "environment", "gpu_tests", "decode_matches_cpu", "decode_syncs", "serve_stream", "bench_decode")


def _check(tmp_path: Path, *flags: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "PYTHON": sys.executable, "TMPDIR": str(tmp_path)}
    done = subprocess.run([str(SCRIPT), "--out", str(out), *flags], env=env, capture_output=True, text=True, timeout=900)
    return done, json.loads(out.read_text())


def test_the_cpu_dry_run_takes_every_step_but_the_cuda_only_ones(tmp_path):
    # no wheelhouse (CI has none): the install goes over this Python's packages
    done, report = _check(tmp_path, "--cpu-dry-run", "--wheelhouse", str(tmp_path / "none"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert {s["name"]: s["status"] for s in report["steps"]} == {name: "passed" for name in STEPS} and report["failed"] == []
    assert report["skipped"] == {  # what only CUDA can run, named
        "gpu_tests: kernels": "CUDA only",
        "decode_matches_cpu: the CUDA side (the CPU is compared with itself)": "CUDA only",
        "decode_syncs: the sync count (torch.cuda.set_sync_debug_mode)": "CUDA only",
        "serve_stream: CUDA IPC (recalls land in the worker's shared-memory segment)": "CUDA only",
    }
    steps = {s["name"]: s["details"] for s in report["steps"]}
    assert steps["gpu_tests"]["gpu_marked"]["rc"] == 0  # collected and run from the installed copy: each skips itself
    assert "skipped" in steps["gpu_tests"]["gpu_marked"]["summary"]
    kernel_files = [p.name for p in sorted(REPO.glob("tests/test_*.py")) if picks_cuda(p)]
    assert "test_kernels.py" in kernel_files and steps["gpu_tests"]["kernel_files"] == kernel_files
    assert steps["environment"]["pulseinfer_imported_from"].startswith(steps["install"]["site"])  # the offline copy
    assert set(steps["decode_matches_cpu"]) == {"qwen3-0.6b-2l-tiny", "gemma-3-4b-2l-tiny", "skipped"}
    for rows in (steps["decode_matches_cpu"][name] for name in ("qwen3-0.6b-2l-tiny", "gemma-3-4b-2l-tiny")):
        assert set(rows) == {"dense", "pulse_full", "pulse_sparse"} and all(row["equal"] for row in rows.values())
    for mode in ("dense", "pulse"):  # the same steps CUDA counts the syncs of
        assert steps["decode_syncs"][mode]["decode_steps"] > 0
    assert steps["decode_syncs"]["pulse"]["offloaded_requests"] == 2
    serve = steps["serve_stream"]
    assert serve["completion_tokens"] == 8 and serve["finish_reason"] == "length" and serve["serve_exit_code"] == 0
    assert serve["offloaded_admissions_total"] == 1 and serve["recall_units_total"] > 0 and serve["kv_store_engine_recalls_total"] > 0
    bench = steps["bench_decode"]
    assert [m["mode"] for m in bench["dummy"]["modes"]] == ["dense", "headwise", "pulse"]
    assert bench["dummy"]["ratios"]["pulse_over_dense_decode_tok_s"] > 0
    assert bench["default_model"] == "not installed or a dry run: skipped"
    assert not list(tmp_path.glob("pulseinfer-gpu-check.*"))  # the throw-away install is gone


def test_a_missing_wheelhouse_fails_the_install_step_by_name(tmp_path):
    done, report = _check(tmp_path, "--wheelhouse", str(tmp_path))
    assert done.returncode == 1
    assert "step install FAILED" in done.stderr and "make gpu-wheels" in done.stderr
    assert report["failed"] == ["install"] and "make gpu-wheels" in report["steps"][0]["error"]


def test_without_cuda_the_check_asks_for_the_dry_run(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "pulseinfer.gpu_check", "--repo", ".", "--work", str(tmp_path), "--out", str(tmp_path / "x.json")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.returncode == 2 and "--cpu-dry-run" in done.stderr


def test_a_wheelhouse_without_this_python_names_it_and_the_command_before_installing(tmp_path):
    wheelhouse = tmp_path / "wheelhouse"
    wheelhouse.mkdir()
    (wheelhouse / "anything-1.0-py3-none-any.whl").write_bytes(b"")
    (wheelhouse / "requirements-cp39.txt").write_text("anything==1.0\n")
    done, report = _check(tmp_path, "--wheelhouse", str(wheelhouse))
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    assert done.returncode == 1 and report["failed"] == ["install"]
    for message in (done.stderr, report["steps"][0]["error"]):
        assert f"no wheels for {sys.executable} (CPython {version}); it has: cp39" in message
        assert f"make gpu-wheels GPU_PYTHONS={version}" in message


def test_the_wheelhouse_targets_every_cpython_from_the_projects_floor_to_3_13():
    """Ubuntu 22.04 and older NGC images bring 3.10, the Dockerfile 3.11, newer images 3.12 and 3.13;
    each target's pip flags name its own version and ABI (no download: the targets are printed)."""
    done = subprocess.run([str(REPO / "scripts" / "gpu_wheels.sh"), "--print-targets"], capture_output=True, text=True, check=True)
    targets = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    floor = re.search(r'^requires-python = ">=3\.(\d+)"$', (REPO / "pyproject.toml").read_text(), re.MULTILINE)
    assert list(targets) == [f"3.{minor}" for minor in range(int(floor[1]), 14)]
    for version, flags in targets.items():
        assert f"--python-version {version} --implementation cp --abi cp{version.replace('.', '')} --abi abi3" in flags


def test_the_serving_and_recall_steps_run_before_the_benchmark():
    """A benchmark that hangs or runs out of time must not cost the checks of serving and CUDA IPC."""
    assert [name for name, _ in check_steps.STEPS] == list(STEPS)
    assert STEPS.index("serve_stream") < STEPS.index("bench_decode") == len(STEPS) - 1


def test_a_decode_step_above_one_host_sync_fails_whatever_made_them():
    """The whole count of a step is held to the limit: a selection's read-back or the sampler's is
    not subtracted."""
    assert syncs_over_limit("dense", [1, 1, 0]) is None
    assert syncs_over_limit("pulse", [1, 2, 1]) == "pulse: up to 2 host syncs per decode step (the limit: 1)"


def test_every_step_has_a_budget_and_the_budgets_fit_the_deadline():
    for sizes in (GPU_SIZES, DRY_SIZES):
        assert list(sizes.budgets_s) == list(STEPS)  # in the order they run
        assert sum(sizes.budgets_s.values()) <= CheckConfig.deadline_s


def test_a_step_gets_at_least_its_budget_and_what_earlier_steps_left_never_past_the_deadline():
    budget = GPU_SIZES.budgets_s["decode_matches_cpu"]
    later = sum(GPU_SIZES.budgets_s[name] for name in STEPS[STEPS.index("decode_matches_cpu") + 1 :])
    fresh = CheckConfig(repo=REPO, work=REPO, out=REPO)
    for left, limit in ((fresh.deadline_s, fresh.deadline_s - later), (later + budget - 50, budget), (30, 30)):
        check = dataclasses.replace(fresh, started=time.monotonic() - (fresh.deadline_s - left))
        assert step_limit(check, GPU_SIZES, "decode_matches_cpu") == pytest.approx(limit, abs=1)


def test_a_step_past_its_limit_fails_alone_with_its_output(tmp_path):
    check = CheckConfig(repo=REPO, work=tmp_path, out=tmp_path / "x.json", cpu_dry_run=True)
    result = run_isolated(check, ["--repo", str(REPO), "--work", str(tmp_path), "--out", "x", "--cpu-dry-run"], "environment", 0.3)
    assert result.name == "environment" and result.status == "failed" and result.error.startswith("timed out after 0 s")
    assert "output_tail" in result.details and not (tmp_path / "step_environment.json").exists()


def test_kernel_tests_are_the_files_that_pick_cuda_where_there_is_one(tmp_path):
    sources = {
        'DEVICE = "cuda" if torch.cuda.is_available() else "cpu"': True,
        "def device():\n    return torch.device('cuda' if torch.cuda.is_available() else 'cpu')": True,
        'expected = "CUDA IPC" if torch.cuda.is_available() else "no CUDA"': False,  # not a device
        'DEVICE = "cpu"  # "cuda" if torch.cuda.is_available() in a comment': False,
        "from pulseinfer.kernels.decode_triton import paged_decode_attention_triton": False,  # a CPU test may use a kernel too
    }
    for i, (source, found) in enumerate(sources.items()):
        path = tmp_path / f"test_{i}.py"
        path.write_text(source + "\n")
        assert picks_cuda(path) == found, source
