"""The scheduler's loop over workers, in-process: heartbeats and step results are fed in by hand."""

from __future__ import annotations

import weakref

import pytest

from pulseinfer.gpu_worker.requests import RequestTable
from pulseinfer.messages.plan import SampledToken, StepOutcome
from pulseinfer.proto.pulseinfer.v1 import generate_pb2, worker_pb2
from pulseinfer.scheduler.batcher import BatcherConfig, QueueFull
from pulseinfer.scheduler.core import DuplicateRequest, NoWorkers, SchedulerConfig, SchedulerCore


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def beat(worker_id: int, pid: int = 100) -> worker_pb2.Heartbeat:
    return worker_pb2.Heartbeat(
        worker_id=worker_id, pid=pid, device_blocks_total=64, block_size=16, max_position=512, eos_id=0, vocab_size=100
    )


def request(seq_id: str, prompt: list[int], max_tokens: int = 4) -> generate_pb2.ScheduleRequest:
    return generate_pb2.ScheduleRequest(
        request_id=seq_id, prompt_ids=prompt, sampling=generate_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    )


_tables: weakref.WeakKeyDictionary[SchedulerCore, dict[bytes, RequestTable]] = weakref.WeakKeyDictionary()


def plan_of(payload: bytes) -> worker_pb2.StepPlan:
    return worker_pb2.SchedulerMessage.FromString(payload).plan


def answer(core: SchedulerCore, sent, token: int = 7) -> None:
    """Workers that sample `token` for every sequence that needs one: each keeps its request table, as a worker does."""
    for identity, payload in sent:
        table = _tables.setdefault(core, {}).setdefault(identity, RequestTable(eos_id=0, windowed=False))
        steps, refused = table.build(table.stage(plan_of(payload)))
        handles, tokens, failed = table.record(StepOutcome([SampledToken(c.seq_id, token) for c in steps.chunks if c.sampling], {}))
        core.on_result(identity, worker_pb2.StepResult(step_id=steps.step_id, handles=handles, token_ids=tokens))


