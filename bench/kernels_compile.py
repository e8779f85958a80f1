"""The compile gate: every Triton kernel of kernels/, compiled for Hopper (sm_90) and Ampere (sm_80)
at the attention geometry of every shipped config, on the CPU (no GPU: Triton's own ptxas runs here).

    pulseinfer bench kernels-compile [--dtypes bf16,fp16,fp32] [--archs 90,80] [--geometries all|NAME,...] [--json OUT] [--markdown OUT]

Each kernel module with a `@triton.jit` function gives its cases through `compile_cases`
(kernels/compile_cases.py); a module without one, or a kernel no case compiles, fails the gate.
Per case: the registers and spills ptxas reports for the compile, the shared memory of the
compiled metadata, and the compile's seconds. The gate: every case compiles, without spills,
within the target's shared memory per block, in under 60 s. Identical cases (the same kernel,
signature, constexprs, options and target) compile once per run; Triton's cache lives in a
fresh folder for the run, so no run reuses another's compiles.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import json
import os
import pkgutil
import platform
import re
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas_version
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from pulseinfer.common.model.meta import GEOMETRIES, MODEL_NAMES, load_model_config
from pulseinfer.kernels.compile_cases import AttentionGeometry, CompileCase

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# the most shared memory one block may opt into, in bytes (the CUDA programming guide's per-arch table)
SHARED_LIMITS = {90: 232448, 80: 166912}
MAX_SECONDS = 60.0
# Mistral 7B's attention: every layer windowed. No config of it ships; its numbers are Mistral-7B-v0.1's config.json.
MISTRAL_WINDOW = AttentionGeometry("mistral-window-4096", q_heads=32, kv_heads=8, head_dim=128, window=4096)
KERNELS_PACKAGE = "pulseinfer.kernels"


@dataclass(frozen=True)
class KernelsCompileConfig:
    dtypes: str = "bf16,fp16,fp32"  # comma-separated: bf16, fp16, fp32
    archs: str = "90,80"  # comma-separated compute capabilities: 90 (Hopper), 80 (Ampere)
    geometries: str = "all"  # all, or comma-separated names (the models' names, the geometries/ configs, mistral-window-4096)


@dataclass(frozen=True)
class Compiled:
    """One compile on one target: ptxas's report and the compiled metadata."""

    registers: int  # 0: ptxas reported none
    spill_stores: int  # bytes
    spill_loads: int
    shared: int  # bytes per block
    seconds: float
    error: str = ""  # why it did not compile; empty when it did


@dataclass(frozen=True)
class Row:
    module: str  # the kernel's module in kernels/, e.g. "summary"
    kernel: str  # the case's name
    geometry: str
    dtype: str
    arch: int
    compiled: Compiled
    reused: bool  # the same compile as an earlier row of the run


# ---------------------------------------------------------------- what is compiled


def shipped_geometries() -> list[AttentionGeometry]:
    """The attention geometry of every model --model names: the installed models and the geometries/
    configs, read from their headers and config.json (no weights), and the Mistral-style window."""
    names = [*MODEL_NAMES, *sorted(p.name for p in GEOMETRIES.iterdir() if (p / "config.json").is_file())]
    geometries = []
    for name in names:
        c = load_model_config(name)
        geometries.append(AttentionGeometry(name, c.num_heads, c.num_kv_heads, c.head_dim, window=c.sliding_window))
    return [*geometries, MISTRAL_WINDOW]


def kernel_modules() -> dict[str, ModuleType]:
    """Every module of kernels/ that defines a @triton.jit function, by its name."""
    package = importlib.import_module(KERNELS_PACKAGE)
    modules = {info.name: importlib.import_module(f"{KERNELS_PACKAGE}.{info.name}") for info in pkgutil.iter_modules(package.__path__)}
    return {name: module for name, module in modules.items() if jit_functions(module)}


def jit_functions(module: ModuleType) -> list[JITFunction]:

    return [value for value in vars(module).values() if isinstance(value, JITFunction) and value.__module__ == module.__name__]


Cases = dict[tuple[str, str], list[CompileCase]]  # by (geometry name, dtype name)


def module_cases(name: str, module: ModuleType, geometries: Iterable[AttentionGeometry]) -> tuple[Cases, list[str]]:
    """The module's cases at every geometry and dtype, and why its kernels could escape the gate: no
    compile_cases, compile_cases failing, or a kernel that no case compiles nor any compiled kernel calls."""
    if not hasattr(module, "compile_cases"):
        kernels = ", ".join(fn.__name__ for fn in jit_functions(module))
        return {}, [f"kernels/{name}.py has @triton.jit kernels ({kernels}) but no compile_cases (kernels/compile_cases.py)"]
    cases = {}
    for geometry in geometries:
        for dtype_name, dtype in DTYPES.items():
            try:
                cases[geometry.name, dtype_name] = module.compile_cases(geometry, dtype)
            except Exception as e:  # noqa: BLE001 - the gate names it instead of stopping
                return {}, [f"kernels/{name}.py: compile_cases({geometry.name}, {dtype_name}) raised {type(e).__name__}: {e}"]
    reached = _reached({case.fn for listed in cases.values() for case in listed}, jit_functions(module))
    missed = [fn.__name__ for fn in jit_functions(module) if fn not in reached]
    return cases, [f"kernels/{name}.py: no compile case compiles {', '.join(missed)}"] if missed else []


