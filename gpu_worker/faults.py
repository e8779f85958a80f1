"""Fault injection for the tests of step isolation: a chosen request raises at a chosen point of a
step. Reachable only from the worker's environment (`PULSEINFER_FAULTS`, read once at start), never
from a request: a request is chosen by a marker token its prompt carries, which the tests pick.

    PULSEINFER_FAULTS="forward:1234,recall:5678@3"

makes a request whose prompt holds token 1234 raise in its rows' forward, and one whose prompt holds
5678 raise when its recall runs, once it has sampled 3 tokens (@N: from its N-th output token on;
default 0, from its first step)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pulseinfer.messages.plan import Chunk

POINTS = ("forward", "sampling", "mask", "logprobs", "selection", "recall")
ENV = "PULSEINFER_FAULTS"


class InjectedFault(RuntimeError):
    """What an armed point raises."""


@dataclass(frozen=True)
class Fault:
    point: str
    marker: int  # a prompt holding this token chooses its request
    after: int = 0  # from this output token on


@dataclass
class FaultPlan:
    """The faults, the requests they chose (by seq id, as their prompts went by) and the ones armed
    in the step running now. Empty: every check is one dictionary test."""

    faults: tuple[Fault, ...] = ()
    chosen: dict[str, Fault] = field(default_factory=dict)
    armed: dict[str, set[str]] = field(default_factory=dict)  # point -> seq ids that raise there this step

    @classmethod
    def parse(cls, text: str) -> FaultPlan:
        faults = []
        for item in filter(None, (part.strip() for part in text.split(","))):
            point, _, rest = item.partition(":")
            marker, _, after = rest.partition("@")
            if point not in POINTS or not marker.isdigit() or (after and not after.isdigit()):
                raise ValueError(f"{ENV}: {item!r} is not POINT:TOKEN[@AFTER] with POINT one of {', '.join(POINTS)}")
            faults.append(Fault(point, int(marker), int(after or 0)))
        return cls(tuple(faults))

    @classmethod
    def from_env(cls) -> FaultPlan:
        return cls.parse(os.environ.get(ENV, ""))

    def arm(self, chunks: Sequence[Chunk]) -> None:
        """Before a step (or a re-run of part of it): the chosen requests among `chunks` whose fault is due."""
        if not self.faults:
            return
        self.armed = {}
        for chunk in chunks:
            fault = self.chosen.get(chunk.seq_id) or next((f for f in self.faults if f.marker in chunk.token_ids), None)
            if fault is None:
                continue
            self.chosen[chunk.seq_id] = fault
            if fault.after == 0 or (chunk.sampling is not None and chunk.sampling.step >= fault.after):
                self.armed.setdefault(fault.point, set()).add(chunk.seq_id)

    def check(self, point: str, seq_ids: Iterable[str]) -> None:
        """Raises InjectedFault if a request armed at `point` is among `seq_ids`."""
        armed = self.armed.get(point)
        if armed and (hit := armed.intersection(seq_ids)):
            raise InjectedFault(f"injected fault at {point} of request {min(hit)}")

    def forget(self, seq_ids: Iterable[str]) -> None:
        """Requests that ended: their seq ids are not reused, but their entries would pile up."""
        for seq_id in seq_ids:
            self.chosen.pop(seq_id, None)
