"""gpu_worker process: takes step plans from the scheduler over ZMQ, returns sampled tokens.

One process per device. The step socket carries plans and results only; heartbeats go out
on a second socket from their own thread, so a long forward never looks like a dead worker.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import zmq

from pulseinfer.common.grammar import grammars_built_aside
from pulseinfer.common.model.config import ModelConfig
from pulseinfer.common.model.tokenizer import Tokenizer
from pulseinfer.common.peer import PeerLoss
from pulseinfer.gpu_worker.config import WorkerConfig
from pulseinfer.gpu_worker.kv_cache import KVCacheSpec
from pulseinfer.gpu_worker.offload.manager import OffloadManager
from pulseinfer.gpu_worker.requests import RequestTable, Staged
from pulseinfer.gpu_worker.runner import PendingOutcome, poisons_device
from pulseinfer.messages.plan import StepOutcome, StepPlan
from pulseinfer.messages.wire import recall_to_proto
from pulseinfer.proto.pulseinfer.v1 import worker_pb2

log = logging.getLogger("gpu_worker")
POLL_MS = 200  # how soon a shutdown signal is noticed while idle


@dataclass(frozen=True)
class WorkerServiceConfig:
    model: str | None = None
    load_format: str = "auto"  # auto | dummy: seeded random weights of the model's geometry
    scheduler: str = "tcp://127.0.0.1:5557"  # the scheduler's worker socket
    kv_store: str = "tcp://127.0.0.1:5560"
    worker_id: int = 0
    heartbeat_interval_s: float = 0.5
    kv_store_timeout_s: float = 30.0
    # the kv_store's I/O engine copies recalls into this worker's cache (CPU: in shared memory;
    # CUDA: exported with CUDA IPC); off: the worker's own I/O thread copies them from its mapping of the pool
    engine_recalls: bool = True
    # a benchmark tool (`pulseinfer bench control-plane`): > 0 replaces the model with a forward of this
    # fixed time that holds no KV and samples deterministic tokens (gpu_worker/simulated.py)
    simulate_step_ms: float = 0.0
    worker: WorkerConfig = field(default_factory=WorkerConfig)


def step_identity(worker_id: int, pid: int) -> bytes:
    return f"w{worker_id}-{pid}".encode()


class StepRunner(Protocol):
    """What runs a worker's steps: the model (gpu_worker/runner.py ModelRunner), or the benchmarks'
    simulated forward (gpu_worker/simulated.py)."""

    cache_spec: KVCacheSpec
    offload_blocks: int
    max_running: int
    offload: OffloadManager | None
    host_tier: bool  # it maps the kv_store's pool (the KV hierarchy's second tier)
    window_history: bool  # it keeps the sliding-window layers' KV of its device blocks (the prefix cache rebuilds rings from it)

    # launch() returns while the forward runs (a device's kernels); the worker then sends the last
    # step's result meanwhile. False: launch() runs the step, so that result goes out before it.
    launches_async: bool

    def launch(self, plan: StepPlan) -> PendingOutcome:
        """Starts the step."""
        ...

    def release_all(self, host_owners: Sequence[str] = ()) -> None: ...

    def detach_host(self) -> None:
        """The kv_store died: let go of its pool."""
        ...

    def idle(self) -> None:
        """Called when no plan came for a while."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class StepInFlight:
    """What the worker holds of a step it started, until finish() records it: its forward launched
    (or failed before it could be, the failure then raised by `outcome.wait`)."""

    step_id: int
    refused: dict[int, str]  # chunks the request table could not build, by handle
    started: float  # perf_counter at the launch
    outcome: PendingOutcome


@dataclass(frozen=True)
class StageFailed:
    """A plan the request table could not take: its step fails."""

    step_id: int
    error: Exception


def _send(socket: zmq.Socket, result: worker_pb2.StepResult) -> None:
    socket.send(worker_pb2.WorkerMessage(result=result).SerializeToString())


def _raise(error: Exception) -> PendingOutcome:
    def wait() -> StepOutcome:
        raise error

    return PendingOutcome(wait)


