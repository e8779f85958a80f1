"""scheduler process: gRPC `Scheduler` service for the gateway, ZMQ ROUTER for the workers.

One asyncio loop (uvloop) drives both: heartbeats and step results come in on the ROUTER,
the core plans the next step of each idle worker, plans go out on the same socket.
"""

from __future__ import annotations

import asyncio
import logging
import signal

import grpc
import zmq
import zmq.asyncio
from google.protobuf.message import DecodeError
from grpc_health.v1.health import HealthServicer

from pulseinfer.common import grpc_common
from pulseinfer.common.grpc_common import Undecodable, add_health_and_reflection, add_servicer, set_serving
from pulseinfer.kv_store.client import KVStoreClient
from pulseinfer.kv_store.prefix_cache import BlockEvents
from pulseinfer.proto.pulseinfer.v1 import generate_pb2, generate_pb2_grpc, kv_store_pb2, worker_pb2
from pulseinfer.scheduler.batcher import QueueFull, RequestTooLarge
from pulseinfer.scheduler.core import DuplicateRequest, NoWorkers, SchedulerConfig, SchedulerCore, Sink
from pulseinfer.scheduler.kv_store_link import KV_STORE_PREFIX_TIMEOUT_S, KVStoreMonitor, KVStorePrefix

log = logging.getLogger("scheduler")

SERVICE = generate_pb2.DESCRIPTOR.services_by_name["Scheduler"]
SUBMIT_ERRORS = {
    NoWorkers: grpc.StatusCode.UNAVAILABLE,
    QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    RequestTooLarge: grpc.StatusCode.INVALID_ARGUMENT,
    DuplicateRequest: grpc.StatusCode.ALREADY_EXISTS,
    ValueError: grpc.StatusCode.INVALID_ARGUMENT,
}
BLOCK_EVENTS_BATCH_S = 0.05  # a subscriber's events gathered this long (a step's stores come as one message)
BLOCK_EVENTS_CHUNK = 65536  # names per message: a snapshot of a large pool in messages well under gRPC's 4 MB


class GatewaySession:
    """One gateway's Session stream: the requests it submitted that have not finished, and the
    events not sent yet. The core calls a request's sink synchronously for each event, so a step's
    result piles up here whole and leaves as one message."""

    def __init__(self):
        self.open: set[str] = set()
        self.outbox: list[generate_pb2.ScheduleResponse] = []
        self.ready = asyncio.Event()  # the outbox has something, or the session ended
        self.ended = False
        # a request's last event in the outbox while it holds only tokens: later ones merge into it
        self._tokens: dict[str, generate_pb2.ScheduleResponse] = {}

    def sink(self, request_id: str) -> Sink:
        return lambda message: self._put(request_id, message)

    def accept(self, request_id: str) -> None:
        self.open.add(request_id)
        self._append(generate_pb2.ScheduleResponse(request_id=request_id, accepted=True))

    def refuse(self, request_id: str, code: grpc.StatusCode, error: str) -> None:
        self._append(generate_pb2.ScheduleResponse(request_id=request_id, refused_code=code.value[0], error=error))

    def take(self) -> generate_pb2.SessionEvents:
        events = generate_pb2.SessionEvents(responses=self.outbox)
        self.outbox, self._tokens = [], {}
        self.ready.clear()
        return events

    def end(self) -> None:
        self.ended = True
        self.ready.set()

    def _put(self, request_id: str, message: generate_pb2.ScheduleResponse) -> None:
        final = message.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED
        if final:
            self.open.discard(request_id)
        pending = self._tokens.pop(request_id, None) if final else self._tokens.get(request_id)
        if pending is not None:
            pending.MergeFrom(message)  # tokens extend the pending ones; a final completes them
            return
        message.request_id = request_id
        if not final:
            self._tokens[request_id] = message
        self._append(message)

    def _append(self, message: generate_pb2.ScheduleResponse) -> None:
        self.outbox.append(message)
        self.ready.set()


