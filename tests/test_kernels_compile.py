"""The compile gate (bench/kernels_compile.py): every Triton kernel compiles for sm_90 at every shipped
geometry in bf16 without spills, and the gate fails what it should."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
from triton.runtime.jit import JITFunction

from pulseinfer.bench.kernels_compile import (
    DTYPES,
    MAX_SECONDS,
    SHARED_LIMITS,
    Compiled,
    KernelsCompileConfig,
    Row,
    _parse_list,
    _ptxas_report,
    main,
    module_cases,
    problems,
)
from pulseinfer.common.model.meta import GEOMETRIES, MODEL_NAMES
from pulseinfer.kernels.compile_cases import AttentionGeometry, CompileCase

KERNELS = Path(__file__).parent.parent / "kernels"


def test_every_kernel_compiles_for_hopper_in_bf16_at_every_geometry(tmp_path):
    report_path, table_path = tmp_path / "report.json", tmp_path / "table.md"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # conftest sets it; the gate compiles for CUDA
    args = ["bench", "kernels-compile", "--dtypes", "bf16", "--archs", "90", "--json", str(report_path), "--markdown", str(table_path)]
    result = subprocess.run([sys.executable, "-m", "pulseinfer.cli", *args], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report = json.loads(report_path.read_text())
    with_kernels = {path.stem for path in KERNELS.glob("*.py") if re.search(r"^@triton\.jit", path.read_text(), re.MULTILINE)}
    assert with_kernels and set(report["modules"]) == with_kernels
    geometries = {*MODEL_NAMES, *(p.name for p in GEOMETRIES.iterdir()), "mistral-window-4096"}
    assert {g["name"] for g in report["geometries"]} == geometries
    assert {row["module"] for row in report["rows"]} == with_kernels and {row["geometry"] for row in report["rows"]} == geometries
    for row in report["rows"]:
        c = row["compiled"]
        assert (row["dtype"], row["arch"]) == ("bf16", 90)
        assert not c["error"] and c["registers"] > 0 and c["spill_stores"] == c["spill_loads"] == 0, row
        assert c["shared"] <= SHARED_LIMITS[90] and c["seconds"] < MAX_SECONDS, row
    assert report["failures"] == [] and report["compiles"] < len(report["rows"])  # identical cases compiled once
    table = [line for line in table_path.read_text().splitlines() if line.startswith("| ") and "---" not in line]
    assert len(table) == 1 + len(report["rows"])  # the header, then one line per case (one target)


def _row(**compiled) -> Row:
    figures = {"registers": 40, "spill_stores": 0, "spill_loads": 0, "shared": 1024, "seconds": 0.5, **compiled}
    return Row("summary", "block_minmax", "qwen3-8b", "bf16", 80, Compiled(**figures), reused=False)


def test_the_gate_fails_spills_shared_memory_slow_compiles_and_errors():
    assert problems(_row()) == []
    assert problems(_row(shared=SHARED_LIMITS[80])) == []
    (spills,) = problems(_row(spill_stores=8, spill_loads=4))
    assert "spills" in spills
    (shared,) = problems(_row(shared=SHARED_LIMITS[80] + 1))
    assert "shared memory" in shared
    (slow,) = problems(_row(seconds=MAX_SECONDS))
    assert "compiles in" in slow
    (error,) = problems(_row(registers=0, error="CompilationError: at 3:4"))
    assert "does not compile" in error
    assert len(problems(_row(registers=0, spill_loads=4, shared=10**6))) == 3


def test_ptxas_report_is_parsed():
    log = (
        "ptxas info    : Compiling entry function '_k' for 'sm_80'\n"
        "ptxas info    : Function properties for _k\n"
        "    32 bytes stack frame, 12 bytes spill stores, 8 bytes spill loads\n"
        "ptxas info    : Used 255 registers, used 0 barriers, 392 bytes cmem[0]\n"
    )
    assert _ptxas_report(log) == (255, 12, 8)
    assert _ptxas_report("") == (0, 0, 0)  # no report: the gate fails it for its missing register count


def _kernel(x_ptr):
    pass


def _helper(x_ptr):
    pass


def _caller(x_ptr):
    _helper(x_ptr)


# JITFunction, not triton.jit: under the interpreter that gives interpreted functions, which the gate never sees
_kernel, _helper, _caller = JITFunction(_kernel), JITFunction(_helper), JITFunction(_caller)


def test_a_kernel_without_compile_cases_fails_the_gate():
    geometries = [AttentionGeometry("g", q_heads=4, kv_heads=2, head_dim=64)]
    module = types.ModuleType(__name__)  # JITFunctions belong to the module that defines their function
    module.kernel, module.helper, module.caller = _kernel, _helper, _caller
    (missing,) = module_cases("fake", module, geometries)[1]
    assert "no compile_cases" in missing and "_kernel" in missing
    module.compile_cases = lambda geometry, dtype: [CompileCase("caller", module.caller, {"x_ptr": "*fp32"}, {})]
    (uncovered,) = module_cases("fake", module, geometries)[1]
    assert "_kernel" in uncovered and "_helper" not in uncovered  # a kernel's callee is compiled with it
    every = [module.kernel, module.helper, module.caller]
    module.compile_cases = lambda geometry, dtype: [CompileCase(fn.__name__, fn, {"x_ptr": "*fp32"}, {}) for fn in every]
    cases, found = module_cases("fake", module, geometries)
    assert found == [] and len(cases) == 3 and all(len(listed) == 3 for listed in cases.values())  # bf16, fp16, fp32
    module.compile_cases = lambda geometry, dtype: 1 / 0
    (raised,) = module_cases("fake", module, geometries)[1]
    assert "ZeroDivisionError" in raised


def test_bad_flags_are_named():
    assert _parse_list("fp32, bf16", DTYPES, "dtypes") == ["fp32", "bf16"]
    assert _parse_list("80", SHARED_LIMITS, "archs", cast=int) == [80]
    with pytest.raises(ValueError, match="--dtypes: fp8; choose from bf16"):
        _parse_list("bf16,fp8", DTYPES, "dtypes")
    with pytest.raises(ValueError, match="--archs: 90,sm80"):
        _parse_list("90,sm80", SHARED_LIMITS, "archs", cast=int)
    with pytest.raises(ValueError, match="none given"):
        _parse_list(",", DTYPES, "dtypes")


@pytest.mark.skipif(not os.environ.get("TRITON_INTERPRET"), reason="checks the refusal under the interpreter")
def test_the_gate_refuses_to_run_under_the_interpreter():
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        main(KernelsCompileConfig())
