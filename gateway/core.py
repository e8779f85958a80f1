"""What both front ends (OpenAI HTTP and the public gRPC API) share: prompt checks, the call
to the scheduler, incremental detokenization with stop strings, and latency metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import time
import uuid
from array import array
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import grpc

from pulseinfer.common.model.meta import ModelMeta
from pulseinfer.common.model.tokenizer import TextStream
from pulseinfer.gateway.grammar_checks import GrammarChecks
from pulseinfer.gateway.metrics import GatewayMetrics
from pulseinfer.gateway.nodes import Nodes, summed
from pulseinfer.gateway.session import Submitted
from pulseinfer.messages.plan import Logprobs
from pulseinfer.messages.sampling import ParamError, SamplingParams, check_token_ids
from pulseinfer.messages.wire import logprobs_from_proto, params_to_proto
from pulseinfer.proto.pulseinfer.v1 import generate_pb2

FINISH_NAMES = {
    generate_pb2.FINISH_REASON_STOP: "stop",
    generate_pb2.FINISH_REASON_LENGTH: "length",
    generate_pb2.FINISH_REASON_ABORT: "abort",
    generate_pb2.FINISH_REASON_ERROR: "error",
}
STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}  # a refusal's refused_code


def key_matches(authorization: str, api_key: str) -> bool:
    """`Authorization: Bearer <key>`, compared in constant time."""
    return hmac.compare_digest(authorization.encode(), f"Bearer {api_key}".encode())


class GenerationError(Exception):
    """A request the cluster refused or could not finish; `status` is the gRPC code."""

    def __init__(self, status: grpc.StatusCode, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Prompt:
    """A prompt as a client sent it: text, token ids, or chat turns ({"role", "content"})."""

    text: str | None = None
    token_ids: list[int] | None = None
    chat: list[dict[str, Any]] | None = None
    tools: tuple[dict[str, Any], ...] | None = None  # a chat's tools, for its template
    template_kwargs: dict[str, Any] | None = None  # chat_template_kwargs


@dataclass(frozen=True)
class Prepared:
    request_id: str
    # a tuple of ints the garbage collector untracks: as lists, 256 prompts of 32k make every full
    # collection scan 8M items (70 ms measured), a stall of every stream
    prompt_ids: tuple[int, ...]
    params: SamplingParams


@dataclass(frozen=True)
class Delta:
    text: str
    token_ids: list[int]
    logprobs: Logprobs | None = None  # of token_ids, when asked
    prompt_logprobs: Logprobs | None = None  # the next prompt tokens' (from the second), before any token


@dataclass(frozen=True)
class Final:
    finish_reason: str  # stop | length | abort | error
    prompt_tokens: int
    completion_tokens: int
    error: str = ""
    timings: generate_pb2.Timings | None = None
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


def _joined(messages: list[generate_pb2.ScheduleResponse], field: str) -> Logprobs | None:
    """The messages' Logprobs in `field`, concatenated (None: none has any)."""
    joined = generate_pb2.Logprobs()
    for message in messages:
        if message.HasField(field):
            joined.MergeFrom(getattr(message, field))
    return logprobs_from_proto(joined) if joined.logprobs else None


