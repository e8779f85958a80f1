"""The gateway <-> scheduler Session stream, in process and without a model: the real
SchedulerService and GatewayCore over real gRPC, around a fake scheduler core."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from types import SimpleNamespace

import grpc
import pytest

from pulseinfer.common import grpc_common
from pulseinfer.gateway.core import Delta, Final, GatewayCore, GenerationError, Prepared
from pulseinfer.gateway.metrics import GatewayMetrics
from pulseinfer.gateway.nodes import Nodes
from pulseinfer.gateway.router import RouterConfig
from pulseinfer.messages.sampling import SamplingParams
from pulseinfer.proto.pulseinfer.v1 import generate_pb2, generate_pb2_grpc
from pulseinfer.scheduler.batcher import QueueFull, RequestTooLarge
from pulseinfer.scheduler.core import DuplicateRequest, NoWorkers
from pulseinfer.scheduler.server import SERVICE, SchedulerService

TIMEOUT_S = 20  # a test that hangs fails
REFUSALS = {
    "no-workers": (NoWorkers("no worker is alive"), grpc.StatusCode.UNAVAILABLE),
    "full": (QueueFull("the queue is full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    "too-large": (RequestTooLarge("too large"), grpc.StatusCode.INVALID_ARGUMENT),
    "duplicate": (DuplicateRequest("already in flight"), grpc.StatusCode.ALREADY_EXISTS),
}


class FakeCore:
    """SchedulerCore's contract with the service: submit with a sink, abort, dispatch; `step` plays
    a worker's step result, calling sinks synchronously as the real core does."""

    def __init__(self):
        self.sinks: dict[str, Callable[[generate_pb2.ScheduleResponse], None]] = {}
        self.aborted: list[str] = []

    def submit(self, request: generate_pb2.ScheduleRequest, sink) -> None:
        if request.request_id in REFUSALS:
            raise REFUSALS[request.request_id][0]
        self.sinks[request.request_id] = sink

    def abort(self, request_id: str) -> bool:
        if request_id not in self.sinks:
            return False
        self.aborted.append(request_id)
        self.finish(request_id, generate_pb2.FINISH_REASON_ABORT)
        return True

    def dispatch(self) -> list:
        return []

    def step(self, tokens: dict[str, int]) -> None:
        for request_id, token in tokens.items():
            self.sinks[request_id](generate_pb2.ScheduleResponse(token_ids=[token]))

    def finish(self, request_id: str, reason: int = generate_pb2.FINISH_REASON_LENGTH) -> None:
        timings = generate_pb2.Timings(e2e_s=0.5)
        self.sinks.pop(request_id)(generate_pb2.ScheduleResponse(finish_reason=reason, timings=timings, cached_tokens=2))


class LetterTokenizer:
    """Token i is the letter chr(97 + i)."""

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return "".join(chr(97 + i) for i in ids)


