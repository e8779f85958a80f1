"""gpu_worker process: takes step plans from the scheduler over ZMQ, returns sampled tokens.

One process per device. The step socket carries plans and results only; heartbeats go out
on a second socket from their own thread, so a long forward never looks like a dead worker.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import zmq

from pulseinfer.common.model.config import ModelConfig
from pulseinfer.common.peer import PeerLoss
from pulseinfer.gpu_worker.kv_cache import KVCacheSpec
from pulseinfer.gpu_worker.offload.manager import OffloadManager
from pulseinfer.gpu_worker.requests import RequestTable
from pulseinfer.gpu_worker.runner import WorkerConfig
from pulseinfer.proto.pulseinfer.v1 import worker_pb2
from pulseinfer.scheduler.plan import StepOutcome, StepPlan
from pulseinfer.scheduler.wire import recall_to_proto

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

    def execute(self, plan: StepPlan) -> StepOutcome: ...

    def release_all(self) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class ServedModel:
    """What the heartbeat tells the scheduler of the model."""

    config: ModelConfig
    name: str
    eos_id: int | None


class Worker:
    def __init__(self, config: WorkerServiceConfig, runner: StepRunner, model: ServedModel, host_lost: Callable[[], bool] | None = None):
        """`host_lost`: whether the kv_store holding the offloaded requests' KV went away (None: no host tier)."""
        self.config = config
        self.runner = runner
        self.host_lost = host_lost
        self.table = RequestTable(model.eos_id, windowed=runner.max_running > 0)
        self._last_forward_end: float | None = None
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
        )
        if model.eos_id is not None:
            self.heartbeat.eos_id = model.eos_id

    def execute(self, message: worker_pb2.StepPlan) -> worker_pb2.StepResult:
        """One step. Busy: the time inside the runner; idle: from the end of the previous step's
        forward to the start of this one (results out, the plan in, the request table)."""
        result = worker_pb2.StepResult(step_id=message.step_id)
        try:
            plan, refused = self.table.apply(message)
            started = time.perf_counter()
            outcome = self.runner.execute(plan)
            ended = time.perf_counter()
        except Exception as e:  # noqa: BLE001 - one bad step fails its requests, not the worker
            log.exception("step %d failed", message.step_id)
            self.table.fail_step()
            self._last_forward_end = None
            result.error = f"{type(e).__name__}: {e}"
            return result
        if self._last_forward_end is not None:
            result.idle_s = started - self._last_forward_end
        self._last_forward_end = ended
        handles, tokens, failed = self.table.record(outcome)
        result.handles[:] = handles
        result.token_ids[:] = tokens
        result.forward_s = ended - started
        result.compute_s = outcome.compute_s
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
            while not stop.is_set():
                self._drop_what_peers_lost(scheduler_loss)
                if not socket.poll(POLL_MS):
                    continue
                message = worker_pb2.SchedulerMessage.FromString(socket.recv())
                if message.WhichOneof("kind") != "plan":
                    return
                socket.send(worker_pb2.WorkerMessage(result=self.execute(message.plan)).SerializeToString())
        finally:
            stop.set()
            beats.join()
            scheduler_loss.close()
            socket.close()
            self.runner.close()

    def _drop_what_peers_lost(self, scheduler_loss: PeerLoss) -> None:
        """Between steps: a scheduler that died took its requests with it, so their host blocks and
        sliding-window rings are freed now (nobody will release them); a kv_store that died took
        every offloaded request's KV, so its pool is unmapped now, not when the next offloaded
        request finds it gone."""
        if scheduler_loss.happened():
            log.warning("the scheduler went away: freeing the device and host state of the requests it had planned")
            self.table.clear()
            self.runner.release_all()
            self._last_forward_end = None
        offload = self.runner.offload
        if offload is not None and self.host_lost is not None and self.host_lost():
            log.warning("the kv_store went away: dropping %d offloaded requests and unmapping its pool", len(offload.seqs))
            offload.detach()

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
