"""What the scheduler asks a worker to compute in one step."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class SamplingSpec:
    """The per-step slice of SamplingParams a worker needs to pick one token."""

    temperature: float
    top_p: float
    top_k: int
    seed: int
    step: int  # index of the token being sampled; with seed, makes sampling stateless and reproducible


@dataclass(frozen=True)
class Chunk:
    """Tokens of one sequence to run through the model at positions start_pos.."""

    seq_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    sampling: SamplingSpec | None  # None: a prefill chunk that does not reach the end of the prompt
    offloaded: bool = False  # block_table is the fixed device footprint; the worker keeps the rest on host
    # offloaded, the host tier's prefix cache on: the cached host blocks the request starts from (its
    # first chunk), and the prefix-cache names of the full blocks start_pos // B .. end_pos // B - 1
    host_prefix: tuple[int, ...] = ()
    block_names: tuple[bytes, ...] = ()

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class StepPlan:
    step_id: int
    chunks: tuple[Chunk, ...]
    released: tuple[str, ...] = ()  # requests that ended (offloaded, or on a sliding-window model): the worker frees their state first

    @property
    def decode_chunks(self) -> list[Chunk]:
        """The chunks that decode one token (the rest prefill)."""
        return [c for c in self.chunks if c.sampling is not None and len(c.token_ids) == 1]


@dataclass(frozen=True)
class SampledToken:
    seq_id: str
    token_id: int


@dataclass(frozen=True)
class RecallStats:
    """What offloaded requests recalled from the host pool: one step's, or summed (worker.proto
    RecallStats, field for field)."""

    units: int = 0  # (block, layer) units; (block, layer, head) in headwise mode
    transfers: int = 0  # contiguous host ranges read
    bytes: int = 0
    wait_s: float = 0.0  # compute blocked on recalls
    prefetched_units: int = 0  # recalled ahead of their layer from a predicted query
    corrected_units: int = 0  # recalled at their layer: the prediction missed them
    io_busy_s: float = 0.0  # time the copies took, wherever they ran: the link's bandwidth is bytes / io_busy_s
    truncated_units: int = 0  # selected but left out of attention: their recall missed the layer's deadline
    suspended_rows: int = 0  # (decode row, layer) pairs suspended for their recalls while the other rows attended
    resumed_layers: int = 0  # layers run apart by rows resuming after a suspension (layer cursors): weights read again

    def __add__(self, other: RecallStats) -> RecallStats:
        return RecallStats(*(getattr(self, name) + getattr(other, name) for name in RECALL_FIELDS))

    def __sub__(self, other: RecallStats) -> RecallStats:
        return RecallStats(*(getattr(self, name) - getattr(other, name) for name in RECALL_FIELDS))


RECALL_FIELDS = tuple(f.name for f in fields(RecallStats))


@dataclass(frozen=True)
class StepOutcome:
    tokens: list[SampledToken]
    failed: dict[str, str]  # seq_id -> why the worker dropped it from the step (the others ran)
    recall: RecallStats = RecallStats()  # what the step's offloaded requests recalled
    compute_s: float = 0.0  # the forward's time, less what it waited on recalls
