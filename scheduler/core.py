"""The scheduler's core over N workers, free of sockets: requests in, step plans out, results back.

Each worker has its own device KV pool, hence its own batcher and allocator. A request is
placed on the least loaded live worker. With overlapped scheduling (docs/architecture.md) each worker
has two steps in flight: while it runs one, the next is already queued at it, planned before the
running step's tokens are known (its worker feeds them forward), so the worker never waits on the
scheduler; without it, a worker's next step is planned when its result arrives. New requests join
at the next plan. The server feeds heartbeats and results in and sends out what `dispatch` returns.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from pulseinfer.common.tls import TlsConfig
from pulseinfer.kv_store.allocator import AllocatorCorrupt, BlockAllocator
from pulseinfer.kv_store.prefix_cache import HostPrefix, Observer
from pulseinfer.messages.plan import Logprobs, RecallStats, StepPlan
from pulseinfer.messages.sampling import FinishReason
from pulseinfer.messages.wire import (
    logprobs_to_proto,
    params_from_proto,
    plan_to_proto,
    prompt_logprobs_from_result,
    recall_from_proto,
    tokens_from_result,
)
from pulseinfer.proto.pulseinfer.v1 import generate_pb2, worker_pb2
from pulseinfer.scheduler.batcher import Batcher, BatcherConfig, ModelLimits
from pulseinfer.scheduler.node_blocks import NodeBlocks
from pulseinfer.scheduler.request import Sequence

Sink = Callable[[generate_pb2.ScheduleResponse], None]
HostPrefixOf = Callable[[int], HostPrefix]  # a worker's view of the host tier's prefix cache, by worker id

FINISH_TO_PROTO = {
    FinishReason.STOP: generate_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: generate_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: generate_pb2.FINISH_REASON_ABORT,
    FinishReason.ERROR: generate_pb2.FINISH_REASON_ERROR,
}


class NoWorkers(RuntimeError):
    pass


class DuplicateRequest(ValueError):
    pass


@dataclass(frozen=True)
class SchedulerConfig:
    grpc_bind: str = "127.0.0.1:50052"  # gateway -> scheduler
    # a second gRPC address for gateways on other hosts (`pulseinfer node --listen`), under tls: mutual TLS
    # or, with --insecure, plaintext; grpc_bind stays the node's own (loopback or unix) address
    listen: str = ""
    node_name: str = ""  # reported in Stats: worker ids are unique within a node, (node, worker id) across nodes
    tls: TlsConfig = field(default_factory=TlsConfig)
    workers_bind: str = "tcp://127.0.0.1:5557"  # workers connect here
    kv_store: str = "tcp://127.0.0.1:5560"
    worker_timeout_s: float = 3.0  # no heartbeat for this long: the worker is dead
    # on: each worker's next plan is queued while it runs a step, so it never waits on the scheduler
    # (docs/architecture.md); off: a worker's next step is planned when its result arrives
    overlap: str = "on"
    batcher: BatcherConfig = field(default_factory=BatcherConfig)

    def __post_init__(self) -> None:
        if self.overlap not in ("on", "off"):
            raise ValueError(f"--overlap must be on or off, got {self.overlap!r}")


@dataclass
class WorkerCounters:
    steps: int = 0
    decode_tokens: int = 0
    decode_steps: int = 0
    max_decode_batch: int = 0
    last_decode_batch: int = 0
    step_overhead_s: float = 0.0
    recall: RecallStats = RecallStats()  # summed over steps
    busy_s: float = 0.0
    idle_s: float = 0.0
    plan_bytes: int = 0
    steady_steps: int = 0
    steady_plan_bytes: int = 0
    steady_plan_bytes_max: int = 0
    last_result_at: float = 0.0
    tier_copy_s: float = 0.0
    tier_copy_s_max: float = 0.0
    isolated_failures: int = 0

    def sent(self, plan: StepPlan, size: int) -> None:
        self.plan_bytes += size
        if plan.steady and plan.chunks:
            self.steady_steps += 1
            self.steady_plan_bytes += size
            self.steady_plan_bytes_max = max(self.steady_plan_bytes_max, size)

    def record(self, plan: StepPlan, sent_at: float, now: float, result: worker_pb2.StepResult, recall: RecallStats) -> None:
        """A step's result. Its round trip counts from when the worker could start it: the plan's
        sending, or with overlap (the plan queued behind the step before) that step's result."""
        decode = len(plan.decode_chunks)
        self.steps += 1
        self.recall += recall
        self.step_overhead_s += max(0.0, now - max(sent_at, self.last_result_at) - result.forward_s)
        self.last_result_at = now
        self.busy_s += result.forward_s
        self.tier_copy_s += result.tier_copy_s
        self.tier_copy_s_max = max(self.tier_copy_s_max, result.tier_copy_s)
        self.isolated_failures += result.isolated_failures
        self.idle_s += result.idle_s
        if decode:
            self.decode_steps += 1
            self.decode_tokens += decode
            self.last_decode_batch = decode
            self.max_decode_batch = max(self.max_decode_batch, decode)


