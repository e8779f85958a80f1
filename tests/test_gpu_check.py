"""scripts/gpu_check.sh: its CPU dry run takes every step but the CUDA-only ones, and a failure is
named in the exit code, on stderr and in the JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"
STEPS = ("install", "environment", "gpu_tests", "decode_matches_cpu", "serve_stream", "bench_decode")


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
        "serve_stream: CUDA IPC (recalls land in the worker's shared-memory segment)": "CUDA only",
    }
    steps = {s["name"]: s["details"] for s in report["steps"]}
    assert steps["gpu_tests"]["gpu_marked"]["rc"] == 0  # collected and run from the installed copy: each skips itself
    assert "skipped" in steps["gpu_tests"]["gpu_marked"]["summary"]
    assert steps["environment"]["pulseinfer_imported_from"].startswith(steps["install"]["site"])  # the offline copy
    assert set(steps["decode_matches_cpu"]) == {"qwen3-0.6b-2l-tiny", "gemma-3-4b-2l-tiny", "skipped"}
    for rows in (steps["decode_matches_cpu"][name] for name in ("qwen3-0.6b-2l-tiny", "gemma-3-4b-2l-tiny")):
        assert set(rows) == {"dense", "pulse_full", "pulse_sparse"} and all(row["equal"] for row in rows.values())
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
