"""IO-adaptive offloading admission (docs/architecture.md): the measurements it decides on.

A request stays resident while the device pool holds it (no I/O at all). Under memory pressure
the longest waiting contexts are offloaded first (each frees the most device blocks). An
offloaded request joins the decode batch only while the recall the batch's offloaded requests
need is predicted to hide behind compute: their recall bytes per decode step at most what the
link moves in the step's compute time. Per layer the ratio is the same (recall and compute both
spread over the layers), so whole steps are measured.

Inputs, measured online from each step's result: the link's bandwidth (recall bytes over the
time the copies took), the recall bytes one offloaded request adds per decode step, and the
compute time of a decode step against its batch size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pulseinfer.messages.plan import RecallStats, StepPlan

EMA_WEIGHT = 0.2  # of each new measurement: recall volume changes as hot buffers warm up


def _ema(old: float | None, new: float) -> float:
    return new if old is None else old + EMA_WEIGHT * (new - old)


@dataclass
class LinkModel:
    bandwidth: float | None = None  # bytes/s the recalls achieved while copying
    row_bytes: float | None = None  # recall bytes per offloaded request and decode step
    compute_s: dict[int, float] = field(default_factory=dict)  # decode batch size -> compute seconds of a decode-only step

    def observe(self, plan: StepPlan, recall: RecallStats, compute_s: float) -> None:
        decode = plan.decode_chunks
        offloaded = [c for c in decode if c.offloaded]
        if recall.bytes and recall.io_busy_s > 0:
            self.bandwidth = _ema(self.bandwidth, recall.bytes / recall.io_busy_s)
        # a request's first decode step fills its hot buffers from cold, once: what decides whether
        # recall hides is the steady state after it
        if offloaded and all(c.sampling.step > 1 for c in offloaded):
            self.row_bytes = _ema(self.row_bytes, recall.bytes / len(offloaded))
        if decode and len(decode) == len(plan.chunks):  # prefill chunks would inflate the step
            self.compute_s[len(decode)] = _ema(self.compute_s.get(len(decode)), compute_s)

    def step_compute(self, batch: int) -> float | None:
        """Predicted compute seconds of a decode step of `batch` rows: a least-squares line over the
        measured batch sizes (the nearest measurement while only one size was seen)."""
        points = sorted(self.compute_s.items())
        if not points:
            return None
        if len(points) == 1:
            return points[0][1]
        n = len(points)
        mean_b = sum(b for b, _ in points) / n
        mean_t = sum(t for _, t in points) / n
        spread = sum((b - mean_b) ** 2 for b, _ in points)
        slope = max(0.0, sum((b - mean_b) * (t - mean_t) for b, t in points) / spread)
        return max(mean_t + slope * (batch - mean_b), min(t for _, t in points))

    def hides(self, offloaded_rows: int, batch: int) -> bool:
        """Whether `offloaded_rows` requests' recalls fit in the link's time during a decode step
        of `batch` rows. True until there is something to predict from: admit, then learn."""
        compute = self.step_compute(batch)
        if self.bandwidth is None or self.row_bytes is None or compute is None:
            return True
        return offloaded_rows * self.row_bytes <= self.bandwidth * compute
