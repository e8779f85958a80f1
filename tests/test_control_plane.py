"""The control plane (docs/architecture.md): incremental step plans and overlapped scheduling.

The scheduler's core and a worker (its request table and model runner) run here without sockets:
plans are executed in the order they are sent, two in flight with overlap on, as over ZMQ."""

from __future__ import annotations

import pydoc_data.topics
import random
from collections import deque
from dataclasses import dataclass, replace

import pytest

from pulseinfer.common.model.tokenizer import TextStream
from pulseinfer.engine import Engine, EngineConfig
from pulseinfer.gpu_worker.config import WorkerConfig
from pulseinfer.gpu_worker.offload.config import OffloadConfig
from pulseinfer.gpu_worker.requests import RequestTable
from pulseinfer.gpu_worker.server import ServedModel, Worker, WorkerServiceConfig
from pulseinfer.kv_store.allocator import BlockAllocator
from pulseinfer.kv_store.prefix_cache import HostBlocks
from pulseinfer.messages.plan import PENDING_TOKEN, SampledToken, StepOutcome
from pulseinfer.messages.sampling import SamplingParams
from pulseinfer.messages.wire import params_to_proto, plan_to_proto
from pulseinfer.proto.pulseinfer.v1 import generate_pb2, worker_pb2
from pulseinfer.scheduler.batcher import Batcher, BatcherConfig, ModelLimits
from pulseinfer.scheduler.core import SchedulerConfig, SchedulerCore
from pulseinfer.scheduler.request import Sequence

B = 16


# ---------------------------------------------------------------- the wire, without a model


def _batcher(blocks: int, **config) -> Batcher:
    limits = ModelLimits(max_position=1 << 20, eos_id=0, block_size=B, offload_blocks=config.pop("offload_blocks", 0))
    host = config.pop("host", None)
    return Batcher(BatcherConfig(**config), limits, BlockAllocator(blocks), host)


@pytest.mark.parametrize("offload", ["never", "always"])
def test_the_request_table_rebuilds_every_chunk_the_batcher_planned(offload):
    """Plans over the wire, applied to a worker's request table, give back the batcher's chunks, the
    decode rows fed the tokens the worker sampled; through chunked prefill, prefix reuse, preemption,
    offloading and finished requests, two steps in flight: the second staged before the first's
    tokens are recorded, as a worker does while a forward runs."""
    rng = random.Random(0)
    host = HostBlocks(4096)
    batcher = _batcher(24, prefill_chunk=40, offload=offload, offload_blocks=6, host=host)
    table = RequestTable(eos_id=0, windowed=False)
    shared = [rng.randrange(1, 1000) for _ in range(50)]
    for i in range(12):
        prompt = shared[: rng.randrange(0, 50)] + [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 120))]
        batcher.add(Sequence.admit(f"r{i}", prompt, SamplingParams(max_tokens=rng.randrange(1, 120)), vocab_size=1000))
    inflight: deque = deque()
    sampled_by: dict[str, list[int]] = {}
    named = dropped = pending = 0
    staged = None  # of inflight[0]
    for _ in range(2000):
        while len(inflight) < 2 and (plan := batcher.schedule()) is not None:
            inflight.append(plan)
        if not inflight:
            break
        plan = inflight.popleft()  # the worker runs the oldest plan sent
        rebuilt, failed = table.build(staged or table.stage(_over_the_wire(plan)))
        staged = table.stage(_over_the_wire(inflight[0])) if inflight else None
        assert not failed
        expected = [_fed(c, sampled_by) for c in plan.chunks if not _ended(c, sampled_by)]
        assert [_runner_view(c) for c in rebuilt.chunks] == [_runner_view(c) for c in expected]
        assert rebuilt.released == plan.released and rebuilt.names == plan.names
        named += len(plan.names)
        dropped += len(plan.chunks) - len(expected)
        pending += sum(c.token_ids == (PENDING_TOKEN,) for c in plan.chunks)
        tokens = [SampledToken(c.seq_id, rng.choice((0, *range(5, 20)))) for c in rebuilt.chunks if c.sampling]
        table.record(StepOutcome(tokens, {}))
        for t in tokens:
            sampled_by.setdefault(t.seq_id, []).append(t.token_id)
        batcher.commit(plan, tokens)
    assert not batcher.has_work() and not table.running
    assert pending > 0 and dropped > 0  # rows planned a step ahead: fed back, and dropped after a stop
    if offload == "never":
        assert batcher.num_preemptions > 0
    else:
        assert batcher.num_offloaded > 0 and named > 0


