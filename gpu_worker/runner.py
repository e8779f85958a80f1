"""Executes step plans: builds the batch, runs the model, samples."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker.batch import build_batch
from gpu_worker.kv_cache import KVCacheSpec, PagedKVCache
from gpu_worker.model.llama import LlamaModel
from gpu_worker.model.loader import LoadedModel
from gpu_worker.sampler import sample
from scheduler.plan import SampledToken, StepPlan


@dataclass(frozen=True)
class WorkerConfig:
    device: str = "cpu"  # cpu | cuda
    dtype: str = "auto"  # auto: float32 on cpu, bfloat16 on cuda
    block_size: int = 16
    device_kv_tokens: int = 65536  # capacity of the device KV pool

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


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: WorkerConfig):
        self.config = config
        self.device = config.torch_device()
        dtype = config.torch_dtype()
        self.model = LlamaModel(loaded.config, loaded.weights, self.device, dtype)
        self.cache = PagedKVCache(loaded.config, config.cache_spec(), dtype, self.device)

    @property
    def cache_spec(self) -> KVCacheSpec:
        return self.cache.spec

    def execute(self, plan: StepPlan) -> list[SampledToken]:
        batch = build_batch(plan, self.cache.spec.block_size, self.device)
        logits = self.model.forward(batch, self.cache)
        sampled = [c for c in plan.chunks if c.sampling is not None]
        tokens = sample(logits, [c.sampling for c in sampled])
        return [SampledToken(c.seq_id, t) for c, t in zip(sampled, tokens)]