class WorkerHandle:
    def __init__(self, beat: worker_pb2.Heartbeat, batcher_config: BatcherConfig, now: float, host: HostPrefix | None, observer: Observer):
        self.worker_id = beat.worker_id
        self.pid = beat.pid
        self.identity = f"w{beat.worker_id}-{beat.pid}".encode()
        self.allocator = BlockAllocator(beat.device_blocks_total)
        eos = beat.eos_id if beat.HasField("eos_id") else None
        self.limits = ModelLimits(
            beat.max_position, eos, beat.block_size, beat.offload_blocks, beat.max_running, beat.host_tier, beat.window_history
        )
        self.vocab_size = beat.vocab_size
        self.batcher = Batcher(batcher_config, self.limits, self.allocator, host, observer)
        self.last_seen = now
        self.inflight: deque[tuple[StepPlan, float]] = deque()  # plans sent (oldest first) and when
        self.unsent: list[bytes] = []  # plans in flight the socket refused, to send again in order
        self.counters = WorkerCounters()

    @property
    def load(self) -> int:
        return len(self.batcher.running) + len(self.batcher.waiting)


@dataclass
class RequestState:
    seq: Sequence
    worker: WorkerHandle
    sink: Sink
    submitted_at: float
    scheduled_at: float | None = None
    first_token_at: float | None = None