def _reached(kernels: set[JITFunction], functions: list[JITFunction]) -> set[JITFunction]:
    """The kernels and the functions they call, directly or through others (by name in their source)."""
    reached, grew = set(kernels), True
    while grew:
        called = {fn for fn in functions if fn not in reached and any(re.search(rf"\b{fn.__name__}\(", r.src) for r in reached)}
        reached |= called
        grew = bool(called)
    return reached


# ---------------------------------------------------------------- compiling


def _aligned_pointers(case: CompileCase) -> dict:
    """Every pointer argument 16-byte aligned, as torch's allocations are: Triton's launcher
    specializes a kernel on that (tt.divisibility), and the code it vectorizes differs."""
    pointers = [name for name, kind in case.signature.items() if kind.startswith("*")]
    return {(case.fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in pointers}


def _ptxas_report(log: str) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) of ptxas -v's report; 0 registers if it has none."""
    registers = [int(n) for n in re.findall(r"Used (\d+) registers", log)]
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return max(registers, default=0), sum(int(s) for s, _ in spills), sum(int(load) for _, load in spills)


def compile_case(case: CompileCase, arch: int) -> Compiled:
    """Compiles one case for sm_`arch`. Triton's compile runs ptxas -v and, with its log knob on,
    prints ptxas's report, which is read here: no second ptxas run."""
    source = ASTSource(case.fn, case.signature, case.constexprs, attrs=_aligned_pointers(case))
    log = io.StringIO()
    start = time.perf_counter()
    try:
        with knobs.nvidia.scope(), knobs.compilation.scope(), contextlib.redirect_stdout(log):
            knobs.nvidia.dump_ptxas_log = True
            knobs.compilation.always_compile = True  # a cache hit would print no report
            kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=dict(case.options))
    except Exception as e:  # noqa: BLE001 - a compile error is the gate's finding, not the bench's failure
        return Compiled(0, 0, 0, 0, time.perf_counter() - start, error=f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
    seconds = time.perf_counter() - start
    registers, stores, loads = _ptxas_report(log.getvalue())
    return Compiled(registers, stores, loads, kernel.metadata.shared, seconds)


def _case_key(case: CompileCase, arch: int) -> tuple:
    return (case.fn, *(tuple(sorted(d.items())) for d in (case.signature, case.constexprs, case.options)), arch)


@contextlib.contextmanager
def _fresh_triton_cache() -> Iterator[None]:
    """Triton's cache in a folder of this run's own, removed after it."""
    with tempfile.TemporaryDirectory(prefix="pulseinfer-kernels-compile-") as folder, knobs.cache.scope():
        knobs.cache.dir = folder
        yield


def compile_all(cases: dict[str, Cases], geometries: list[AttentionGeometry], dtypes: list[str], archs: list[int]) -> Iterator[Row]:
    """Every module's cases at every chosen geometry, dtype and target, each distinct case compiled once."""
    done: dict[tuple, Compiled] = {}
    with _fresh_triton_cache():
        for geometry in geometries:
            for dtype in dtypes:
                for name, by_shape in cases.items():
                    for case in by_shape[geometry.name, dtype]:
                        for arch in archs:
                            key = _case_key(case, arch)
                            reused = key in done
                            if not reused:
                                done[key] = compile_case(case, arch)
                            yield Row(name, case.kernel, geometry.name, dtype, arch, done[key], reused)


# ---------------------------------------------------------------- the gate


def problems(row: Row) -> list[str]:
    """What fails the gate in one row; none when it passes."""
    c = row.compiled
    if c.error:
        return [f"does not compile: {c.error}"]
    found = []
    if c.registers <= 0:
        found.append("ptxas reported no register count")
    if c.spill_stores or c.spill_loads:
        found.append(f"spills ({c.spill_stores} bytes stored, {c.spill_loads} loaded)")
    if c.shared > SHARED_LIMITS[row.arch]:
        found.append(f"{c.shared} bytes of shared memory, over sm_{row.arch}'s {SHARED_LIMITS[row.arch]}")
    if c.seconds >= MAX_SECONDS:
        found.append(f"compiles in {c.seconds:.1f} s (the limit: {MAX_SECONDS:.0f} s)")
    return found


def _figures(c: Compiled) -> list[str]:
    """Registers, spill bytes (stored/loaded) and shared memory bytes, as the reports write them."""
    return ["error", "", ""] if c.error else [str(c.registers), f"{c.spill_stores}/{c.spill_loads}", str(c.shared)]


def _describe(row: Row) -> str:
    return f"{row.module}.{row.kernel} {row.geometry} {row.dtype} sm_{row.arch}"


def _parse_list(text: str, known: Iterable, what: str, cast=str) -> list:
    known = list(known)
    try:
        chosen = [cast(item.strip()) for item in text.split(",") if item.strip()]
    except ValueError:
        chosen = [text]
    unknown = [item for item in chosen if item not in known]
    if unknown or not chosen:
        raise ValueError(f"--{what}: {', '.join(map(str, unknown)) or 'none given'}; choose from {', '.join(map(str, known))}")
    return chosen


def _select_geometries(text: str, geometries: list[AttentionGeometry]) -> list[AttentionGeometry]:
    if text == "all":
        return geometries
    chosen = _parse_list(text, [g.name for g in geometries], "geometries")
    return [g for g in geometries if g.name in chosen]


def _tool_versions(archs: list[int]) -> dict[str, str]:
    ptxas = {f"ptxas sm_{arch}": re.search(r"release [\d.]+", get_ptxas_version(arch)).group(0) for arch in archs}
    return {"triton": triton.__version__, **ptxas}


def markdown(rows: list[Row], archs: list[int], command: str, machine: str, tools: dict[str, str]) -> str:
    """One line per kernel, geometry and dtype; per target its registers, spill bytes (stored/loaded),
    shared memory bytes and compile seconds (in parentheses: an identical case's compile, reused)."""
    header = ["kernel", "geometry", "dtype"]
    for arch in archs:
        header += [f"sm_{arch} regs", "spills", "smem", "s"]
    lines = [
        f"`{command}` on {machine}; {', '.join(f'{k} {v}' for k, v in tools.items())}.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    cells: dict[tuple, dict[int, Row]] = {}
    for row in rows:
        cells.setdefault((row.module, row.kernel, row.geometry, row.dtype), {})[row.arch] = row
    for (module, kernel, geometry, dtype), by_arch in cells.items():
        line = [f"{module}.{kernel}", geometry, dtype]
        for arch in archs:
            c = by_arch[arch].compiled
            line += [*_figures(c), f"({c.seconds:.2f})" if by_arch[arch].reused else f"{c.seconds:.2f}"]
        lines.append("| " + " | ".join(line) + " |")
    return "\n".join(lines) + "\n"


def _command(config: KernelsCompileConfig) -> str:
    return f"pulseinfer bench kernels-compile --dtypes {config.dtypes} --archs {config.archs} --geometries {config.geometries}"


def _check_interpreter_off() -> None:
    if knobs.runtime.interpret:
        raise ValueError("kernels-compile compiles for CUDA targets: unset TRITON_INTERPRET (its kernels would be the interpreter's)")


def main(config: KernelsCompileConfig, json_path: Path | None = None, markdown_path: Path | None = None) -> int:
    _check_interpreter_off()
    dtypes = _parse_list(config.dtypes, DTYPES, "dtypes")
    archs = _parse_list(config.archs, SHARED_LIMITS, "archs", cast=int)
    every_geometry = shipped_geometries()
    geometries = _select_geometries(config.geometries, every_geometry)
    modules = kernel_modules()
    cases, failures = {}, []
    for name, module in modules.items():
        cases[name], found = module_cases(name, module, every_geometry)
        failures += found
    start = time.perf_counter()
    rows = []
    for row in compile_all(cases, geometries, dtypes, archs):
        rows.append(row)
        found = problems(row)
        failures += [f"{_describe(row)}: {problem}" for problem in found]
        if not row.reused:
            registers, spills, shared = _figures(row.compiled)
            status = "; ".join(found) or "ok"
            print(f"{_describe(row):60s} regs {registers:>3s} spills {spills:>5s} smem {shared:>6s} {row.compiled.seconds:6.2f} s {status}")
    seconds = time.perf_counter() - start
    compiles = sum(not row.reused for row in rows)
    print(f"{len(rows)} cases, {compiles} compiles, {seconds:.1f} s; {len(modules)} kernel modules: {', '.join(modules)}")
    for failure in failures:
        print(f"FAIL {failure}")
    print("gate: " + (f"{len(failures)} failures" if failures else "pass"))
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"  # none needed: its name only describes the machine
    machine = f"{platform.machine()} CPU, {os.cpu_count()} cores, {gpu}"
    tools = _tool_versions(archs)
    if json_path:
        report = {
            "settings": dataclasses.asdict(config),
            "machine": machine,
            "tools": tools,
            "limits": {"shared": SHARED_LIMITS, "seconds": MAX_SECONDS},
            "modules": list(modules),
            "geometries": [dataclasses.asdict(g) for g in geometries],
            "seconds": seconds,
            "compiles": compiles,
            "rows": [{**dataclasses.asdict(row), "problems": problems(row)} for row in rows],
            "failures": failures,
        }
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=1))
    if markdown_path:
        markdown_path.parent.mkdir(parents=True, exist_ok=True)
        markdown_path.write_text(markdown(rows, archs, _command(config), machine, tools))
    return 1 if failures else 0
