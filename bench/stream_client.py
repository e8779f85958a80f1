"""A raw-asyncio client of the gateway for `pulseinfer bench control-plane`: many concurrent
streaming completions, each on a connection of its own, every server-sent event stamped as its
read arrives (no HTTP library between the socket and the clock); and /metrics read at the moments
that bound the steady window (every request has its first token; the first one finishes)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

METRIC = "pulseinfer:"
OPEN_EVENT = re.compile(rb'"finish_reason":\s*null')  # a chunk of text: the request has not finished
REQUEST_TIMEOUT_S = 900.0


@dataclass
class Timeline:
    """One request as its client saw it."""

    events: list[float] = field(default_factory=list)  # arrival of each event that carried text (one or more tokens)
    finished: float | None = None  # arrival of its finish event
    completion_tokens: int = 0  # from usage: the gateway may merge tokens into one event when it falls behind
    error: str | None = None

    def add(self, now: float, event: bytes) -> str | None:
        """Records one SSE event; 'text' or 'finish' for those that mark the window, else None. Only the
        error and the usage are parsed: in a text chunk a quote is escaped, so a bare key cannot occur."""
        data = event.removeprefix(b"data: ")
        if data == event or data == b"[DONE]":
            return None
        if b'"usage"' in data:
            self.completion_tokens = json.loads(data)["usage"]["completion_tokens"]
            return None
        if b'"error"' in data:
            self.error = json.loads(data)["error"]["message"]
            return None
        if OPEN_EVENT.search(data):
            self.events.append(now)
            return "text"
        self.finished = now
        return "finish"

    @property
    def tpot_s(self) -> float | None:
        """(last event - first event) / (tokens - 1): the time per output token after the first."""
        if self.completion_tokens < 2 or not self.events:
            return None
        return (self.events[-1] - self.events[0]) / (self.completion_tokens - 1)


Scrape = tuple[float, dict[str, float]]  # (when, /metrics summed over workers)


class LiveWindow:
    """Reads /metrics the moment every request has its first token and the moment the first one
    finishes; no start read when a request finished before the last one started (no steady window)."""

    def __init__(self, batch: int, scrape: Callable[[], Awaitable[Scrape]]):
        self.missing = batch
        self.scrape = scrape
        self.start: asyncio.Task | None = None
        self.end: asyncio.Task | None = None

    def first_text(self) -> None:
        self.missing -= 1
        if self.missing == 0 and self.end is None:
            self.start = asyncio.ensure_future(self.scrape())

    def finish(self) -> None:
        if self.end is None:
            self.end = asyncio.ensure_future(self.scrape())


class Dechunker:
    """The body of an HTTP/1.1 chunked response, as its reads arrive (chunks may split anywhere)."""

    def __init__(self) -> None:
        self.raw = b""
        self.ended = False

    def feed(self, data: bytes) -> bytes:
        self.raw += data
        body = []
        while not self.ended:
            line, found, rest = self.raw.partition(b"\r\n")
            if not found:
                break
            size = int(line.split(b";", 1)[0], 16)
            if len(rest) < size + 2:
                break
            body.append(rest[:size])
            self.raw = rest[size + 2 :]
            self.ended = size == 0
        return b"".join(body)


class Stream(asyncio.Protocol):
    """One streaming completion on its own connection: the time of each read, its events split out."""

    def __init__(self, request: bytes, timeline: Timeline, window: LiveWindow):
        self.request, self.timeline, self.window = request, timeline, window
        self.buffer = b""
        self.status: int | None = None
        self.chunks: Dechunker | None = None  # a chunked response's framing, stripped as it arrives
        self.done = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.Transport) -> None:
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if self.status is None:
            self.buffer += data
            head, found, data = self.buffer.partition(b"\r\n\r\n")
            if not found:
                return
            self.status, self.buffer = int(head.split(b" ", 2)[1]), b""
            if b"transfer-encoding: chunked" in head.lower():
                self.chunks = Dechunker()
        self.buffer += self.chunks.feed(data) if self.chunks is not None else data
        if self.status != 200:
            return  # the body is the error, read whole
        *events, self.buffer = self.buffer.split(b"\n\n")
        for event in events:
            kind = self.timeline.add(now, event)
            if kind == "text" and len(self.timeline.events) == 1:
                self.window.first_text()
            elif kind == "finish":
                self.window.finish()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.status != 200:
            self.timeline.error = f"HTTP {self.status}: {self.buffer[:500].decode(errors='replace')}"
        elif exc is not None or self.timeline.finished is None:
            self.timeline.error = f"the stream ended unfinished: {exc or 'connection closed'}"
        self.done.set_result(None)


def parse_metrics(text: str) -> dict[str, float]:
    """pulseinfer:* samples, summed over their labels (the largest for a *_max)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(METRIC):
            continue
        sample, value = line.rsplit(" ", 1)
        name = sample.partition("{")[0]
        out[name] = max(out.get(name, 0.0), float(value)) if name.endswith("_max") else out.get(name, 0.0) + float(value)
    return out


async def scrape(port: int) -> Scrape:
    """/metrics, stamped with the middle of its round trip."""
    sent = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
    raw = await reader.read()
    received = time.perf_counter()
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    if b" 200 " not in head.split(b"\r\n", 1)[0]:
        raise RuntimeError(f"GET /metrics failed: {head[:200].decode(errors='replace')}")
    return (sent + received) / 2, parse_metrics(body.decode())


async def stream_all(port: int, batch_requests: list[bytes]) -> tuple[list[Timeline], Scrape | None, Scrape | None]:
    loop = asyncio.get_running_loop()
    window = LiveWindow(len(batch_requests), lambda: scrape(port))
    timelines = [Timeline() for _ in batch_requests]
    streams = []
    for request, timeline in zip(batch_requests, timelines):
        _, stream = await loop.create_connection(lambda r=request, t=timeline: Stream(r, t, window), "127.0.0.1", port)
        streams.append(stream)
    await asyncio.wait_for(asyncio.gather(*(s.done for s in streams)), REQUEST_TIMEOUT_S)
    failed = [t.error for t in timelines if t.error is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(timelines)} requests failed; the first: {failed[0]}")
    start = await window.start if window.start is not None else None
    end = await window.end if window.end is not None else None
    return timelines, start, end
