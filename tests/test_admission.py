"""IO-adaptive offloading admission, on the batcher alone: resident while the pool allows,
longest contexts offloaded first under pressure, offloaded requests held back while their
recall would not hide behind compute."""

from __future__ import annotations

from pulseinfer.kv_store.allocator import BlockAllocator
from pulseinfer.messages.plan import Chunk, RecallStats, SamplingSpec, StepPlan
from pulseinfer.messages.sampling import SamplingParams
from pulseinfer.scheduler.admission import LinkModel
from pulseinfer.scheduler.batcher import Batcher, BatcherConfig, ModelLimits
from pulseinfer.scheduler.request import Sequence

BLOCK = 16
FOOTPRINT = 10  # device blocks of an offloaded request
PARAMS = SamplingParams(max_tokens=BLOCK, ignore_eos=True)


def _batcher(device_blocks: int, policy: str = "auto") -> Batcher:
    limits = ModelLimits(max_position=1 << 20, eos_id=None, block_size=BLOCK, offload_blocks=FOOTPRINT)
    return Batcher(BatcherConfig(prefill_chunk=1 << 20, offload=policy), limits, BlockAllocator(device_blocks))


def _request(seq_id: str, blocks: int) -> Sequence:
    """A request that needs `blocks` device blocks to run resident to its end."""
    return Sequence.admit(seq_id, [1] * (blocks * BLOCK - PARAMS.max_tokens), PARAMS, vocab_size=100)


def _offloaded(batcher: Batcher) -> dict[str, bool]:
    return {s.seq_id: s.offloaded for s in batcher.running}


def _decode_step(offloaded_rows: int, resident_rows: int = 0, step: int = 5) -> StepPlan:
    spec = SamplingSpec(0.0, 1.0, 0, 0, step)
    chunks = [Chunk(f"r{i}", (1,), 100, (), spec, offloaded=i < offloaded_rows) for i in range(offloaded_rows + resident_rows)]
    return StepPlan(0, tuple(chunks))


def test_requests_that_fit_stay_resident():
    batcher = _batcher(100)
    for seq_id, blocks in (("a", 30), ("b", 40)):
        batcher.add(_request(seq_id, blocks))
    batcher.schedule()
    assert _offloaded(batcher) == {"a": False, "b": False}


def test_under_pressure_the_longest_waiting_request_is_offloaded_first():
    batcher = _batcher(100)
    for seq_id, blocks in (("a", 30), ("b", 60), ("c", 50)):
        batcher.add(_request(seq_id, blocks))  # 140 blocks wanted, 100 free
    batcher.schedule()
    # offloading b alone (60 -> 10 blocks) lets all three run at once; first come, first placed
    # would have kept a and b resident and offloaded c
    assert _offloaded(batcher) == {"a": False, "b": True, "c": False}
    assert batcher.num_offloaded == 1 and not batcher.waiting


def test_always_offloads_even_what_fits():
    batcher = _batcher(100, policy="always")
    batcher.add(_request("a", 30))
    batcher.schedule()
    assert _offloaded(batcher) == {"a": True}


def test_an_offloaded_request_waits_while_its_recall_would_not_hide_behind_compute():
    batcher = _batcher(30)
    batcher.add(_request("a", 50))
    batcher.schedule()
    assert _offloaded(batcher) == {"a": True}
    # measured: 1 MB/s link, each offloaded request recalls 40 kB per step, a step computes in 50 ms
    batcher.observe(_decode_step(1), RecallStats(bytes=40_000, io_busy_s=0.04), compute_s=0.05)
    assert batcher.link.hides(1, 1) and not batcher.link.hides(2, 2)
    batcher.add(_request("b", 50))  # cannot be resident (30 blocks): it must be offloaded
    batcher.schedule()
    assert list(_offloaded(batcher)) == ["a"] and batcher.num_held_for_link == 1
    batcher.schedule()
    assert batcher.num_held_for_link == 1  # counted once per request, however long it waits
    for _ in range(20):  # the hot buffers warm up: recall per step falls
        batcher.observe(_decode_step(1), RecallStats(bytes=10_000, io_busy_s=0.01), compute_s=0.05)
    batcher.schedule()
    assert _offloaded(batcher) == {"a": True, "b": True}


def test_a_held_request_that_fits_runs_resident_instead():
    batcher = _batcher(60)
    batcher.add(_request("a", 80))
    batcher.schedule()
    batcher.observe(_decode_step(1), RecallStats(bytes=40_000, io_busy_s=0.04), compute_s=0.05)
    batcher.add(_request("b", 40))
    batcher.add(_request("c", 40))
    batcher.schedule()  # b and c cannot both be resident: b would be offloaded, but the link is busy
    assert _offloaded(batcher) == {"a": True, "b": False}
    assert [s.seq_id for s in batcher.waiting] == ["c"] and batcher.num_held_for_link == 1  # c fits neither way now


def test_step_compute_is_a_line_through_the_measured_batch_sizes():
    link = LinkModel()
    assert link.step_compute(4) is None and link.hides(100, 4)  # nothing measured: admit, then learn
    link.observe(_decode_step(0, resident_rows=2), RecallStats(), compute_s=0.2)
    assert link.step_compute(8) == 0.2
    link.observe(_decode_step(0, resident_rows=4), RecallStats(), compute_s=0.3)
    assert abs(link.step_compute(8) - 0.5) < 1e-9
    mixed = StepPlan(1, (*_decode_step(0, resident_rows=2).chunks, Chunk("p", (1, 2, 3), 0, (), None)))
    link.observe(mixed, RecallStats(), compute_s=5.0)  # a step with prefill says nothing about decode
    assert abs(link.step_compute(8) - 0.5) < 1e-9


def test_the_first_decode_step_of_a_request_does_not_count_as_its_recall_volume():
    link = LinkModel()
    link.observe(_decode_step(2, step=1), RecallStats(bytes=10_000_000, io_busy_s=0.01), compute_s=0.1)  # hot buffers fill
    assert link.row_bytes is None and link.bandwidth == 1e9  # the copy still measures the link
    link.observe(_decode_step(2, step=2), RecallStats(bytes=20_000, io_busy_s=0.00002), compute_s=0.1)
    assert link.row_bytes == 10_000