class SchedulerCore:
    def __init__(self, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic, host: HostPrefixOf | None = None):
        """`host`: the host tier's prefix cache, which workers' offloaded requests reuse (None: they do not)."""
        self.config = config
        self.clock = clock
        self.host = host
        self.workers: dict[int, WorkerHandle] = {}
        self.blocks = NodeBlocks()  # the block names this node holds, for the gateways' routers
        self.draining = False
        self.requests: dict[str, RequestState] = {}

    # ------------------------------------------------------------ workers

    def on_heartbeat(self, beat: worker_pb2.Heartbeat) -> None:
        handle = self.workers.get(beat.worker_id)
        if handle is not None and handle.pid != beat.pid:
            self._lose_worker(handle, f"worker {handle.worker_id} restarted")
            handle = None
        if handle is None:
            host = self.host(beat.worker_id) if self.host is not None else None
            handle = WorkerHandle(beat, self.config.batcher, self.clock(), host, self.blocks.device)
            self.workers[beat.worker_id] = handle
        handle.last_seen = self.clock()

    def check_liveness(self) -> list[int]:
        """Drops workers whose heartbeats stopped; returns their ids."""
        now = self.clock()
        dead = [w for w in self.workers.values() if now - w.last_seen > self.config.worker_timeout_s]
        for handle in dead:
            self._lose_worker(handle, f"worker {handle.worker_id} stopped responding")
        return [w.worker_id for w in dead]

    def send_failed(self, identity: bytes, payload: bytes) -> None:
        """The worker's step socket is not connected (yet, or any more): keep the plan for a retry;
        heartbeats decide whether the worker is dead."""
        handle = self._by_identity(identity)
        if handle is not None:
            handle.unsent.append(payload)

    def take_unsent(self) -> list[tuple[bytes, bytes]]:
        out = []
        for worker in self.workers.values():
            out += [(worker.identity, payload) for payload in worker.unsent]
            worker.unsent = []
        return out

    def _lose_worker(self, handle: WorkerHandle, reason: str) -> None:
        del self.workers[handle.worker_id]
        if handle.batcher.prefix is not None:  # its device pool is gone with it
            self.blocks.device(list(handle.batcher.prefix.blocks), False)
        for state in [s for s in self.requests.values() if s.worker is handle]:
            self._finish(state, FinishReason.ERROR, f"{reason}; the request was lost")

    def _by_identity(self, identity: bytes) -> WorkerHandle | None:
        return next((w for w in self.workers.values() if w.identity == identity), None)

    # ------------------------------------------------------------ requests

    def submit(self, request: generate_pb2.ScheduleRequest, sink: Sink) -> RequestState:
        """Queues a request; raises NoWorkers, DuplicateRequest, QueueFull, RequestTooLarge or ValueError."""
        seq_id = request.request_id or uuid.uuid4().hex
        if seq_id in self.requests:
            raise DuplicateRequest(f"request id {seq_id!r} is already in flight")
        if not self.workers:
            raise NoWorkers("no worker is alive")
        if self.draining:
            raise NoWorkers("this node is draining: it takes no new requests")
        vocab_size = next(iter(self.workers.values())).vocab_size
        seq = Sequence.admit(seq_id, request.prompt_ids, params_from_proto(request.sampling), vocab_size)
        # the worker whose device pool caches the longest prefix of it, then the least loaded
        worker = max(self.workers.values(), key=lambda w: (w.batcher.cached_prefix_blocks(seq), -w.load))
        worker.batcher.add(seq)
        state = self.requests[seq_id] = RequestState(seq, worker, sink, self.clock())
        return state

    def reset_prefix_cache(self) -> int:
        """Every worker's device prefix cache forgets its blocks; returns the blocks freed."""
        return sum(w.batcher.drop_prefix_cache() for w in self.workers.values())

    def abort(self, seq_id: str) -> bool:
        state = self.requests.get(seq_id)
        if state is None:
            return False
        state.worker.batcher.abort(seq_id)
        self._finish(state, FinishReason.ABORT, "")
        return True

    # ------------------------------------------------------------ steps

    @property
    def depth(self) -> int:
        """Plans in flight per worker: the one it runs, and with overlap the next, queued at it."""
        return 2 if self.config.overlap == "on" else 1

    def dispatch(self) -> list[tuple[bytes, bytes]]:
        """Plans steps for every live worker with work, until it has `depth` in flight; returns them serialized."""
        out = []
        for worker in self.workers.values():
            while len(worker.inflight) < self.depth and worker.batcher.has_work():
                plan = worker.batcher.schedule()
                if plan is None:
                    break
                out.append((worker.identity, self._sent(worker, plan)))
        return out

    def _sent(self, worker: WorkerHandle, plan: StepPlan) -> bytes:
        now = self.clock()
        for admission in plan.admitted:
            state = self.requests.get(admission.seq_id)
            if state is not None and state.scheduled_at is None:
                state.scheduled_at = now
        worker.inflight.append((plan, now))
        payload = worker_pb2.SchedulerMessage(plan=plan_to_proto(plan)).SerializeToString()
        worker.counters.sent(plan, len(payload))
        return payload

    def on_result(self, identity: bytes, result: worker_pb2.StepResult) -> None:
        worker = self._by_identity(identity)
        if worker is None or not worker.inflight or worker.inflight[0][0].step_id != result.step_id:
            return  # a late answer from a worker already given up on
        plan, sent_at = worker.inflight.popleft()
        recall = recall_from_proto(result.recall)
        worker.counters.record(plan, sent_at, self.clock(), result, recall)
        worker.batcher.observe(plan, recall, result.compute_s)
        seq_ids = {c.handle: c.seq_id for c in plan.chunks}
        if result.error:
            worker.batcher.step_done(plan.step_id)
            for handle, seq_id in seq_ids.items():
                self._fail(worker, handle, seq_id, f"worker {worker.worker_id} failed the step: {result.error}")
            return
        sampled = tokens_from_result(seq_ids, result)
        finished = {seq.seq_id for seq in worker.batcher.commit(plan, sampled)}
        for failure in result.failed:
            self._fail(worker, failure.handle, seq_ids.get(failure.handle), f"worker {worker.worker_id}: {failure.error}")
        if result.prompt_handles:
            self._report_prompt_logprobs(plan, prompt_logprobs_from_result(seq_ids, result))
        now = self.clock()
        for token in sampled:
            state = self.requests.get(token.seq_id)
            if state is None:
                continue
            state.first_token_at = state.first_token_at or now
            message = generate_pb2.ScheduleResponse(token_ids=[token.token_id])
            if token.logprobs is not None:
                logprobs_to_proto(token.logprobs, message.logprobs)
            state.sink(message)
            if token.seq_id in finished:
                self._finish(state, state.seq.finish_reason, "")

    def _report_prompt_logprobs(self, plan: StepPlan, scored: dict[str, Logprobs]) -> None:
        """The prompt logprobs the step's chunks scored, each prompt position reported once (a
        request preempted while in prefill scores its prompt again), before any token of it."""
        for chunk in plan.chunks:
            state = self.requests.get(chunk.seq_id)
            if chunk.seq_id in scored and state is not None:
                new = state.seq.take_prompt_logprobs(chunk.start_pos, scored[chunk.seq_id])
                if len(new):
                    state.sink(generate_pb2.ScheduleResponse(prompt_logprobs=logprobs_to_proto(new, generate_pb2.Logprobs())))

    def _fail(self, worker: WorkerHandle, handle: int, seq_id: str | None, error: str) -> None:
        """A request its worker failed in a step, unless its admission has ended since (a late failure
        is not another admission's: handles are not reused while a result may name them)."""
        if handle in worker.batcher.handles.running and (state := self.requests.get(seq_id)) is not None:
            worker.batcher.abort(seq_id, FinishReason.ERROR)
            self._finish(state, FinishReason.ERROR, error)

    def _finish(self, state: RequestState, reason: FinishReason, error: str) -> None:
        del self.requests[state.seq.seq_id]
        now = self.clock()
        timings = generate_pb2.Timings(
            queue_s=(state.scheduled_at or now) - state.submitted_at,
            ttft_s=(state.first_token_at or now) - state.submitted_at,
            e2e_s=now - state.submitted_at,
        )
        cached = state.seq.cached_tokens or 0
        state.sink(generate_pb2.ScheduleResponse(finish_reason=FINISH_TO_PROTO[reason], error=error, timings=timings, cached_tokens=cached))

    # ------------------------------------------------------------ stats

    def stats(self) -> generate_pb2.SchedulerStats:
        workers = [self._worker_stats(w, self.config.node_name) for w in self.workers.values()]
        return generate_pb2.SchedulerStats(
            running=sum(w.running for w in workers),
            waiting=sum(w.waiting for w in workers),
            workers_alive=len(workers),
            device_blocks_total=sum(w.device_blocks_total for w in workers),
            device_blocks_free=sum(w.device_blocks_free for w in workers),
            workers=workers,
            cpu_s=time.process_time(),
            overlap=self.config.overlap == "on",
            node_name=self.config.node_name,
            draining=self.draining,
            block_size=next((w.limits.block_size for w in self.workers.values()), 0),
        )

    @staticmethod
    def _worker_stats(w: WorkerHandle, node_name: str) -> generate_pb2.WorkerStats:
        c = w.counters
        return generate_pb2.WorkerStats(
            worker_id=w.worker_id,
            node_name=node_name,
            pid=w.pid,
            running=len(w.batcher.running),
            waiting=len(w.batcher.waiting),
            device_blocks_total=w.allocator.num_blocks,
            device_blocks_free=w.allocator.num_free,
            steps=c.steps,
            decode_tokens=c.decode_tokens,
            decode_steps=c.decode_steps,
            max_decode_batch=c.max_decode_batch,
            last_decode_batch=c.last_decode_batch,
            step_overhead_s=c.step_overhead_s,
            busy_s=c.busy_s,
            idle_s=c.idle_s,
            plan_bytes=c.plan_bytes,
            steady_steps=c.steady_steps,
            steady_plan_bytes=c.steady_plan_bytes,
            steady_plan_bytes_max=c.steady_plan_bytes_max,
            inflight=len(w.inflight),
            tier_copy_s=c.tier_copy_s,
            tier_copy_s_max=c.tier_copy_s_max,
            isolated_failures=c.isolated_failures,
            preemptions=w.batcher.num_preemptions,
            offloaded=sum(1 for s in w.batcher.running if s.offloaded),
            offloaded_admissions=w.batcher.num_offloaded,
            integrity_error=_integrity_error(w.allocator),
            max_running=w.limits.max_running,
            **_prefix_stats(w.batcher),
            **{f"recall_{name}": count for name, count in asdict(c.recall).items()},  # WorkerStats' names for RecallStats' fields
            **_admission_stats(w.batcher),
        )


def _admission_stats(batcher: Batcher) -> dict[str, float]:
    """The offloading admission's inputs as it sees them now (0 until measured)."""
    link = batcher.link
    return {
        "link_bytes_per_s": link.bandwidth or 0.0,
        "recall_bytes_per_offloaded_step": link.row_bytes or 0.0,
        "decode_compute_s": link.step_compute(max(1, len(batcher.running))) or 0.0,
        "held_for_link": batcher.num_held_for_link,
    }


def _prefix_stats(batcher: Batcher) -> dict[str, int]:
    cache = batcher.prefix
    if cache is None:
        return {}
    return {
        "prefix_cached_blocks": len(cache),
        "prefix_evicted_blocks": cache.stats.evicted_blocks,
        "prefix_queried_tokens": cache.stats.queried_tokens,
        "prefix_hit_tokens": cache.stats.hit_tokens,
        "prefix_host_hit_tokens": cache.stats.host_hit_tokens,
        "prefix_promoted_blocks": cache.stats.promoted_blocks,
        "prefix_demoted_blocks": cache.stats.demoted_blocks,
    }


def _integrity_error(allocator: BlockAllocator) -> str:
    try:
        allocator.check()
    except AllocatorCorrupt as e:
        return str(e)
    return ""