@pytest.mark.parametrize("offload", ["never", "always"])
def test_a_steady_decode_plan_is_o_batch_bytes_whatever_the_context(offload):
    """A decode step's plan names each row by its handle: the same bytes at 512 and 32k tokens of
    context (block grants aside: a block id's varint grows with the pool, not the context), within
    32 bytes a row with the grants, resident and offloaded."""
    batch = 64
    sizes: dict[int, list[tuple[bool, int]]] = {}
    for context in (512, 32768):
        blocks = batch * (context // B + 8)
        batcher = _batcher(blocks, prefill_chunk=1 << 22, max_batch_size=batch, offload=offload, offload_blocks=6, host=HostBlocks(blocks))
        for i in range(batch):
            prompt = [1 + (i * 7 + j) % 999 for j in range(context)]
            batcher.add(Sequence.admit(f"r{i}", prompt, SamplingParams(max_tokens=64), vocab_size=1000))
        plans = [batcher.schedule() for _ in range(40)]  # planned ahead: every decode row is fed back
        steady = [p for p in plans if p.steady]
        assert len(steady) == 39 and all(len(p.chunks) == batch for p in steady)
        messages = [worker_pb2.SchedulerMessage(plan=plan_to_proto(p)) for p in steady]
        sizes[context] = [(bool(m.plan.grant_handles), len(m.SerializeToString())) for m in messages]
    assert [n for grants, n in sizes[512] if not grants] == [n for grants, n in sizes[32768] if not grants]
    assert [grants for grants, _ in sizes[512]] == [grants for grants, _ in sizes[32768]]
    assert max(n for _, n in sizes[32768]) <= 32 * batch + 64


def _over_the_wire(plan) -> worker_pb2.StepPlan:
    return worker_pb2.StepPlan.FromString(plan_to_proto(plan).SerializeToString())


def _fed(chunk, sampled_by):
    if chunk.token_ids == (PENDING_TOKEN,):
        return replace(chunk, token_ids=(sampled_by[chunk.seq_id][-1],))
    return chunk


def _ended(chunk, sampled_by) -> bool:
    """A decode row planned a step ahead for a request whose last token was a stop: the worker drops it."""
    return chunk.fed_back and sampled_by.get(chunk.seq_id, [None])[-1] == 0


def _runner_view(chunk):
    return (chunk.seq_id, chunk.token_ids, chunk.start_pos, chunk.block_table, chunk.sampling, chunk.offloaded, chunk.host_prefix)


# ---------------------------------------------------------------- a real model, overlap on and off


@dataclass(frozen=True)
class Served:
    """What a client saw of one request."""

    text: str
    token_ids: tuple[int, ...]
    finish: str


def _serve(engine: Engine, requests: list[tuple[str, list[int], SamplingParams, int]], overlap: str) -> tuple[dict[str, Served], int]:
    """The requests through a SchedulerCore and a Worker on the engine's model runner, plans run in
    the order sent; the client side stops a request at a stop string or after `abort_after` tokens
    (0: never), as the gateway does, once the step's tokens are in. Returns what each client saw and
    the scheduler's preemptions."""
    host = engine.host.allocator if engine.host is not None else None
    core = SchedulerCore(SchedulerConfig(overlap=overlap, batcher=engine.config.batcher), host=lambda _: host)
    worker = Worker(WorkerServiceConfig(), engine.runner, ServedModel(engine.loaded.config, "m", engine.tokenizer.eos_id))
    core.on_heartbeat(worker.heartbeat)
    seen: dict[str, list[int]] = {}
    streams: dict[str, TextStream] = {}
    finish: dict[str, str] = {}
    limits = {}

    def sink(seq_id: str):
        def take(response: generate_pb2.ScheduleResponse) -> None:
            if seq_id in finish:
                return
            seen[seq_id] += response.token_ids
            streams[seq_id].update(seen[seq_id])
            if response.finish_reason:
                finish[seq_id] = generate_pb2.FinishReason.Name(response.finish_reason)

        return take

    for seq_id, prompt, params, abort_after in requests:
        seen[seq_id], streams[seq_id], limits[seq_id] = [], TextStream(engine.tokenizer, params.stop, prompt), abort_after
        message = generate_pb2.ScheduleRequest(request_id=seq_id, prompt_ids=prompt, sampling=params_to_proto(params))
        core.submit(message, sink(seq_id))
    queue: deque[tuple[bytes, bytes]] = deque()
    staged = None  # of queue[0], staged while the step before it ran, as the worker does with overlap
    while queue or core.requests or any(w.batcher.has_work() for w in core.workers.values()):
        queue += core.dispatch()  # the last plans release what finished
        identity, payload = queue.popleft()
        step = worker.start(staged or worker.stage(worker_pb2.SchedulerMessage.FromString(payload).plan))
        staged = worker.stage(worker_pb2.SchedulerMessage.FromString(queue[0][1]).plan) if queue else None
        core.on_result(identity, worker.finish(step))
        for seq_id in list(core.requests):
            if streams[seq_id].stopped or 0 < limits[seq_id] <= len(seen[seq_id]):
                core.abort(seq_id)
                finish[seq_id] = "stop string" if streams[seq_id].stopped else "client abort"
    assert not worker.table.running
    served = {seq_id: Served(stream.emitted + stream.flush(), tuple(seen[seq_id]), finish[seq_id]) for seq_id, stream in streams.items()}
    return served, sum(w.batcher.num_preemptions for w in core.workers.values())


OFFLOAD = OffloadConfig(sink=16, recent=32, budget=32, calibration_tokens=256)
MODES = {
    # a device pool of 30 blocks for 6 requests of up to 300 tokens, prefilled 64 tokens a step: preemptions
    "dense": (WorkerConfig(mode="dense", device_kv_tokens=480), "never"),
    # offloaded: 5 device blocks each (sink, recent ring, budget); a shared prefix the host tier caches
    "pulse": (
        WorkerConfig(mode="pulse", device_kv_tokens=576, offload=OFFLOAD),
        "always",
    ),
    "headwise": (
        WorkerConfig(mode="headwise", device_kv_tokens=576, offload=OFFLOAD),
        "always",
    ),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_outputs_are_the_same_with_overlap_on_and_off(model, mode):
    """Rows planned a step ahead change nothing a client sees: stop strings, stop tokens, max_tokens,
    aborts, preemptions and offloaded requests with host-tier prefix reuse, on the real model."""
    worker, offload = MODES[mode]
    corpus = model.tokenizer.encode(" ".join(pydoc_data.topics.topics.values())[:60_000])
    shared = corpus[:96]
    requests = [
        ("long", shared + corpus[1000:1200], SamplingParams(max_tokens=24, ignore_eos=True), 0),
        ("shares", shared + corpus[2000:2100], SamplingParams(max_tokens=20, ignore_eos=True), 0),
        ("stop string", corpus[3000:3150], SamplingParams(max_tokens=40, stop=(".", "\n")), 0),
        ("stop token", corpus[4000:4080], SamplingParams(max_tokens=30, stop_token_ids=(_greedy_token(model, corpus[4000:4080]),)), 0),
        ("short", corpus[5000:5060], SamplingParams(max_tokens=1), 0),
        ("aborted", shared + corpus[6000:6150], SamplingParams(max_tokens=40, ignore_eos=True), 3),
    ]
    runs = {}
    for overlap in ("off", "on"):
        config = EngineConfig(worker=worker, batcher=BatcherConfig(offload=offload, prefill_chunk=64), host_kv_tokens=8192)
        with Engine(config, loaded=model) as engine:
            runs[overlap] = _serve(engine, requests, overlap)
    (off, preempted_off), (on, preempted_on) = runs["off"], runs["on"]
    assert on == off
    assert off["aborted"].finish == "client abort" and len(off["aborted"].token_ids) == 3
    assert off["short"].token_ids and len(off["short"].token_ids) == 1
    assert off["stop token"].finish == "FINISH_REASON_STOP" and len(off["stop token"].token_ids) == 1
    assert off["stop string"].finish == "stop string", off["stop string"]
    if mode == "dense":
        assert preempted_off > 0 and preempted_on > 0


def _greedy_token(model, prompt: list[int]) -> int:
    """The prompt's first greedy token, to stop on."""
    with Engine(EngineConfig(), loaded=model) as engine:
        (completion,) = engine.generate([prompt], SamplingParams(max_tokens=1))
    return completion.token_ids[0]
