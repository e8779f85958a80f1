"""One HTTP request's choices: each admitted generation's events (those read already, then the
rest), read whole or merged as they come, and a client's hanging up noticed while a response is made."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from dataclasses import dataclass
from typing import TypeVar

from starlette.requests import Request

from pulseinfer.gateway.core import Delta, Final
from pulseinfer.gateway.openai_responses import ChoiceOutput
from pulseinfer.messages.plan import Logprobs


@dataclass
class Choice:
    """One choice's generation, admitted: the events read already (head) and the rest."""

    index: int
    request_id: str
    head: list[Delta | Final]
    events: AsyncIterator[Delta | Final]
    prompt_ids: tuple[int, ...]
    echoed: str  # the text an echoing completion begins with ("" without echo)

    def prompt_logprobs_head(self) -> list[Delta | Final]:
        """The head a copy of this choice begins with: the prompt logprobs read so far, as one event."""
        scored = Logprobs.concat([e.prompt_logprobs for e in self.head if isinstance(e, Delta) and e.prompt_logprobs is not None])
        return [] if scored is None else [Delta("", [], prompt_logprobs=scored)]


async def read_to_first_token(choice: Choice) -> None:
    """Reads the choice's events into its head through its first token (or its Final): the prompt
    logprobs come before it."""
    while not choice.head or _before_first_token(choice.head[-1]):
        choice.head.append(await anext(choice.events))


def _before_first_token(event: Delta | Final) -> bool:
    return isinstance(event, Delta) and event.prompt_logprobs is not None


async def events_of(choice: Choice) -> AsyncIterator[Delta | Final]:
    """Its events, the head's first, through its Final; its stream closed after (also when cancelled)."""
    try:
        event = None
        for event in choice.head:
            yield event
        while not isinstance(event, Final):
            event = await anext(choice.events)
            yield event
    finally:
        await choice.events.aclose()


async def output_of(choice: Choice) -> ChoiceOutput:
    text, token_ids, logprobs, prompt_logprobs = [], [], [], []
    async with aclosing(events_of(choice)) as events:
        async for event in events:
            if isinstance(event, Delta):
                text.append(event.text)
                token_ids += event.token_ids
                logprobs += [event.logprobs] if event.logprobs is not None else []
                prompt_logprobs += [event.prompt_logprobs] if event.prompt_logprobs is not None else []
    return ChoiceOutput("".join(text), token_ids, Logprobs.concat(logprobs), Logprobs.concat(prompt_logprobs), event)


async def merged_events(choices: list[Choice]) -> AsyncIterator[tuple[int, Delta | Final]]:
    """The choices' events as they come, each with its choice's index. One choice is read as it is
    (no task, no queue: the common case, at every stream's token rate)."""
    if len(choices) == 1:
        async with aclosing(events_of(choices[0])) as events:
            async for event in events:
                yield choices[0].index, event
        return
    queue: asyncio.Queue[tuple[int, Delta | Final] | None] = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        async with aclosing(events_of(choice)) as events:
            async for event in events:
                queue.put_nowait((choice.index, event))
        queue.put_nowait(None)

    tasks = [asyncio.ensure_future(pump(choice)) for choice in choices]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def gathered(done: list[Choice], work: list[Awaitable[Choice]]) -> None:
    """Runs the work at once, appending each choice it returns to `done`; then raises the first error
    (every piece has ended: the caller can close what was done)."""

    async def run(piece: Awaitable[Choice]) -> None:
        done.append(await piece)

    results = await asyncio.gather(*(run(piece) for piece in work), return_exceptions=True)
    if errors := [r for r in results if isinstance(r, BaseException)]:
        raise errors[0]


class ClientGone(Exception):
    """The client hung up before its response was made."""


T = TypeVar("T")


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; if the client hangs up first, `work` is cancelled (a generation's stream
    closed aborts its request: nothing runs for nobody, queued or running) and ClientGone raised."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait([task, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # its aborts sent before the answer
    if task.cancelled():
        raise ClientGone
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
