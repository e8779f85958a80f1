"""A worker's settings: device, dtype, its KV pool and attention mode, and its offloading."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

import torch

from pulseinfer.gpu_worker.kv_cache import KVCacheSpec
from pulseinfer.gpu_worker.offload.config import OffloadConfig
from pulseinfer.gpu_worker.sparse import MODES

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'80GB' (decimal units), '79.6GiB' (binary) or a plain number of bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if match is None or match[2].lower() not in UNITS:
        raise ValueError(f"--device-memory must be a size such as 80GB, 79.6GiB or 85899345920, got {text!r}")
    return int(float(match[1]) * UNITS[match[2].lower()])


@dataclass(frozen=True)
class WorkerConfig:
    # dense: every request resident, nothing offloaded; pulse: offloaded requests attend one block
    # selection per (request, layer) (SoloHead); headwise: one selection per kv head (the baseline)
    mode: str = "pulse"
    device: str = "cpu"  # cpu | cuda
    dtype: str = "auto"  # auto: float32 on cpu, bfloat16 on cuda
    block_size: int = 16
    device_kv_tokens: int = 65536  # capacity of the device KV pool (of the full-attention layers)
    # requests running at once on a model with sliding-window layers: each holds a ring of its
    # window per sliding layer on the device (the scheduler runs no more)
    max_running: int = 64
    # on a model with sliding-window layers: on keeps their KV of every device block beside the paged
    # cache (sliding / full layers times its size: 5x on Gemma 3), so the prefix cache can rebuild the
    # rings of a request starting from a cached prefix; off: such a model caches nothing
    window_history: str = "on"
    # the device memory the worker's memory plan (gpu_worker/memory_plan.py) must fit, e.g. 80GB or
    # 79.6GiB; empty: a CUDA device's total memory, and no check on the CPU
    device_memory: str = ""
    offload: OffloadConfig = field(default_factory=OffloadConfig)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.window_history not in ("on", "off"):
            raise ValueError(f"--window-history must be on or off, got {self.window_history!r}")
        if self.device_memory:
            parse_bytes(self.device_memory)  # a bad size fails with the flags, not when the worker starts

    def with_prefix_cache(self, prefix_cache: str) -> WorkerConfig:
        """This config for a scheduler whose prefix cache is `prefix_cache`: without it, no sliding-window history is kept."""
        return self if prefix_cache == "on" else replace(self, window_history="off")

    def torch_device(self) -> torch.device:
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda was requested but no CUDA device is available")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.device == "cuda" else torch.float32
        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        if self.dtype not in dtypes:
            raise ValueError(f"--dtype must be auto or one of {', '.join(dtypes)}, got {self.dtype!r}")
        return dtypes[self.dtype]

    def cache_spec(self) -> KVCacheSpec:
        if not 8 <= self.block_size <= 64:
            raise ValueError(f"--block-size must be in [8, 64], got {self.block_size}")
        return KVCacheSpec.for_tokens(self.device_kv_tokens, self.block_size)
