"""gpu_worker process: takes step plans from the scheduler over ZMQ, returns sampled tokens.

One process per device. The step socket carries plans and results only; heartbeats go out
on a second socket from their own thread, so a long forward never looks like a dead worker.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field

import zmq

from pulseinfer.common.peer import PeerLoss
from pulseinfer.gpu_worker.model.loader import LoadedModel
from pulseinfer.gpu_worker.offload.config import HostTier
from pulseinfer.gpu_worker.runner import ModelRunner, WorkerConfig
from pulseinfer.proto.pulseinfer.v1 import worker_pb2
from pulseinfer.scheduler.wire import plan_from_proto, recall_to_proto, tokens_to_proto

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
    worker: WorkerConfig = field(default_factory=WorkerConfig)


def step_identity(worker_id: int, pid: int) -> bytes:
    return f"w{worker_id}-{pid}".encode()


class Worker:
    def __init__(self, config: WorkerServiceConfig, loaded: LoadedModel, host: HostTier | None):
        self.config = config
        self.runner = ModelRunner(loaded, config.worker, host)
        self.host_lost = host.lost if host is not None else None
        spec = self.runner.cache_spec
        model_config = loaded.config
        self.heartbeat = worker_pb2.Heartbeat(
            worker_id=config.worker_id,
            pid=os.getpid(),
            device_blocks_total=spec.num_blocks,
            block_size=spec.block_size,
            max_position=model_config.max_position,
            vocab_size=model_config.vocab_size,
            model=loaded.source.name,
            offload_blocks=self.runner.offload_blocks,
            max_running=self.runner.max_running,
        )
        if loaded.tokenizer.eos_id is not None:
            self.heartbeat.eos_id = loaded.tokenizer.eos_id

    def execute(self, plan: worker_pb2.StepPlan) -> worker_pb2.StepResult:
        started = time.perf_counter()
        try:
            outcome = self.runner.execute(plan_from_proto(plan))
        except Exception as e:  # noqa: BLE001 - one bad step fails its requests, not the worker
            log.exception("step %d failed", plan.step_id)
            return worker_pb2.StepResult(step_id=plan.step_id, error=f"{type(e).__name__}: {e}")
        return worker_pb2.StepResult(
            step_id=plan.step_id,
            tokens=tokens_to_proto(outcome.tokens),
            forward_s=time.perf_counter() - started,
            failed=[worker_pb2.SequenceError(seq_id=s, error=e) for s, e in outcome.failed.items()],
            recall=recall_to_proto(outcome.recall),
            compute_s=outcome.compute_s,
        )

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
            self.runner.release_all()
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
