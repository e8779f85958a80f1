"""The card's folders (kernels/, gateway/, scheduler/, ...) are packages of pulseinfer (pulseinfer.kernels, ...),
but Python run from the repository root finds them first under their bare names, before any installed package
of the same name: transformers' `import kernels` would get ours. A folder imported under its bare name hands
the name over to the installed package (or to none, as anywhere else)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path


def hand_over(name: str, init_file: str) -> None:
    """Run by the folder's __init__ when imported as `name`: sys.modules[name] becomes the package that
    `import name` finds without the repository root, and the import returns that."""
    root = Path(init_file).resolve().parent.parent
    path = [entry for entry in sys.path if Path(entry or ".").resolve() != root]
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"No module named {name!r} (the repository's {name}/ is pulseinfer.{name})", name=name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
