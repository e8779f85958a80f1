"""The seam between a model and its KV: a model hands each layer's (q, k, v) to the step's
attention backend, which stores k and v where they belong and returns the attention output.
Backends: `paged` (every request resident in the device cache) and `offloaded` (sparse
attention of offloaded requests over sink + selected host blocks + window, beside resident ones)."""

from __future__ import annotations

from pulseinfer.gpu_worker.attention.base import AttentionBackend
from pulseinfer.gpu_worker.attention.offloaded import OffloadedBackend
from pulseinfer.gpu_worker.attention.paged import PagedBackend
from pulseinfer.gpu_worker.kv_cache import PagedKVCache
from pulseinfer.gpu_worker.offload.manager import OffloadManager


def attention_backend(cache: PagedKVCache, offload: OffloadManager | None) -> AttentionBackend:
    """The offloaded backend on a worker that offloads, else the resident one."""
    return PagedBackend(cache) if offload is None else OffloadedBackend(cache, offload)
