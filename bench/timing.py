"""Timing shared by the microbenchmarks."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path


def seconds_per_call(fn: Callable[[], object], repeats: int) -> float:
    """Mean wall time of fn over `repeats` calls, after one warm-up call."""
    fn()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats


def report(settings: object, results: dict, json_path: Path | None, width: int = 32) -> None:
    """Prints a microbenchmark's results, one per line, and writes them with its settings to json_path."""
    for key, value in results.items():
        print(f"{key:{width}s} {value:.3f}" if isinstance(value, float) else f"{key:{width}s} {value}")
    write_results(settings, results, json_path)


def write_results(settings: object, results: dict, json_path: Path | None) -> None:
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({"settings": dataclasses.asdict(settings), **results}, indent=1) + "\n")