@dataclass(frozen=True)
class ServedModel:
    """What the heartbeat tells the scheduler of the model."""

    config: ModelConfig
    name: str
    eos_id: int | None
    tokenizer: Tokenizer | None = None  # structured outputs' grammars are matched with it (None: refused)


class Worker:
    def __init__(self, config: WorkerServiceConfig, runner: StepRunner, model: ServedModel, host_lost: Callable[[], bool] | None = None):
        """`host_lost`: whether the kv_store holding the offloaded requests' KV went away (None: no host tier)."""
        self.config = config
        self.runner = runner
        self.host_lost = host_lost
        stops = [model.eos_id] if model.eos_id is not None else []
        grammars = grammars_built_aside(model.tokenizer, model.config.vocab_size, stops) if model.tokenizer is not None else None
        self.table = RequestTable(model.eos_id, windowed=runner.max_running > 0, grammars=grammars)
        self._last_forward_end: float | None = None
        self.device_lost: Exception | None = None  # a device error that poisoned the context
        spec = runner.cache_spec
        self.heartbeat = worker_pb2.Heartbeat(
            worker_id=config.worker_id,
            pid=os.getpid(),
            device_blocks_total=spec.num_blocks,
            block_size=spec.block_size,
            max_position=model.config.max_position,
            vocab_size=model.config.vocab_size,
            model=model.name,
            offload_blocks=runner.offload_blocks,
            max_running=runner.max_running,
            host_tier=runner.host_tier,
            window_history=runner.window_history,
        )
        if model.eos_id is not None:
            self.heartbeat.eos_id = model.eos_id

    def stage(self, message: worker_pb2.StepPlan) -> Staged | StageFailed:
        """The plan taken into the request table but for its decode rows (gpu_worker/requests.py):
        with overlap, while the step before it runs."""
        try:
            return self.table.stage(message)
        except Exception as e:  # noqa: BLE001 - one bad step fails its requests, not the worker
            return StageFailed(message.step_id, e)

    def start(self, staged: Staged | StageFailed) -> StepInFlight:
        """Its decode rows built (the step before it recorded) and its forward launched; a failure
        here is the step's, reported by finish()."""
        started = time.perf_counter()
        try:
            if isinstance(staged, StageFailed):
                raise staged.error
            plan, refused = self.table.build(staged)
            started = time.perf_counter()
            return StepInFlight(staged.step_id, refused, started, self.runner.launch(plan))
        except Exception as e:  # noqa: BLE001 - one bad step fails its requests, not the worker
            return StepInFlight(staged.step_id, {}, started, _raise(e))

    def finish(self, step: StepInFlight) -> worker_pb2.StepResult:
        """The step's outcome, recorded. Busy: from the launch to the outcome (the forward); idle: from
        the end of the previous step's forward to this launch (the plan in, the request table)."""
        result = worker_pb2.StepResult(step_id=step.step_id)
        try:
            outcome = step.outcome.wait()
            ended = time.perf_counter()
        except Exception as e:  # noqa: BLE001 - one bad step fails its requests, not the worker
            log.exception("step %d failed", step.step_id)
            if poisons_device(e):  # its requests fail with this result, then the worker exits and is restarted
                self.device_lost = e
            self.table.fail_step()
            self._last_forward_end = None
            result.error = f"{type(e).__name__}: {e}"
            return result
        started, refused = step.started, step.refused
        if self._last_forward_end is not None:
            result.idle_s = started - self._last_forward_end
        self._last_forward_end = ended
        handles, tokens, failed = self.table.record(outcome)
        result.handles[:] = handles
        result.token_ids[:] = tokens
        self.table.report_logprobs(outcome, result)
        result.forward_s = ended - started
        result.compute_s = outcome.compute_s
        result.tier_copy_s = outcome.tier_copy_s
        result.isolated_failures = outcome.isolated_failures
        result.recall.CopyFrom(recall_to_proto(outcome.recall))
        result.failed.extend(worker_pb2.SequenceError(handle=h, error=e) for h, e in (refused | failed).items())
        return result

    def serve(self, context: zmq.Context, stop: threading.Event) -> None:
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.ROUTING_ID, step_identity(self.config.worker_id, os.getpid()))
        socket.connect(self.config.scheduler)
        scheduler_loss = PeerLoss(socket)
        beats = threading.Thread(target=self._beat, args=(context, stop), name="heartbeat", daemon=True)
        beats.start()
        log.info(
            "worker %d ready (%d device KV blocks), scheduler %s",
            self.config.worker_id,
            self.heartbeat.device_blocks_total,
            self.config.scheduler,
        )
        try:
            self._steps(socket, stop, scheduler_loss)
        finally:
            stop.set()
            beats.join()
            scheduler_loss.close()
            socket.close()
            self.runner.close()

    def _steps(self, socket: zmq.Socket, stop: threading.Event, scheduler_loss: PeerLoss) -> None:
        """Plans in, results out, until a shutdown. With a runner whose forward runs apart from this
        thread (a device), the time between two forwards is only the decode rows' build: the next
        plan, queued by overlapped scheduling, is staged and the last result sent while a forward runs."""
        overlap = self.runner.launches_async
        unsent: worker_pb2.StepResult | None = None  # the last step's result, serialized as it goes
        staged: Staged | StageFailed | None = None  # the next step's plan
        while not stop.is_set():
            if self._drop_what_peers_lost(scheduler_loss):
                unsent = staged = None
            if staged is None:
                if unsent is not None and not (overlap and socket.poll(0)):
                    _send(socket, unsent)  # no plan queued: the scheduler plans the next step from this result
                    unsent = None
                if not socket.poll(POLL_MS):
                    self.runner.idle()
                    continue
                if (staged := self._receive(socket)) is None:
                    return
            step = self.start(staged)
            staged = None
            if unsent is not None:
                _send(socket, unsent)
                unsent = None
            if overlap:
                staged, shutdown = self._plan_during(socket, step)
                if shutdown:
                    self.finish(step)
                    return
            unsent = self.finish(step)
            if self.device_lost is not None:
                _send(socket, unsent)
                raise RuntimeError("the device can run nothing more: the worker restarts") from self.device_lost

    def _plan_during(self, socket: zmq.Socket, step: StepInFlight) -> tuple[Staged | StageFailed | None, bool]:
        """The next plan, staged if it arrives before the step's forward is expected to end; and
        whether a shutdown came instead."""
        while (left_ms := int((step.outcome.ends_at - time.perf_counter()) * 1e3)) > 0:
            if socket.poll(left_ms):
                staged = self._receive(socket)
                return staged, staged is None
        return None, False

    def _receive(self, socket: zmq.Socket) -> Staged | StageFailed | None:
        """The next plan, staged; None for a shutdown."""
        message = worker_pb2.SchedulerMessage.FromString(socket.recv())
        return self.stage(message.plan) if message.WhichOneof("kind") == "plan" else None

    def _drop_what_peers_lost(self, scheduler_loss: PeerLoss) -> bool:
        """Between steps: a scheduler that died took its requests with it, so their host blocks and
        sliding-window rings are freed now (nobody will release them); a kv_store that died took
        every offloaded request's KV, so its pool is unmapped now, not when the next offloaded
        request finds it gone. Returns whether the scheduler went away."""
        scheduler_lost = scheduler_loss.happened()
        if scheduler_lost:
            log.warning("the scheduler went away: freeing the device and host state of the requests it had planned")
            owners = self.table.host_owners()
            self.table.clear()
            self.runner.release_all(owners)
            self._last_forward_end = None
        if self.host_lost is not None and self.host_lost():
            offloaded = len(self.runner.offload.seqs) if self.runner.offload is not None else 0
            log.warning("the kv_store went away: dropping %d offloaded requests and unmapping its pool", offloaded)
            self.runner.detach_host()
        return scheduler_lost

    def _beat(self, context: zmq.Context, stop: threading.Event) -> None:
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, 4)  # while the scheduler is away, do not queue stale beats
        socket.connect(self.config.scheduler)
        payload = worker_pb2.WorkerMessage(heartbeat=self.heartbeat).SerializeToString()
        try:
            while not stop.is_set():
                try:
                    socket.send(payload, zmq.NOBLOCK)
                except zmq.Again:
                    pass
                stop.wait(self.config.heartbeat_interval_s)
        finally:
            socket.close()