async def start_scheduler(core: FakeCore, port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc_common.server()
    grpc_common.add_servicer(server, SchedulerService(core, None, None, None, None), SERVICE)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


def gateway(channel: grpc.aio.Channel) -> GatewayCore:
    meta = SimpleNamespace(tokenizer=LetterTokenizer(), config=SimpleNamespace(max_position=64, vocab_size=26))
    metrics = GatewayMetrics()
    nodes = Nodes("127.0.0.1:1", RouterConfig(), lambda address, server_name: channel, metrics)
    return GatewayCore(meta, "fake", nodes, metrics)


def prepared(request_id: str, stop: tuple[str, ...] = ()) -> Prepared:
    return Prepared(request_id, [1, 2, 3], SamplingParams(max_tokens=8, stop=stop))


async def until(predicate: Callable[[], object], what: str, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def run(test: Callable[[FakeCore, int], Awaitable[None]]) -> None:
    """Runs `test(core, port)` with a scheduler service on a free port."""

    async def main() -> None:
        core = FakeCore()
        server, port = await start_scheduler(core)
        try:
            await asyncio.wait_for(test(core, port), TIMEOUT_S)
        finally:
            await server.stop(None)

    asyncio.run(main())


def submit(request_id: str) -> generate_pb2.SessionRequest:
    return generate_pb2.SessionRequest(submit=generate_pb2.ScheduleRequest(request_id=request_id, prompt_ids=[1]))


def test_a_steps_tokens_for_all_requests_leave_as_one_message():
    async def test(core: FakeCore, port: int) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            outgoing: asyncio.Queue = asyncio.Queue()
            call = generate_pb2_grpc.SchedulerStub(channel).Session(iter_queue(outgoing))
            ids = [f"r{i}" for i in range(8)]
            for request_id in ids:
                outgoing.put_nowait(submit(request_id))
            accepted = []
            while len(accepted) < len(ids):
                accepted += [r.request_id for r in (await call.read()).responses if r.accepted]
            assert accepted == ids
            # two steps and a finish, all before the session task runs: one message, one response per request
            core.step({request_id: 1 for request_id in ids})
            core.step({request_id: 2 for request_id in ids})
            core.finish("r0")
            events = await call.read()
            assert [r.request_id for r in events.responses] == ids
            assert all(list(r.token_ids) == [1, 2] for r in events.responses)
            assert events.responses[0].finish_reason == generate_pb2.FINISH_REASON_LENGTH and events.responses[0].timings.e2e_s == 0.5
            assert all(r.finish_reason == generate_pb2.FINISH_REASON_UNSPECIFIED for r in events.responses[1:])
            call.cancel()
            # the gateway went away: every request it left running is aborted, the finished one is not
            await until(lambda: sorted(core.aborted) == ids[1:], "the session's open requests aborted")

    run(test)


async def iter_queue(queue: asyncio.Queue):
    while True:
        yield await queue.get()


def test_malformed_session_requests_are_refused_and_the_session_lives():
    async def test(core: FakeCore, port: int) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            method = f"/{SERVICE.full_name}/Session"
            call = channel.stream_stream(method, response_deserializer=generate_pb2.SessionEvents.FromString)()
            bad = [b"\xff\xff", generate_pb2.SessionRequest(), submit(""), submit("ok")]
            for message in bad:
                await call.write(message if isinstance(message, bytes) else message.SerializeToString())
            responses = []
            while len(responses) < len(bad):
                responses += (await call.read()).responses
            assert [r.refused_code for r in responses[:3]] == [grpc.StatusCode.INVALID_ARGUMENT.value[0]] * 3
            assert "does not decode" in responses[0].error and "submit or abort" in responses[1].error
            assert "needs a request_id" in responses[2].error
            assert responses[3].request_id == "ok" and responses[3].accepted
            call.cancel()

    run(test)


def test_refusals_raise_generation_errors_and_the_session_serves_on():
    async def test(core: FakeCore, port: int) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            gw = gateway(channel)
            for request_id, (error, code) in REFUSALS.items():
                with pytest.raises(GenerationError) as refused:
                    await anext(gw.generate(prepared(request_id)))
                assert refused.value.status == code and refused.value.message == str(error)
            events = gw.generate(prepared("fine"))
            first = asyncio.ensure_future(anext(events))
            await until(lambda: "fine" in core.sinks, "the request submitted")
            core.step({"fine": 7})
            assert await first == Delta("h", [7])
            core.finish("fine")
            final = await anext(events)
            assert final == Final("length", 3, 1, timings=generate_pb2.Timings(e2e_s=0.5), cached_tokens=2)

    run(test)


def test_a_consumer_that_stops_early_aborts_its_request():
    async def test(core: FakeCore, port: int) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            gw = gateway(channel)
            events = gw.generate(prepared("gone"))
            first = asyncio.ensure_future(anext(events))
            await until(lambda: "gone" in core.sinks, "the request submitted")
            core.step({"gone": 0})
            assert await first == Delta("a", [0])
            await events.aclose()  # a client disconnect
            await until(lambda: core.aborted == ["gone"], "the request aborted")
            # a stop string ends the stream at the gateway, and the request in the scheduler
            events = gw.generate(prepared("stops", stop=("cd",)))
            first = asyncio.ensure_future(anext(events))
            await until(lambda: "stops" in core.sinks, "the request submitted")
            for token in (1, 2, 3, 4):  # one message: the steps came before the session task ran
                core.step({"stops": token})
            assert await first == Delta("b", [1, 2, 3])  # "d" completes the stop string: "e" was sampled after it
            final = await anext(events)
            assert final.finish_reason == "stop" and final.completion_tokens == 3
            await events.aclose()  # as the front ends do after a Final
            await until(lambda: core.aborted == ["gone", "stops"], "the stopped request aborted")

    run(test)


def test_admit_returns_once_accepted_and_closing_a_queued_request_aborts_it():
    async def test(core: FakeCore, port: int) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            gw = gateway(channel)
            with pytest.raises(GenerationError):
                await gw.admit(prepared("full"))  # a refusal is raised by admit, before any event
            events = await gw.admit(prepared("queued"))  # accepted: no token is waited for
            assert "queued" in core.sinks and gw.metrics.value("pulseinfer:prompt_tokens_total") == 3
            await events.aclose()  # a client gone while its request waits in the queue
            await until(lambda: core.aborted == ["queued"], "the queued request aborted")

    run(test)


def test_a_consumer_that_falls_behind_gets_one_delta_for_all_new_tokens():
    async def test(core: FakeCore, port: int) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            gw = gateway(channel)
            events = gw.generate(prepared("slow"))
            first = asyncio.ensure_future(anext(events))
            await until(lambda: "slow" in core.sinks, "the request submitted")
            core.step({"slow": 0})
            assert await first == Delta("a", [0])
            for token in (1, 2, 3):  # separate messages: the session flushes between them
                core.step({"slow": token})
                await asyncio.sleep(0.05)
            core.finish("slow")
            await asyncio.sleep(0.05)
            assert [e async for e in events] == [
                Delta("bcd", [1, 2, 3]),
                Final("length", 3, 4, timings=generate_pb2.Timings(e2e_s=0.5), cached_tokens=2),
            ]
            metrics = gw.metrics
            assert metrics.value("pulseinfer:generation_tokens_total") == 4
            assert metrics.value("pulseinfer:time_to_first_token_seconds_count") == 1
            assert metrics.value("pulseinfer:inter_token_latency_seconds_count") == 3

    run(test)


def test_a_lost_scheduler_fails_open_requests_and_a_restarted_one_is_used():
    async def main() -> None:
        core = FakeCore()
        server, port = await start_scheduler(core)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            gw = gateway(channel)
            streams = [gw.generate(prepared(f"open{i}")) for i in range(3)]
            firsts = [asyncio.ensure_future(anext(s)) for s in streams]
            await until(lambda: len(core.sinks) == 3, "the requests submitted")
            core.step({"open0": 0, "open1": 0, "open2": 0})
            assert [await f for f in firsts] == [Delta("a", [0])] * 3
            await server.stop(None)  # as a kill -9 does: the connection goes
            for stream in streams:
                final = await anext(stream)
                assert final.finish_reason == "error" and final.error.startswith("lost the scheduler"), final
            core = FakeCore()
            server, _ = await start_scheduler(core, port)
            await asyncio.wait_for(channel.channel_ready(), 10)
            events = gw.generate(prepared("again"))
            first = asyncio.ensure_future(anext(events))
            await until(lambda: "again" in core.sinks, "the request submitted to the restarted scheduler")
            core.step({"again": 4})
            assert await first == Delta("e", [4])
            await events.aclose()
        await server.stop(None)

    asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
