"""Offloading's settings and geometry: the flags (OffloadConfig), the device footprint of one
offloaded request in blocks (OffloadGeometry), and the host tier a worker offloads to (HostTier)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from pulseinfer.gpu_worker.kv_cache import PagedKVCache
from pulseinfer.gpu_worker.sparse import SCORERS
from pulseinfer.kv_store.client import RemoteRecall
from pulseinfer.kv_store.prefix_cache import HostPrefix
from pulseinfer.kv_store.view import PoolView


class HostAllocator(HostPrefix, Protocol):
    """The host pool's blocks and their prefix cache: kv_store's HostBlocks in-process, or
    KVStoreClient across processes (the in-process engine's batcher asks it as its HostPrefix)."""

    def allocate(self, owner: str, count: int) -> list[int]: ...

    def release(self, owner: str) -> int: ...

    def insert(self, names: list[bytes], blocks: list[int], owner: str = "") -> None: ...

    def reserve(self, owner: str, names: list[bytes]) -> list[int]: ...


@dataclass(frozen=True)
class HostTier:
    """The host pool as a worker uses it: a mapping for the data, an allocator for the blocks."""

    view: PoolView
    allocator: HostAllocator
    reattach: Callable[[], PoolView] | None = None  # maps a restarted kv_store's new pool; None in-process
    # opens the worker's (shared-memory) cache as a target of the kv_store's I/O engine, which then
    # does the recalls; None: the worker's own I/O thread copies from its mapping of the pool
    recall_engine: Callable[[PagedKVCache], RemoteRecall] | None = None
    lost: Callable[[], bool] | None = None  # whether the kv_store process went away since the last call
    worker_id: int = 0  # charged with its demotions' reservations (freed by the kv_store if it dies)


LAYER_AHEAD = ("auto", "on", "off")
SUSPEND = ("off", "layer", "cursor")


@dataclass(frozen=True)
class OffloadConfig:
    sink: int = 64  # tokens at the start of the context, always attended, kept on device
    recent: int = 256  # recent window kept on device (the partly filled block included)
    budget: int = 1024  # host-tier tokens selected per (request, layer)
    # hot-buffer tokens beyond the budget: blocks selected at earlier steps (or prefetched and
    # then not selected) stay on device until evicted, least recently selected first, so fewer
    # are recalled again; the same blocks are attended. Costs this much device KV per offloaded request
    hot_extra: int = 0
    # what selection scores host blocks by (gpu_worker/sparse.py): lowrank, each block's keys
    # projected on --key-rank principal directions of the layer's keys (a calibration pass at
    # start) and scored by the attention they draw; quest, the Quest bound of each block's min/max
    # keys per kv head (+4.3% perplexity over dense at budget 1024 where lowrank is about +1%,
    # docs/accuracy.md; half lowrank's device memory at rank 16)
    scorer: str = "lowrank"
    # 0: a quarter of the head dim (16 for SmolLM2's 64; Gemma 3 270M's 256 wants 64: at 16 its
    # global layers' selection kept 58% of the attention mass and perplexity at 16k rose 14%, at 64
    # 71% and within 2% of dense, docs/long_context.md)
    key_rank: int = 0
    calibration_tokens: int = 2048  # tokens of the calibration text the lowrank basis is fitted on
    # recall layer l+1's blocks on the I/O thread while layer l computes, selected with a predicted
    # query; the true query's selection then recalls only what the prediction missed. auto: on
    # CUDA, where the copies overlap compute on the copy engine; off on CPU, where they would take
    # the compute's own cores and the second selection per layer costs more than it hides
    # (docs/decode.md); on | off
    layer_ahead: str = "auto"
    # one gather of all of a layer's missed units and one scatter; off (an ablation): one copy per unit
    gather: bool = True
    # wait at most this long per layer for its recalls, then attend over the selected blocks that
    # have landed (the rest are counted as truncated and land before the step ends); unset: wait
    # for every recall. Pulse mode only: a head-wise row cannot drop blocks of some heads alone.
    # On CUDA a part has "landed" once queued on the stream ahead of attention: nothing is cut
    recall_deadline_ms: float | None = None
    # a decode row whose recalls are still in flight at a layer is suspended there (the misses
    # then copy on the I/O thread, not in line): `layer`, it waits while the batch's other rows
    # attend, then attends, and every row finishes the layer before any starts the next; `cursor`,
    # each row keeps a layer cursor: the others go on through the later layers, and the suspended
    # rows resume from their layer after them, as a batch of their own. Pulse mode only, the
    # head-wise baseline recalls synchronously; no effect with a recall deadline (it never waits
    # past it). Off by default: on the CPU nearly every row misses a block at every layer, so few
    # rows can go ahead and the hand-off to the I/O thread made the wait longer (docs/benchmarks.md)
    suspend: str = "off"
    # evals: on each decode step also compute dense attention over the whole context, to report
    # the share of its mass the selection keeps (reads every host block: slow)
    measure_attention_mass: bool = False

    def __post_init__(self) -> None:
        if self.scorer not in SCORERS:
            raise ValueError(f"--scorer must be one of {', '.join(SCORERS)}, got {self.scorer!r}")
        if self.key_rank < 0 or self.calibration_tokens < 1:
            raise ValueError(f"--key-rank must be >= 0 and --calibration-tokens >= 1, got {self.key_rank} and {self.calibration_tokens}")
        if self.layer_ahead not in LAYER_AHEAD:
            raise ValueError(f"--layer-ahead must be one of {', '.join(LAYER_AHEAD)}, got {self.layer_ahead!r}")
        if self.suspend not in SUSPEND:
            raise ValueError(f"--suspend must be one of {', '.join(SUSPEND)}, got {self.suspend!r}")
        if self.recall_deadline_ms is not None and not self.recall_deadline_ms >= 0:
            raise ValueError(f"--recall-deadline-ms must be >= 0, got {self.recall_deadline_ms}")

    def rank(self, head_dim: int) -> int:
        """The lowrank scorer's rank: --key-rank, else a quarter of the head dim."""
        return self.key_rank or head_dim // 4

    @property
    def recall_deadline_s(self) -> float | None:
        return None if self.recall_deadline_ms is None else self.recall_deadline_ms / 1e3

    def layer_ahead_on(self, device: torch.device) -> bool:
        return self.layer_ahead == "on" or (self.layer_ahead == "auto" and device.type == "cuda")

    def policy(self, device: torch.device, per_head: bool) -> RecallPolicy:
        if per_head and self.recall_deadline_ms is not None:
            raise ValueError("--recall-deadline-ms needs --mode pulse (head-wise recalls are synchronous)")
        return RecallPolicy(
            per_head=per_head,
            layer_ahead=self.layer_ahead_on(device),
            gather=self.gather,
            deadline_s=self.recall_deadline_s,
            suspend=self.suspend != "off" and not per_head,
            cursors=self.suspend == "cursor" and not per_head,
        )

    def geometry(self, block_size: int) -> OffloadGeometry:
        for name, low in (("sink", 0), ("recent", block_size), ("budget", block_size), ("hot_extra", 0)):
            value = getattr(self, name)
            if value < low or value % block_size:
                flag = name.replace("_", "-")
                raise ValueError(f"--{flag} must be a multiple of the block size ({block_size}) and at least {low}, got {value}")
        budget_blocks = self.budget // block_size
        return OffloadGeometry(
            block_size, self.sink // block_size, self.recent // block_size, budget_blocks, budget_blocks + self.hot_extra // block_size
        )


@dataclass(frozen=True)
class RecallPolicy:
    """How a worker's steps select and recall: OffloadConfig resolved for its device and mode."""

    per_head: bool  # headwise: one selection per kv head, recalls per (block, head)
    layer_ahead: bool
    gather: bool
    deadline_s: float | None
    suspend: bool  # rows whose recalls are in flight at a layer wait while the others attend
    cursors: bool  # ... and go on from that layer as a cohort of their own


@dataclass(frozen=True)
class OffloadGeometry:
    block_size: int
    sink_blocks: int
    ring_blocks: int
    budget_blocks: int  # host blocks selected per (request, layer)
    hot_blocks: int  # the hot buffer's capacity: at least the budget

    @property
    def device_blocks(self) -> int:
        """The device footprint of one offloaded request, whatever its length."""
        return self.sink_blocks + self.ring_blocks + self.hot_blocks

    def window_start(self, length: int) -> int:
        """First logical block of the recent window of a context of `length` tokens."""
        last = (length - 1) // self.block_size
        return max(self.sink_blocks, last - self.ring_blocks + 1)