class SchedulerService(generate_pb2_grpc.SchedulerServicer):
    def __init__(
        self,
        core: SchedulerCore,
        router: zmq.asyncio.Socket,
        kv_monitor: KVStoreMonitor,
        host_prefix: KVStorePrefix,
        health: HealthServicer,
    ):
        self.core = core
        self.router = router
        self.kv_monitor = kv_monitor
        self.host_prefix = host_prefix
        self.health = health

    async def Session(self, requests, context):
        """One gateway's requests on one stream: whatever its requests' events piled up since the
        last message goes out as one SessionEvents (a whole step's tokens, for all of them)."""
        session = GatewaySession()
        reader = asyncio.create_task(self._read_session(requests, session))
        try:
            while not session.ended:
                await session.ready.wait()
                if session.outbox:
                    yield session.take()
            reader.result()  # a reader that failed fails the session, with its error logged by gRPC
        finally:
            reader.cancel()
            for request_id in list(session.open):  # the gateway went away: free what it left running
                self.core.abort(request_id)

    async def _read_session(self, requests, session: GatewaySession) -> None:
        """The gateway's submits and aborts; the session ends with its side (it never half-closes
        while it wants answers)."""
        try:
            async for request in requests:
                self._on_session_request(request, session)
                await self.send(self.core.dispatch())
        finally:
            session.end()

    def _on_session_request(self, request: generate_pb2.SessionRequest | Undecodable, session: GatewaySession) -> None:
        if isinstance(request, Undecodable):
            session.refuse("", grpc.StatusCode.INVALID_ARGUMENT, f"the SessionRequest does not decode: {request.error}")
            return
        kind = request.WhichOneof("kind")
        if kind == "submit":
            self._submit(request.submit, session)
        elif kind == "abort":
            if request.abort in session.open:  # else it finished already, or is not this session's to abort
                self.core.abort(request.abort)
        else:
            session.refuse("", grpc.StatusCode.INVALID_ARGUMENT, "a SessionRequest must carry submit or abort")

    def _submit(self, request: generate_pb2.ScheduleRequest, session: GatewaySession) -> None:
        request_id = request.request_id
        if not request_id:
            session.refuse("", grpc.StatusCode.INVALID_ARGUMENT, "a submit needs a request_id: the session's events name it")
            return
        try:
            self.core.submit(request, session.sink(request_id))
        except tuple(SUBMIT_ERRORS) as e:
            session.refuse(request_id, next(c for kind, c in SUBMIT_ERRORS.items() if isinstance(e, kind)), str(e))
        except Exception as e:  # a bug met by one request fails it alone, not the session's others
            log.exception("submit of %r failed", request_id)
            session.refuse(request_id, grpc.StatusCode.INTERNAL, f"the scheduler failed the submit: {e}")
        else:
            session.accept(request_id)

    async def Abort(self, request, context):
        return generate_pb2.AbortResponse(found=self.core.abort(request.request_id))

    async def ResetPrefixCache(self, request, context):
        freed = self.core.reset_prefix_cache() + self.host_prefix.drop_prefix_cache()
        return generate_pb2.ResetPrefixCacheResponse(freed_blocks=freed)

    async def Drain(self, request, context):
        if not self.core.draining:
            log.info("draining: new requests are refused from now on")
            self.core.draining = True
            await set_serving(self.health, [SERVICE.full_name], False)
        return generate_pb2.DrainResponse(running=len(self.core.requests))

    async def BlockEvents(self, request, context):
        """The node's block events for one gateway: a snapshot unless it resumes, then what changes."""
        journal = self.core.blocks.journal
        changed = asyncio.Event()
        journal.listeners.append(changed.set)
        epoch, since = request.epoch, request.since
        try:
            while True:
                changed.clear()
                events = journal.since(epoch, since, lambda: self.core.blocks.holders)
                for batch in event_batches(events):
                    yield batch
                epoch, since = events.epoch, events.next
                await changed.wait()
                await asyncio.sleep(BLOCK_EVENTS_BATCH_S)
        finally:
            journal.listeners.remove(changed.set)

    async def Stats(self, request, context):
        stats = self.core.stats()
        stats.MergeFrom(self.kv_monitor.stats())
        return stats

    async def send(self, messages: list[tuple[bytes, bytes]]) -> None:
        """Serialized SchedulerMessages to workers' step sockets."""
        for identity, payload in messages:
            try:
                await self.router.send_multipart([identity, payload])
            except zmq.ZMQError:  # EHOSTUNREACH: the step socket is not connected; retried each liveness tick
                self.core.send_failed(identity, payload)


