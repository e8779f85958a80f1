"""The seam between a model and its KV: a model hands each layer's (q, k, v) to the step's
attention backend, which stores k and v where they belong and returns the attention output.
Backends: `paged` (every request resident in the device cache) and `offloaded` (sparse
attention of offloaded requests over sink + selected host blocks + window, beside resident ones),
and `window` (sliding-window layers' rings, beside either, on models that have such layers)."""

from __future__ import annotations

from pulseinfer.common.model.config import ModelConfig
from pulseinfer.gpu_worker.attention.base import AttentionBackend
from pulseinfer.gpu_worker.attention.offloaded import OffloadedBackend
from pulseinfer.gpu_worker.attention.paged import PagedBackend
from pulseinfer.gpu_worker.attention.window import WindowCache, WindowedBackend
from pulseinfer.gpu_worker.kv_cache import PagedKVCache
from pulseinfer.gpu_worker.offload.manager import OffloadManager


def attention_backend(
    cache: PagedKVCache, offload: OffloadManager | None, window: WindowCache | None, config: ModelConfig
) -> AttentionBackend:
    """The offloaded backend on a worker that offloads, else the resident one; for the full layers
    only where the model has sliding-window layers, which attend their rings beside it."""
    full = PagedBackend(cache) if offload is None else OffloadedBackend(cache, offload)
    return full if window is None else WindowedBackend(full, window, config)
