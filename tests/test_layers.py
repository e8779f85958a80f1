"""The project's layering, read from the source with `ast` (nothing is imported): no import cycle
between project modules, services that stay off gpu_worker, a ground floor (pulseinfer.common)
that imports no service, and processes that never need torch (the gateway) not importing it."""

from __future__ import annotations

import ast
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("pulseinfer", "proto", "kernels", "kv_store", "scheduler", "gpu_worker", "gateway", "bench")


def module_name(path: Path) -> str:
    """kv_store/x.py -> pulseinfer.kv_store.x; pulseinfer/common/__init__.py -> pulseinfer.common."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    if parts[0] != "pulseinfer":
        parts.insert(0, "pulseinfer")
    return ".".join(parts)


@cache
def project_files() -> dict[str, Path]:
    files = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "_pb2" in path.name:  # generated
                continue
            files[module_name(path)] = path
    return files


def imported_modules(path: Path, module: str, modules: dict[str, Path]) -> set[str]:
    """The project modules `module` imports (module level, in functions, under TYPE_CHECKING).
    `from a import b` imports a.b if that is a module (generated protobuf modules included), else a.
    The packages a submodule import runs on the way (their __init__) are not counted."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                base = package.split(".")
                source = ".".join(base[: len(base) - (node.level - 1)] + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{source}.{alias.name}"
                names.add(full if full in modules or "_pb2" in alias.name else source)
    targets = {resolve(name, modules) for name in names}
    return targets - {None, module}


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module `name` refers to: itself, or the longest project module it lies in
    (a.b.attr -> a.b). A generated protobuf module stays as named; not the project's: None."""
    if name != "pulseinfer" and not name.startswith("pulseinfer."):
        return None
    if "_pb2" in name:
        return name
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


@cache
def import_graph() -> dict[str, set[str]]:
    modules = project_files()
    return {module: imported_modules(path, module, modules) for module, path in modules.items()}


def imports_of(prefix: str) -> dict[str, set[str]]:
    return {m: targets for m, targets in import_graph().items() if m == prefix or m.startswith(prefix + ".")}


def violations(prefix: str, allowed) -> list[str]:
    """Each import by a module under `prefix` of a project module that `allowed` refuses."""
    return [f"{m} imports {t}" for m, targets in sorted(imports_of(prefix).items()) for t in sorted(targets) if not allowed(t)]


def under(*prefixes: str):
    return lambda name: any(name == p or name.startswith(p + ".") for p in prefixes)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle (a list of modules, first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_cycle_finder_reports_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_files_are_found():
    modules = project_files()
    assert "pulseinfer.kv_store.client" in modules and "pulseinfer.common.flags" in modules
    assert "pulseinfer.common.model" in modules and "pulseinfer.kv_store.layout" in modules
    assert import_graph()["pulseinfer.kv_store.server"] >= {"pulseinfer.kv_store.io_engine", "pulseinfer.kv_store.pool"}


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("service", ["kv_store", "scheduler", "gateway"])
def test_services_import_nothing_of_gpu_worker(service):
    assert violations(f"pulseinfer.{service}", lambda t: not under("pulseinfer.gpu_worker")(t)) == []


@pytest.mark.parametrize("service", ["scheduler", "gpu_worker", "gateway"])
def test_the_three_services_import_none_of_each_other(service):
    others = [f"pulseinfer.{name}" for name in ("scheduler", "gpu_worker", "gateway") if name != service]
    assert violations(f"pulseinfer.{service}", lambda t: not under(*others)(t)) == []


def test_common_imports_only_common():
    assert violations("pulseinfer.common", under("pulseinfer.common")) == []


def test_kv_store_layout_is_a_leaf():
    assert violations("pulseinfer.kv_store.layout", lambda t: False) == []


def test_model_imports_only_common_and_model():
    """Models are math: nothing of attention, caching or offloading."""
    assert violations("pulseinfer.gpu_worker.model", under("pulseinfer.common", "pulseinfer.gpu_worker.model")) == []


# floors, lowest first: a module imports its own folder and the floors below it, never above or beside
FLOORS = (
    ("pulseinfer.common",),
    ("pulseinfer.proto", "pulseinfer.kernels"),
    ("pulseinfer.messages",),  # what the processes say to each other: plans, sampling, limits, their wire form
    ("pulseinfer.kv_store",),
    ("pulseinfer.scheduler", "pulseinfer.gpu_worker", "pulseinfer.gateway"),  # peers: they share messages only
    ("pulseinfer", "pulseinfer.bench"),  # the CLI, launcher, in-process engine, evals, probes; benchmarks
)


def floor_of(module: str) -> tuple[int, str]:
    """(floor, folder) of a module: the longest folder prefix that holds it."""
    folders = [(rank, folder) for rank, floor in enumerate(FLOORS) for folder in floor if under(folder)(module)]
    return max(folders, key=lambda found: len(found[1]))


def test_no_module_imports_a_floor_above_or_beside_it():
    wrong = []
    for module, targets in sorted(import_graph().items()):
        rank, folder = floor_of(module)
        for target in sorted(targets):
            target_rank, target_folder = floor_of(target)
            if target_rank > rank or (target_rank == rank and target_folder != folder and rank < len(FLOORS) - 1):
                wrong.append(f"{module} imports {target}")
    assert wrong == []


@pytest.mark.parametrize("module", ["pulseinfer.gateway.__main__", "pulseinfer.common.model"])
def test_imports_without_torch(module, tmp_path):
    code = f"import {module}, sys; assert 'torch' not in sys.modules, 'torch imported'"
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("statement", ["import transformers.activations", "import kernels; assert 'site-packages' in kernels.__file__"])
def test_the_folders_do_not_shadow_installed_packages_from_the_repository_root(statement):
    """From the root, Python finds kernels/ (gateway/, ...) before site-packages: transformers imports
    Hugging Face's `kernels`, which must not be ours (pulseinfer.kernels)."""
    result = subprocess.run([sys.executable, "-c", statement], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_a_folder_under_its_bare_name_is_not_found_where_nothing_of_that_name_is_installed():
    result = subprocess.run([sys.executable, "-c", "import gpu_worker"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "No module named 'gpu_worker'" in result.stderr
