"""What the scheduler asks a worker to compute in one step."""

from __future__ import annotations

from dataclasses import dataclass


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

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class StepPlan:
    step_id: int
    chunks: tuple[Chunk, ...]
    released: tuple[str, ...] = ()  # offloaded requests that ended: the worker frees their state first


@dataclass(frozen=True)
class SampledToken:
    seq_id: str
    token_id: int


@dataclass(frozen=True)
class StepOutcome:
    tokens: list[SampledToken]
    failed: dict[str, str]  # seq_id -> why the worker dropped it from the step (the others ran)