def test_new_requests_join_the_running_batch_between_steps():
    core, out = SchedulerCore(SchedulerConfig(overlap="off")), {}
    core.on_heartbeat(beat(0))
    core.submit(request("a", [1, 2, 3]), lambda m, k="a": out.setdefault(k, []).append(m))
    answer(core, core.dispatch())  # a: prefill
    core.submit(request("b", [4, 5]), lambda m, k="b": out.setdefault(k, []).append(m))
    (sent,) = core.dispatch()
    plan = plan_of(sent[1])
    assert list(plan.decode) == [0] and [a.seq_id for a in plan.admitted] == ["b"]  # a decodes while b prefills
    assert list(plan.prefill_handles) == [1] and list(plan.prefill_tokens) == [4, 5]
    answer(core, [sent])
    for _ in range(10):
        answer(core, core.dispatch())
    for key in "ab":
        tokens = [t for m in out[key] for t in m.token_ids]
        assert tokens == [7, 7, 7, 7] and out[key][-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
    assert core.stats().workers[0].max_decode_batch == 2


def test_requests_go_to_the_least_loaded_worker():
    core = SchedulerCore(SchedulerConfig())
    core.on_heartbeat(beat(0))
    core.on_heartbeat(beat(1))
    placed = [core.submit(request(str(i), [1, 2]), lambda m: None).worker.worker_id for i in range(4)]
    assert sorted(placed) == [0, 0, 1, 1]


def test_a_silent_worker_fails_its_requests_and_frees_them():
    clock = Clock()
    core, out = SchedulerCore(SchedulerConfig(worker_timeout_s=3.0), clock), []
    core.on_heartbeat(beat(0))
    core.submit(request("a", [1, 2, 3], max_tokens=50), out.append)
    answer(core, core.dispatch())
    core.dispatch()  # steps in flight when the worker dies
    clock.now = 10.0
    assert core.check_liveness() == [0]
    assert out[-1].finish_reason == generate_pb2.FINISH_REASON_ERROR and "worker 0" in out[-1].error
    assert not core.requests and not core.workers
    core.on_heartbeat(beat(0, pid=101))  # restarted: a fresh device pool
    assert core.stats().workers[0].device_blocks_free == 64


def test_a_restarted_worker_fails_the_old_incarnations_requests():
    core, out = SchedulerCore(SchedulerConfig()), []
    core.on_heartbeat(beat(0, pid=100))
    core.submit(request("a", [1, 2]), out.append)
    sent = core.dispatch()
    core.on_heartbeat(beat(0, pid=200))
    assert out[-1].finish_reason == generate_pb2.FINISH_REASON_ERROR and "restarted" in out[-1].error
    answer(core, sent)  # the old incarnation's late answer is ignored
    assert not core.requests


def test_a_failed_step_fails_only_its_requests_and_abort_frees_blocks():
    core, out = SchedulerCore(SchedulerConfig()), []
    core.on_heartbeat(beat(0))
    core.submit(request("a", [1, 2]), out.append)
    (identity, message), *_ = core.dispatch()
    core.on_result(identity, worker_pb2.StepResult(step_id=plan_of(message).step_id, error="RuntimeError: boom"))
    assert out[-1].finish_reason == generate_pb2.FINISH_REASON_ERROR and "boom" in out[-1].error
    core.submit(request("b", [1, 2], max_tokens=100), out.append)
    answer(core, core.dispatch())
    assert core.abort("b") and not core.abort("b")
    worker = core.workers[0]
    assert worker.allocator.num_free == 64
    worker.allocator.check()


def test_full_queue_and_no_workers_are_refused_without_side_effects():
    core = SchedulerCore(SchedulerConfig(batcher=BatcherConfig(max_waiting=1)))
    with pytest.raises(NoWorkers):
        core.submit(request("a", [1, 2]), lambda m: None)
    core.on_heartbeat(beat(0))
    core.submit(request("a", [1, 2]), lambda m: None)
    with pytest.raises(QueueFull):
        core.submit(request("b", [1, 2]), lambda m: None)
    with pytest.raises(DuplicateRequest):
        core.submit(request("a", [1, 2]), lambda m: None)
    with pytest.raises(ValueError, match="vocabulary"):
        core.submit(request("c", [1, 100]), lambda m: None)
    assert list(core.requests) == ["a"]


def test_a_plan_the_socket_refused_is_sent_again_not_lost():
    core, out = SchedulerCore(SchedulerConfig(overlap="off")), []
    core.on_heartbeat(beat(0))
    core.submit(request("a", [1, 2], max_tokens=1), out.append)
    ((identity, message),) = core.dispatch()
    core.send_failed(identity, message)  # the step socket was not connected yet
    assert core.dispatch() == []  # still one step in flight
    ((again_to, again),) = core.take_unsent()
    assert again_to == identity and again == message and core.take_unsent() == []
    answer(core, [(again_to, again)])
    assert out[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH


def test_each_recall_counter_has_one_name_from_the_worker_to_metrics():
    """RecallStats' fields are the worker's counters, the proto's RecallStats fields, WorkerStats'
    recall_<field> and /metrics' pulseinfer:recall_<field>_total: no hand-kept map between them."""
    from pulseinfer.gateway.metrics import RECALL_HELP, GatewayMetrics
    from pulseinfer.messages.plan import RECALL_FIELDS
    from pulseinfer.proto.pulseinfer.v1 import generate_pb2, worker_pb2

    assert tuple(RECALL_HELP) == RECALL_FIELDS
    assert tuple(f.name for f in worker_pb2.RecallStats.DESCRIPTOR.fields) == RECALL_FIELDS
    worker_fields = {f.name for f in generate_pb2.WorkerStats.DESCRIPTOR.fields}
    assert {f"recall_{name}" for name in RECALL_FIELDS} <= worker_fields
    rendered = GatewayMetrics().render()
    for name in RECALL_FIELDS:
        metric = "recall_" + (name.removesuffix("_s") + "_seconds" if name.endswith("_s") else name)
        assert f"# TYPE pulseinfer:{metric}_total counter" in rendered
