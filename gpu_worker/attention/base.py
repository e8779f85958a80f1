"""What an attention backend is to the layer loop (gpu_worker/forward.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pulseinfer.gpu_worker.batch import ForwardBatch
from pulseinfer.messages.plan import StepPlan


@dataclass(frozen=True)
class Suspension:
    """Decode rows suspended at a layer after their query, K/V writes and selection: what their
    attention needs when they resume, so it attends exactly what it would have without suspending."""

    rows: list[int]
    q: torch.Tensor
    tables: torch.Tensor
    lens: torch.Tensor


class StepAttention(Protocol):
    """Attention for the rows of one step (or of one cohort of it)."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, Suspension | None]:
        """Stores the tokens' k, v [T, kv_heads, dim] and returns the attention output [T, heads, dim]
        of q, less the rows suspended at this layer (their output rows are not computed)."""
        ...

    def resume(self, layer: int, suspension: Suspension) -> torch.Tensor:
        """The output of the rows resuming at the layer where they were suspended."""
        ...

    def cohort(self, batch: ForwardBatch) -> StepAttention:
        """This step's attention over a cohort's batch (a subset of its rows)."""
        ...

    @property
    def prefetching(self) -> bool:
        """Whether the loop should hand a predicted query of the next layer to `prefetch`."""
        ...

    def prefetch(self, layer: int, q: torch.Tensor) -> None:
        """Starts recalling `layer`'s blocks for the decode rows' predicted queries."""
        ...

    def finish(self) -> None:
        """After the forward, failed or not: nothing of the step may still be in flight."""
        ...


class AttentionBackend(Protocol):
    """A worker's attention for its life: one StepAttention per step."""

    def begin(self, plan: StepPlan, batch: ForwardBatch) -> StepAttention: ...
