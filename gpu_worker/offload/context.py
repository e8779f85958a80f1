"""What a step is handed of the worker's offloading: fixed for the step."""

from __future__ import annotations

from dataclasses import dataclass

from pulseinfer.gpu_worker.faults import FaultPlan
from pulseinfer.gpu_worker.kv_cache import PagedKVCache
from pulseinfer.gpu_worker.offload.config import OffloadGeometry, RecallPolicy
from pulseinfer.gpu_worker.offload.counters import RecallCounters
from pulseinfer.gpu_worker.offload.hot import HotBuffers
from pulseinfer.gpu_worker.sparse import AttentionMass, Scorer, SummaryPool
from pulseinfer.kernels.attention import GatherWorkspace
from pulseinfer.kv_store.view import PoolView


@dataclass(frozen=True)
class StepContext:
    """What a step is handed of the worker's offloading: fixed for the step."""

    cache: PagedKVCache
    view: PoolView
    geometry: OffloadGeometry
    policy: RecallPolicy
    scorer: Scorer
    summaries: SummaryPool
    hot: HotBuffers
    counters: RecallCounters
    mass: AttentionMass | None  # evals: the share of dense attention mass the selection keeps
    workspace: GatherWorkspace  # the attention-mass measurement's context gathers
    faults: FaultPlan  # the tests' injected faults (empty in service)