class GatewayCore:
    def __init__(
        self,
        meta: ModelMeta,
        model_id: str,
        nodes: Nodes,
        metrics: GatewayMetrics,
        grammars: GrammarChecks | None = None,
    ):
        """`grammars`: what structured outputs' grammars are checked with (None: they are refused)."""
        self.meta = meta
        self.grammars = grammars
        self.tokenizer = meta.tokenizer
        self.model_id = model_id
        self.nodes = nodes
        self.metrics = metrics

    @property
    def max_context(self) -> int:
        return self.meta.config.max_position

    async def tokenize(self, prompt: Prompt) -> list[int]:
        """Prompt ids, tokenized on a thread (the tokenizer releases the GIL) so that a long prompt
        never stalls the event loop; raises ValueError for a prompt that cannot fit the context."""
        if prompt.token_ids is not None:
            return prompt.token_ids
        if prompt.chat is not None:  # the template writes any BOS it wants
            return await self.encode(self.render_chat(prompt), add_special=False)
        return await self.encode(prompt.text, add_special=True)

    def render_chat(self, prompt: Prompt, add_generation_prompt: bool = True) -> str:
        """A chat prompt's text; raises ValueError for one its template refuses."""
        return self.tokenizer.render_chat(prompt.chat, add_generation_prompt, prompt.tools, prompt.template_kwargs)

    async def encode(self, text: str, add_special: bool) -> list[int]:
        """A text's ids, tokenized on a thread; a text too long to fit the context whatever its
        tokens (no token is longer than max_token_chars) is refused at once, not tokenized to find out."""
        if len(text) > self.max_context * self.tokenizer.max_token_chars:
            raise ValueError(f"the prompt ({len(text)} characters) is longer than this model's context of {self.max_context} tokens")
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special)

    @property
    def vocab_size(self) -> int:
        return self.meta.config.vocab_size

    def prepare(self, prompt_ids: list[int], params: SamplingParams, max_tokens_given: bool) -> Prepared:
        """Checks a request against the model; raises ParamError with the reason and the field."""
        vocab = self.vocab_size
        if not prompt_ids:
            raise ParamError("the prompt is empty", "prompt")
        check_token_ids(prompt_ids, vocab, "prompt token ids", "prompt")
        room = self.max_context - len(prompt_ids)
        if room < 1:
            raise ParamError(f"the prompt has {len(prompt_ids)} tokens; this model's context is {self.max_context} tokens", "prompt")
        if max_tokens_given and params.max_tokens > room:
            raise ParamError(
                f"max_tokens ({params.max_tokens}) + prompt ({len(prompt_ids)} tokens) exceeds the context of {self.max_context} tokens",
                "max_tokens",
            )
        params = dataclasses.replace(params, max_tokens=min(params.max_tokens, room))
        params.validate(vocab)
        return Prepared(uuid.uuid4().hex, tuple(prompt_ids), params)  # unguessable: no client can name another's request

    async def check_structured(self, params: SamplingParams) -> None:
        """A request's structured output checked before it is queued, once whatever its prompts and
        n (its params validated by prepare): in a helper process, off the event loop. ParamError
        naming "structured" or "min_tokens"."""
        if params.structured is None:
            return
        if self.grammars is None:
            raise ParamError("this server does not serve structured outputs", "structured")
        try:
            await self.grammars.check(*params.structured, params.min_tokens)
        except ParamError:
            self.metrics.grammar_checks.inc(result="refused")
            raise
        self.metrics.grammar_checks.inc(result="ok")

    async def generate(self, request: Prepared) -> AsyncIterator[Delta | Final]:
        """Streams text deltas, then one Final. Raises GenerationError only before the first event."""
        async with aclosing(await self.admit(request)) as events:
            async for event in events:
                yield event

    async def admit(self, request: Prepared) -> AsyncGenerator[Delta | Final, None]:
        """Submits the request and returns once the scheduler has accepted it (GenerationError if it
        refused): its events, text deltas then one Final, which a client reads as the request runs,
        however long it waits in the queue first. Closing them early aborts the request."""
        events = self._run(request)
        await anext(events)  # to the acceptance: from then on, closing the events ends the request
        return events

    async def _run(self, request: Prepared) -> AsyncGenerator[Delta | Final | None, None]:
        """None once the request is accepted, then its events."""
        arrived = time.perf_counter()
        try:
            node = self.nodes.place(request.request_id, request.prompt_ids)
        except LookupError as e:
            raise GenerationError(grpc.StatusCode.UNAVAILABLE, str(e)) from None
        submitted = node.session.submit(
            generate_pb2.ScheduleRequest(
                request_id=request.request_id, prompt_ids=request.prompt_ids, sampling=params_to_proto(request.params)
            )
        )
        try:
            await self._accepted(submitted)
            self.metrics.prompt_tokens.inc(len(request.prompt_ids))
            yield None
            async for event in self._events(submitted, request, arrived):
                yield event
        finally:
            submitted.close()  # no-op once finished; otherwise the scheduler frees the request
            self.nodes.release(request.request_id)

    async def _accepted(self, submitted: Submitted) -> None:
        first = await submitted.first()
        if first.refused_code:
            raise GenerationError(STATUS_CODES.get(first.refused_code, grpc.StatusCode.UNKNOWN), first.error)
        if not first.accepted:  # the session broke before the scheduler answered
            raise GenerationError(grpc.StatusCode.UNAVAILABLE, first.error or "the scheduler closed the request before accepting it")

    async def _events(self, submitted: Submitted, request: Prepared, arrived: float) -> AsyncIterator[Delta | Final]:
        """One Delta per wake-up, however many tokens arrived meanwhile: a gateway that falls
        behind sends fewer, larger events instead of a growing backlog."""
        p = request.params
        stream = TextStream(self.tokenizer, p.stop, request.prompt_ids, p.min_tokens, p.skip_special_tokens, p.include_stop_str_in_output)
        output = array("q")  # a container the garbage collector does not scan, as the prompt's tuple
        last_token_at = None
        while True:
            messages = await submitted.pending()
            if prompt_logprobs := _joined(messages, "prompt_logprobs"):
                self.metrics.prompt_tokens_scored.inc(len(prompt_logprobs))
                yield Delta("", [], prompt_logprobs=prompt_logprobs)
            tokens = [t for m in messages for t in m.token_ids]
            if tokens:
                last_token_at = self._observe_tokens(len(tokens), arrived, last_token_at)
                logprobs = _joined(messages, "logprobs")
                tokens, text = self._take(stream, output, tokens)
                if text or not stream.stopped or logprobs:
                    yield Delta(text, tokens, logprobs.slice(0, len(tokens)) if logprobs else None)
                if stream.stopped:
                    yield self._final(request, output, arrived, "stop")
                    return
            last = messages[-1]  # a request's final is the last event it gets
            if last.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED:
                tail = stream.flush()
                if tail:
                    yield Delta(tail, [])
                timings = last.timings if last.HasField("timings") else None
                yield self._final(request, output, arrived, FINISH_NAMES[last.finish_reason], last.error, timings, last.cached_tokens)
                return

    @staticmethod
    def _take(stream: TextStream, output: array[int], tokens: list[int]) -> tuple[list[int], str]:
        """Tokens that arrived together, taken into the output up to the one that completes a stop
        string (those after it were sampled, never part of the completion: its usage counts the
        same however the tokens were batched); with their text."""
        if not stream.stops:
            output.extend(tokens)
            return tokens, stream.update(output)
        text = []
        for taken, token in enumerate(tokens, 1):
            output.append(token)
            text.append(stream.update(output))
            if stream.stopped:
                return tokens[:taken], "".join(text)
        return tokens, "".join(text)

    def _observe_tokens(self, count: int, arrived: float, last_token_at: float | None) -> float:
        """Token metrics for `count` tokens arriving now; returns now. Tokens that arrived together
        share the time since the previous arrival (the first ones: nothing after the first token), so
        the ITL histogram's sum stays the time from first to last token."""
        now = time.perf_counter()
        self.metrics.generation_tokens.inc(count)
        if last_token_at is None:
            self.metrics.ttft.observe(now - arrived)
            gaps, gap = count - 1, 0.0
        else:
            gaps, gap = count, (now - last_token_at) / count
        for _ in range(gaps):
            self.metrics.itl.observe(gap)
        return now

    def _final(
        self, request: Prepared, output: array[int], arrived: float, reason: str, error: str = "", timings=None, cached_tokens: int = 0
    ) -> Final:
        self.metrics.e2e.observe(time.perf_counter() - arrived)
        self.metrics.finished.inc(finished_reason=reason)
        return Final(reason, len(request.prompt_ids), len(output), error, timings, cached_tokens)

    async def abort(self, request_id: str) -> bool:
        node = self.nodes.placed.get(request_id)
        return node is not None and (await node.scheduler.Abort(generate_pb2.AbortRequest(request_id=request_id))).found

    async def reset_prefix_cache(self) -> int:
        """Every node's prefix caches forget their blocks (the device blocks and host blocks freed);
        raises grpc.aio.AioRpcError naming a node that did not answer."""
        replies = await asyncio.gather(
            *(n.scheduler.ResetPrefixCache(generate_pb2.ResetPrefixCacheRequest()) for n in self.nodes.nodes.values())
        )
        for node in self.nodes.nodes.values():
            node.index.clear()
        return sum(r.freed_blocks for r in replies)

    async def cluster_stats(self) -> generate_pb2.SchedulerStats | None:
        """The nodes' stats summed (polled now), into the metrics; None when no node answers."""
        await self.nodes.poll()
        answered = [n.stats for n in self.nodes.nodes.values() if n.stats is not None]
        if not answered:
            return None
        stats = summed(answered)
        self.metrics.set_cluster(stats)
        return stats