def event_batches(events: BlockEvents) -> list[kv_store_pb2.PrefixEvents]:
    """`events` in messages of at most BLOCK_EVENTS_CHUNK names; only the first carries `snapshot`."""
    names = [(name, True) for name in events.stored] + [(name, False) for name in events.removed]
    batches = []
    for start in range(0, max(len(names), 1), BLOCK_EVENTS_CHUNK):
        chunk = names[start : start + BLOCK_EVENTS_CHUNK]
        batches.append(
            kv_store_pb2.PrefixEvents(
                epoch=events.epoch,
                next=events.next,
                snapshot=events.snapshot and start == 0,
                stored=[n for n, stored in chunk if stored],
                removed=[n for n, stored in chunk if not stored],
            )
        )
    return batches


async def receive_loop(service: SchedulerService, router: zmq.asyncio.Socket) -> None:
    core = service.core
    while True:
        identity, *frames = await router.recv_multipart()
        try:
            message = worker_pb2.WorkerMessage.FromString(frames[0])
        except (DecodeError, IndexError):
            log.warning("dropped a malformed message from %r", identity)
            continue
        kind = message.WhichOneof("kind")
        if kind == "heartbeat":
            known = message.heartbeat.worker_id in core.workers
            core.on_heartbeat(message.heartbeat)
            if not known:
                log.info("worker %d (pid %d) joined", message.heartbeat.worker_id, message.heartbeat.pid)
        elif kind == "result":
            core.on_result(identity, message.result)
        await service.send(core.dispatch())


async def liveness_loop(service: SchedulerService) -> None:
    interval = service.core.config.worker_timeout_s / 4
    while True:
        await asyncio.sleep(interval)
        for worker_id in service.core.check_liveness():
            log.warning("worker %d missed heartbeats for %.1f s; its requests fail", worker_id, service.core.config.worker_timeout_s)
        await service.send(service.core.take_unsent() + service.core.dispatch())


async def serve(config: SchedulerConfig) -> None:
    context = zmq.asyncio.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.bind(config.workers_bind)
    host_prefix = KVStorePrefix(KVStoreClient(zmq.Context.instance(), config.kv_store, timeout_s=KV_STORE_PREFIX_TIMEOUT_S))
    core = SchedulerCore(config, host=host_prefix.of_worker)
    server = grpc_common.server()
    health = add_health_and_reflection(server, [SERVICE.full_name])
    service = SchedulerService(core, router, KVStoreMonitor(context, config.kv_store, core.blocks), host_prefix, health)
    add_servicer(server, service, SERVICE)
    if server.add_insecure_port(config.grpc_bind) == 0:
        raise RuntimeError(f"cannot listen on {config.grpc_bind}")
    if config.listen:
        config.tls.add_port(server, config.listen)
    await server.start()
    await set_serving(health, [SERVICE.full_name], True)
    log.info(
        "scheduler: gRPC on %s%s, workers on %s", config.grpc_bind, f" and {config.listen}" if config.listen else "", config.workers_bind
    )
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    loops = [receive_loop(service, router), liveness_loop(service), service.kv_monitor.run(), stop.wait()]
    tasks = [asyncio.create_task(t) for t in loops]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()  # a loop that failed takes the scheduler down with its error
    finally:
        for task in tasks:
            task.cancel()
        await server.stop(grace=1)
        router.close()
        host_prefix.close()
        context.term()
