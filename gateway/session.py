"""The gateway's one `Scheduler.Session` stream (docs/architecture.md): every request of this process
multiplexed on it, so a step's tokens for all of them arrive as one message, not one gRPC message
per token per request."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from pulseinfer.proto.pulseinfer.v1 import generate_pb2, generate_pb2_grpc

log = logging.getLogger("gateway")

Inbox = asyncio.Queue[generate_pb2.ScheduleResponse]


class SchedulerSession:
    """Opened by the first request, and again by the first request after it broke (the scheduler
    died): a restarted scheduler is used without restarting the gateway."""

    def __init__(self, scheduler: generate_pb2_grpc.SchedulerStub):
        self.scheduler = scheduler
        self._link: Link | None = None
        self.lost_at: float | None = None  # when the last session broke (the router avoids the node until it answers again)

    def submit(self, request: generate_pb2.ScheduleRequest) -> Submitted:
        if self._link is None or self._link.broken:
            self._link = Link(self.scheduler, self._lost)
        return self._link.submit(request)

    def _lost(self) -> None:
        self.lost_at = time.monotonic()

    def fail(self, error: str) -> None:
        """The scheduler is unreachable: its open requests end now with `error`, not when TCP gives up."""
        if self._link is not None and not self._link.broken:
            self._link.fail(error)


@dataclass(frozen=True)
class Submitted:
    """One request's end of the session: its events, in order, ending with a final (finish_reason
    set) or a refusal; a session that breaks ends it with a final naming the loss."""

    link: Link
    request_id: str
    inbox: Inbox

    async def first(self) -> generate_pb2.ScheduleResponse:
        return await self.inbox.get()

    async def pending(self) -> list[generate_pb2.ScheduleResponse]:
        """Waits for an event, then takes every one already queued: a consumer that fell behind
        catches up in one go."""
        events = [await self.inbox.get()]
        while not self.inbox.empty():
            events.append(self.inbox.get_nowait())
        return events

    def close(self) -> None:
        """The consumer is done: a request still running is aborted."""
        self.link.release(self.request_id)


class Link:
    """One Session call: a writer fed by a queue (grpc consumes the request iterator; nothing else
    writes) and a reader that hands each event to its request's inbox."""

    def __init__(self, scheduler: generate_pb2_grpc.SchedulerStub, on_fail: Callable[[], None]):
        self.broken = False
        self._on_fail = on_fail
        self._outgoing: asyncio.Queue[generate_pb2.SessionRequest] = asyncio.Queue()
        self._inboxes: dict[str, Inbox] = {}
        self._call = scheduler.Session(self._requests())
        self._reader = asyncio.create_task(self._read())  # held: the loop keeps only a weak reference to a task

    def submit(self, request: generate_pb2.ScheduleRequest) -> Submitted:
        inbox = self._inboxes[request.request_id] = asyncio.Queue()  # before the submit leaves: no event can miss it
        self._outgoing.put_nowait(generate_pb2.SessionRequest(submit=request))
        return Submitted(self, request.request_id, inbox)

    def release(self, request_id: str) -> None:
        if self._inboxes.pop(request_id, None) is not None and not self.broken:
            self._outgoing.put_nowait(generate_pb2.SessionRequest(abort=request_id))

    async def _requests(self) -> AsyncIterator[generate_pb2.SessionRequest]:
        while True:
            yield await self._outgoing.get()

    async def _read(self) -> None:
        reason = "the scheduler ended the session"
        try:
            async for events in self._call:
                for response in events.responses:
                    self._deliver(response)
        except grpc.aio.AioRpcError as e:
            reason = e.details() or e.code().name
        except asyncio.CancelledError:
            reason = "the gateway closed the session"
            raise
        finally:
            self.fail(f"lost the scheduler: {reason}")

    def _deliver(self, response: generate_pb2.ScheduleResponse) -> None:
        inbox = self._inboxes.get(response.request_id)
        if inbox is None:  # released (an abort's final, tokens in flight), or a refusal naming no request
            if response.refused_code:
                log.warning("the scheduler refused a session request: %s", response.error)
            return
        if response.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED or response.refused_code:
            del self._inboxes[response.request_id]
        inbox.put_nowait(response)

    def fail(self, error: str) -> None:
        if self.broken:
            return
        self.broken = True
        self._on_fail()
        self._call.cancel()
        if self._inboxes:
            log.warning("%s; %d open requests failed", error, len(self._inboxes))
        lost = generate_pb2.ScheduleResponse(finish_reason=generate_pb2.FINISH_REASON_ERROR, error=error)
        for inbox in self._inboxes.values():
            inbox.put_nowait(lost)
        self._inboxes.clear()
