"""Timing shared by the microbenchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable


def seconds_per_call(fn: Callable[[], object], repeats: int) -> float:
    """Mean wall time of fn over `repeats` calls, after one warm-up call."""
    fn()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats
