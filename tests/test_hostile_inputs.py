"""Hostile-input audit: malformed and hostile requests over HTTP and gRPC against a real cluster.

Every case is one row of a data table (HTTP_CASES, GRPC_CASES) with the status the contract
requires: HTTP answers a 4xx with an OpenAI error body, never a 5xx or plain text; gRPC answers
the exact status code. The same cases are then fired all at once, from a thread pool, while a
normal HTTP stream and a normal gRPC stream run: those must produce the same text as when run
alone, and the cluster must be healthy and idle afterwards. Further tests cover request ownership
on gRPC (a client cannot abort another client's request; two clients may reuse one request_id)
and sampling parameters that could poison a shared batch (temperatures of 1e-40 and 1e-45).

The contract is the one the gateway is meant to meet; a failing case here is a product bug, not a
test to relax.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import os
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from http.client import HTTPException, HTTPResponse

import grpc
import pytest
from google.protobuf.message import Message
from serving_cluster import ServingCluster, children_of

from pulseinfer.common import grammar
from pulseinfer.common.grammar import GrammarTokenizer, GrammarVocab
from pulseinfer.common.model.meta import load_model_meta
from pulseinfer.gateway.grammar_checks import GrammarChecks, HelperFailed
from pulseinfer.gpu_worker.requests import RequestTable
from pulseinfer.messages.plan import SamplingSpec
from pulseinfer.messages.wire import sampling_to_proto
from pulseinfer.proto.pulseinfer.v1 import generate_pb2 as pb
from pulseinfer.proto.pulseinfer.v1 import generate_pb2_grpc, worker_pb2

API_KEY = "hostile-inputs-key"
MODEL = "SmolLM2-135M-Instruct"
VOCAB = 49152
CONTEXT = 8192
BODY_LIMIT = 2 * 1024 * 1024  # the gateway's default request body limit
BEARER = f"Bearer {API_KEY}"
AUTH = (("authorization", BEARER),)
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
BIG = "9" * 5000  # a 5,000-digit integer, over Python's default int parsing limit of 4,300 digits


def ref_chain(depth: int) -> dict:
    """A JSON schema whose $refs chain `depth` definitions, each an object holding the next."""
    definitions = {f"d{i}": {"type": "object", "properties": {"next": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(depth)}
    return {"$ref": "#/$defs/d0", "$defs": definitions | {f"d{depth}": {"type": "integer"}}}


def alternatives(count: int) -> str:
    """A Lark grammar of `count` strings to choose from, past llguidance's 2,000 at 2,001."""
    return "start: " + " | ".join(f'"option{i}"' for i in range(count))


RULE_CHAIN = "\n".join(["start: r0", *(f"r{i}: r{i + 1}" for i in range(3000)), 'r3000: "x"'])
# within every limit (two Lark rules), but its embedded schema overflows a grammar check's stack
STACK_BUSTER = "start: %json " + json.dumps(ref_chain(3000))
SELF_REF = {"$ref": "#"}
REQUIRED_RECURSION = {
    "$defs": {"node": {"type": "object", "properties": {"child": {"$ref": "#/$defs/node"}}, "required": ["child"]}},
    "$ref": "#/$defs/node",
}
TOOLS_3000 = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": {"type": "object"}}} for i in range(3000)]
# a choice first (so the gateway's check of the forced start passes), then a row past llguidance's limit
LATE_FAILURE = 'start: ("a" | "b") tail\ntail: ' + alternatives(2500).removeprefix("start: ")


# ---------------------------------------------------------------- helpers: HTTP


@dataclass(frozen=True)
class HttpReply:
    status: int  # 0: no HTTP response at all
    body: dict | str  # parsed JSON, else the text


def send_http(
    cluster: ServingCluster,
    method: str,
    path: str,
    body: bytes = b"",
    authorization: str | bytes | None = BEARER,
    chunked: bool = False,
    timeout_s: float = 120.0,
) -> HttpReply:
    """One HTTP/1.1 request on a raw socket, so that any body, header or framing can be sent.

    The body goes out in pieces; once the server answers (say a 413 before reading it all) the
    rest is not sent, and a connection the server closes mid-body still yields its response."""
    head = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{cluster.http_port}", "Connection: close", "Content-Type: application/json"]
    if authorization is not None:
        head.append("Authorization: " + (authorization.decode("latin-1") if isinstance(authorization, bytes) else authorization))
    if chunked:
        head.append("Transfer-Encoding: chunked")
        piece = 64 * 1024
        payload = (
            b"".join(b"%x\r\n%s\r\n" % (len(body[i : i + piece]), body[i : i + piece]) for i in range(0, len(body), piece)) + b"0\r\n\r\n"
        )
    else:
        if body or method in ("POST", "PUT"):
            head.append(f"Content-Length: {len(body)}")
        payload = body
    with socket.create_connection(("127.0.0.1", cluster.http_port), timeout=timeout_s) as sock:
        try:
            sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
            for start in range(0, len(payload), 64 * 1024):
                if select.select([sock], [], [], 0)[0]:
                    break  # the server has answered already
                sock.sendall(payload[start : start + 64 * 1024])
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server stopped reading; its answer may still be there
        response = HTTPResponse(sock, method=method)
        try:
            response.begin()
            raw = response.read()
        except (ConnectionResetError, HTTPException) as e:
            return HttpReply(0, f"no HTTP response: {e!r}")
    try:
        return HttpReply(response.status, json.loads(raw))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return HttpReply(response.status, raw.decode("utf-8", "replace"))


def http_json(cluster: ServingCluster, path: str, body: dict) -> HttpReply:
    return send_http(cluster, "POST", path, json.dumps(body).encode())


def sse_text(reply: HttpReply) -> tuple[str, list[str | None]]:
    """The text and finish reasons of a completed text_completion event stream."""
    assert reply.status == 200 and isinstance(reply.body, str), reply
    text, reasons = "", []
    for line in reply.body.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[len("data: ") :])
        assert "error" not in event, event
        for choice in event["choices"]:
            text += choice.get("text") or ""
            reasons.append(choice["finish_reason"])
    assert reply.body.rstrip().endswith("data: [DONE]"), reply.body[-300:]
    return text, [r for r in reasons if r]


def http_problems(reply: HttpReply, status: tuple[int, ...], code: str | None, param: str | None = None) -> list[str]:
    """What is wrong with an error reply; empty when it meets the contract (`param`: the field it must name)."""
    problems = []
    if reply.status not in status or not 400 <= reply.status < 500:
        problems.append(f"status {reply.status}, want {'/'.join(map(str, status))}")
    error = reply.body.get("error") if isinstance(reply.body, dict) else None
    if not isinstance(error, dict):
        problems.append(f"not an OpenAI error body: {str(reply.body)[:200]!r}")
        return problems
    if not isinstance(error.get("message"), str) or not error["message"]:
        problems.append(f"error.message missing or empty: {error!r:.200}")
    if not isinstance(error.get("type"), str) or not error["type"]:
        problems.append(f"error.type missing: {error!r:.200}")
    elif reply.status == 400 and error["type"] != "invalid_request_error":
        problems.append(f"error.type {error['type']!r}, want 'invalid_request_error'")
    if "param" not in error or "code" not in error:
        problems.append(f"error.param / error.code absent: {error!r:.200}")
    if code is not None and error.get("code") != code:
        problems.append(f"error.code {error.get('code')!r}, want {code!r}")
    if param is not None and error.get("param") != param:
        problems.append(f"error.param {error.get('param')!r}, want {param!r}")
    return problems


# ---------------------------------------------------------------- helpers: gRPC

GRPC_METHODS = {  # method -> (multi-callable kind, response type)
    "Generate": ("unary_stream", pb.GenerateResponse),
    "Abort": ("unary_unary", pb.AbortResponse),
    "GetModelInfo": ("unary_unary", pb.ModelInfo),
}


@dataclass(frozen=True)
class GrpcReply:
    code: grpc.StatusCode
    details: str
    responses: list = field(default_factory=list)


def new_channel(target: str) -> grpc.Channel:
    """A channel on its own TCP connection: plain channels to one target share a connection through
    gRPC's global subchannel pool, and the server would see them as one client."""
    return grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])


def grpc_start(channel: grpc.Channel, method: str, request: Message | bytes, metadata=AUTH, timeout_s: float = 120.0):
    """Starts a call on pulseinfer.v1.Generation; `request` may be raw bytes (sent as they are)."""
    kind, response = GRPC_METHODS[method]
    call = getattr(channel, kind)(
        f"/pulseinfer.v1.Generation/{method}", request_serializer=lambda b: b, response_deserializer=response.FromString
    )
    payload = request if isinstance(request, bytes) else request.SerializeToString()
    return call(payload, metadata=metadata, timeout=timeout_s)


def grpc_call(channel: grpc.Channel, method: str, request: Message | bytes, metadata=AUTH, timeout_s: float = 120.0) -> GrpcReply:
    """The call to its end: the status code, its details and every response."""
    try:
        result = grpc_start(channel, method, request, metadata, timeout_s)
        responses = list(result) if GRPC_METHODS[method][0] == "unary_stream" else [result]
    except grpc.RpcError as e:
        return GrpcReply(e.code(), e.details() or "")
    return GrpcReply(grpc.StatusCode.OK, "", responses)


def stream_result(reply: GrpcReply) -> tuple[str, list[int], pb.GenerateFinal]:
    """The text, token ids and final message of a Generate stream that must have succeeded."""
    assert reply.code == grpc.StatusCode.OK, reply
    assert reply.responses and reply.responses[-1].WhichOneof("event") == "final", reply.responses[-3:]
    chunks = [r.chunk for r in reply.responses[:-1]]
    assert all(r.WhichOneof("event") == "chunk" for r in reply.responses[:-1])
    return "".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids], reply.responses[-1].final


def grpc_problems(reply: GrpcReply, code: grpc.StatusCode) -> list[str]:
    if reply.code != code:
        got = (
            f"{reply.code.name}: {reply.details[:200]!r}"
            if reply.code != grpc.StatusCode.OK
            else f"OK with {len(reply.responses)} messages"
        )
        return [f"got {got}, want {code.name}"]
    if not reply.details:
        return ["no status details"]
    return []


# ---------------------------------------------------------------- the HTTP cases


@dataclass(frozen=True)
class HttpCase:
    id: str
    body: dict | str | bytes  # dict: JSON-encoded; str: JSON text as written (for NaN, \ud800, 5,000 digits); bytes: as is
    status: tuple[int, ...] = (400,)
    path: str = COMPLETIONS
    method: str = "POST"
    authorization: str | bytes | None = BEARER
    code: str | None = None
    chunked: bool = False
    param: str | None = None  # the field the error must name (None: not checked)

    def payload(self) -> bytes:
        if isinstance(self.body, bytes):
            return self.body
        return (self.body if isinstance(self.body, str) else json.dumps(self.body)).encode()


def completion(**fields) -> dict:
    """A valid completion body (one token) with `fields` replaced; a field set to ... is left out."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1} | fields
    return {k: v for k, v in body.items() if v is not ...}


def chat(**fields) -> dict:
    body = {"model": MODEL, "messages": USER, "max_tokens": 1} | fields
    return {k: v for k, v in body.items() if v is not ...}


def raw(fields: str, prompt: str = '"prompt": "hi"') -> str:
    """Completion JSON text with fields written literally (what json.dumps cannot or would not write)."""
    return "{" + prompt + ", " + fields + "}"


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def chunked_case(case_id: str, path: str, body: bytes) -> HttpCase:
    return HttpCase(case_id, body, (413,), path=path, chunked=True)


# valid requests of 3 MiB, their bulk in OpenAI's "user" field (an end-user id the server may ignore):
# only their size is wrong, and one accepted by mistake is cheap
OVERSIZED = json.dumps(completion(user="a" * (3 * 1024 * 1024))).encode()
OVERSIZED_CHAT = json.dumps(chat(user="b" * (3 * 1024 * 1024))).encode()
assert len(OVERSIZED) > BODY_LIMIT and len(OVERSIZED_CHAT) > BODY_LIMIT

HTTP_CASES = [
    # the body itself
    HttpCase("body latin-1 not UTF-8", '{"prompt": "caf\xe9", "max_tokens": 1}'.encode("latin-1")),
    HttpCase("chat body overlong UTF-8", b'{"messages": [{"role": "user", "content": "\xc0\xaf"}], "max_tokens": 1}', path=CHAT),
    HttpCase("body form-encoded not JSON", b"prompt=hi&max_tokens=1"),
    HttpCase("body empty", b""),
    HttpCase("body JSON with trailing garbage", b'{"prompt": "hi", "max_tokens": 1} x'),
    HttpCase("body JSON array", '[{"prompt": "hi", "max_tokens": 1}]'),
    HttpCase("body JSON number", "42"),
    HttpCase("body JSON string", '"hi"'),
    HttpCase("body JSON null", "null", path=CHAT),
    HttpCase("prompt nested 50000 deep", raw('"max_tokens": 1', prompt='"prompt": ' + nested(50_000))),
    HttpCase("prompt nested 100000 deep", raw('"max_tokens": 1', prompt='"prompt": ' + nested(100_000))),
    HttpCase("unknown field of objects nested 50000 deep", raw('"x": ' + '{"a": ' * 50_000 + "1" + "}" * 50_000)),
    HttpCase("chat messages nested 50000 deep", '{"max_tokens": 1, "messages": ' + nested(50_000) + "}", path=CHAT),
    # lone surrogates: valid JSON, but no valid string
    HttpCase("prompt lone high surrogate", raw('"max_tokens": 1', prompt=r'"prompt": "a\ud800b"')),
    HttpCase("prompt lone low surrogate", raw('"max_tokens": 1', prompt=r'"prompt": "a\udc00b"')),
    HttpCase("chat content lone surrogate", r'{"messages": [{"role": "user", "content": "a\ud800b"}], "max_tokens": 1}', path=CHAT),
    HttpCase(
        "chat content part lone surrogate",
        r'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\ud800b"}]}], "max_tokens": 1}',
        path=CHAT,
    ),
    HttpCase("stop string lone surrogate", raw(r'"max_tokens": 1, "stop": ["a\ud800b"]')),
    # integers of 5,000 digits
    HttpCase("max_tokens 5000 digits", raw(f'"max_tokens": {BIG}')),
    HttpCase("seed 5000 digits", raw(f'"max_tokens": 1, "seed": {BIG}')),
    HttpCase("top_k 5000 digits", raw(f'"max_tokens": 1, "top_k": {BIG}')),
    HttpCase("prompt token id 5000 digits", raw('"max_tokens": 1', prompt=f'"prompt": [1, {BIG}]')),
    HttpCase("stop_token_ids 5000 digits", raw(f'"max_tokens": 1, "stop_token_ids": [{BIG}]')),
    # max_tokens / max_completion_tokens
    HttpCase("chat max_tokens 0", chat(max_tokens=0), path=CHAT, param="max_tokens"),
    HttpCase("max_tokens -1", completion(max_tokens=-1)),
    HttpCase("max_tokens 1.5", completion(max_tokens=1.5)),
    HttpCase("max_tokens string", completion(max_tokens="10")),
    HttpCase("max_tokens true", completion(max_tokens=True)),
    HttpCase("max_tokens 2**32", completion(max_tokens=2**32), param="max_tokens"),
    HttpCase("max_tokens 2**64", completion(max_tokens=2**64)),
    HttpCase("max_completion_tokens 0", chat(max_tokens=..., max_completion_tokens=0), path=CHAT, param="max_completion_tokens"),
    HttpCase("max_completion_tokens string", chat(max_tokens=..., max_completion_tokens="8"), path=CHAT),
    HttpCase("max_completion_tokens 2**64", chat(max_tokens=..., max_completion_tokens=2**64), path=CHAT),
    # temperature
    HttpCase("temperature -1", completion(temperature=-1), param="temperature"),
    HttpCase("temperature string", completion(temperature="hot")),
    HttpCase("temperature 1e400 (inf)", raw('"max_tokens": 1, "temperature": 1e400')),
    HttpCase("temperature -1e400 (-inf)", raw('"max_tokens": 1, "temperature": -1e400')),
    HttpCase("temperature NaN", raw('"max_tokens": 1, "temperature": NaN')),
    HttpCase(
        "chat temperature Infinity",
        '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": Infinity}',
        path=CHAT,
    ),
    # top_p
    HttpCase("top_p 0", completion(top_p=0), param="top_p"),
    HttpCase("chat top_p 1.5", chat(top_p=1.5), path=CHAT, param="top_p"),
    HttpCase("top_p -0.1", completion(top_p=-0.1), param="top_p"),
    HttpCase("top_p NaN", raw('"max_tokens": 1, "top_p": NaN')),
    # top_k
    HttpCase("top_k -1", completion(top_k=-1), param="top_k"),
    HttpCase("top_k 2**32", completion(top_k=2**32)),
    HttpCase("top_k 2**40", completion(top_k=2**40)),
    HttpCase("top_k over the vocabulary", completion(top_k=VOCAB + 1), param="top_k"),
    HttpCase("top_k 1.5", completion(top_k=1.5)),
    # seed
    HttpCase("seed -1", completion(seed=-1), param="seed"),
    HttpCase("seed 2**63", completion(seed=2**63), param="seed"),
    HttpCase("seed 2**64", completion(seed=2**64)),
    HttpCase("seed 1.5", completion(seed=1.5)),
    HttpCase("seed string", completion(seed="7")),
    # stop / stop_token_ids
    HttpCase("stop number", completion(stop=5)),
    HttpCase("stop array of numbers", completion(stop=[1])),
    HttpCase("stop empty string in array", completion(stop=[""])),
    HttpCase("stop empty string", completion(stop="")),
    HttpCase("stop 17 strings", completion(stop=[f"s{i}" for i in range(17)])),
    HttpCase("stop null in array", completion(stop=[None])),
    HttpCase("stop_token_ids negative", completion(stop_token_ids=[-1]), param="stop_token_ids"),
    HttpCase("stop_token_ids over the vocabulary", completion(stop_token_ids=[VOCAB]), param="stop_token_ids"),
    HttpCase("stop_token_ids strings", completion(stop_token_ids=["a"])),
    HttpCase("stop_token_ids not an array", completion(stop_token_ids=7)),
    HttpCase("stop_token_ids booleans", completion(stop_token_ids=[True])),
    # prompt
    HttpCase("prompt left out", completion(prompt=...)),
    HttpCase("prompt null", completion(prompt=None)),
    HttpCase("prompt empty string", completion(prompt="")),
    HttpCase("prompt empty array", completion(prompt=[])),
    HttpCase("prompt token id negative", completion(prompt=[-1])),
    HttpCase("prompt token id over the vocabulary", completion(prompt=[VOCAB]), param="prompt"),
    HttpCase("prompt token id float", completion(prompt=[1.5])),
    HttpCase("prompt token id boolean", completion(prompt=[True])),
    HttpCase("prompt batch of a string and a number", completion(prompt=["hi", 3])),
    HttpCase("prompt batch whose second prompt is out of the vocabulary", completion(prompt=[[1, 2], [VOCAB]])),
    HttpCase("prompt batch with a lone surrogate in its second", raw('"max_tokens": 1', prompt=r'"prompt": ["hi", "a\ud800b"]')),
    HttpCase("prompt batch of one empty list", completion(prompt=[[]])),
    HttpCase("prompt object", completion(prompt={"a": 1})),
    HttpCase("prompt boolean", completion(prompt=True)),
    HttpCase("prompt 9000 token ids (over the context)", completion(prompt=[1] * 9000), param="prompt"),
    HttpCase("max_tokens 8000 after a 500-token prompt", completion(prompt=[1] * 500, max_tokens=8000), param="max_tokens"),
    # messages
    HttpCase("messages left out", chat(messages=...), path=CHAT),
    HttpCase("messages empty", chat(messages=[]), path=CHAT),
    HttpCase("messages object", chat(messages={}), path=CHAT),
    HttpCase("messages string", chat(messages="hi"), path=CHAT),
    HttpCase("message a number", chat(messages=[1]), path=CHAT),
    HttpCase("message role robot", chat(messages=[{"role": "robot", "content": "x"}]), path=CHAT),
    HttpCase("message role left out", chat(messages=[{"content": "x"}]), path=CHAT),
    HttpCase("message content left out", chat(messages=[{"role": "user"}]), path=CHAT),
    HttpCase("message content number", chat(messages=[{"role": "user", "content": 5}]), path=CHAT),
    HttpCase(
        "message content image part",
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        path=CHAT,
    ),
    # fields supported only at their neutral value, and streaming flags
    HttpCase("n 129 (over 128 choices)", completion(n=129)),
    HttpCase("n 0", completion(n=0)),
    HttpCase("n 65 for 2 prompts", completion(prompt=["a", "b"], n=65)),
    HttpCase("prompt batch of 129", completion(prompt=["a"] * 129)),
    HttpCase("prompt batch with an empty token list", completion(prompt=[[1, 2], []])),
    HttpCase("logit_bias key not a token id", completion(logit_bias={"x": 1})),
    HttpCase("logit_bias 1000", completion(logit_bias={"1": 1000}), param="logit_bias"),
    HttpCase("logit_bias token out of vocabulary", completion(logit_bias={str(VOCAB): 1}), param="logit_bias"),
    HttpCase("min_p 2", completion(min_p=2), param="min_p"),
    HttpCase("min_tokens over max_tokens", completion(max_tokens=4, min_tokens=5), param="min_tokens"),
    HttpCase("an unknown field", completion(frobnicate=True)),
    HttpCase("chat tool without a function", chat(tools=[{"type": "function"}]), path=CHAT),
    HttpCase("chat tool name with a space", chat(tools=[{"type": "function", "function": {"name": "a b"}}]), path=CHAT),
    HttpCase(
        "chat tool_calls arguments not JSON",
        chat(
            messages=[
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}],
                }
            ]
        ),
        path=CHAT,
    ),
    HttpCase("chat_template_kwargs sets messages", chat(chat_template_kwargs={"messages": []}), path=CHAT),
    HttpCase(
        "chat tool message without tool_call_id",
        chat(messages=[*USER, {"role": "tool", "content": "sunny"}]),
        path=CHAT,
        param="messages[1].tool_call_id",
    ),
    HttpCase(
        "chat tool_calls arguments nested 100000 deep",
        chat(
            messages=[
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": nested(100_000)}}],
                }
            ]
        ),
        path=CHAT,
        param="messages[0].tool_calls[0].function.arguments",
    ),
    # values checked against the model and the grammar engine: each names its field
    HttpCase("chat top_logprobs 21", chat(logprobs=True, top_logprobs=21), path=CHAT, param="top_logprobs"),
    HttpCase("chat top_logprobs -1", chat(logprobs=True, top_logprobs=-1), path=CHAT, param="top_logprobs"),
    HttpCase("chat min_tokens over max_tokens", chat(max_tokens=2, min_tokens=3), path=CHAT, param="min_tokens"),
    HttpCase("chat seed -1", chat(seed=-1), path=CHAT, param="seed"),
    HttpCase("chat prompt over the context", chat(messages=[{"role": "user", "content": "hi " * 9000}]), path=CHAT, param="messages"),
    HttpCase("structured_outputs regex invalid", completion(structured_outputs={"regex": "(a"}), param="structured_outputs"),
    HttpCase("structured_outputs grammar invalid", completion(structured_outputs={"grammar": "start: @"}), param="structured_outputs"),
    HttpCase(
        "chat response_format schema invalid",
        chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "no-such-type"}}}),
        path=CHAT,
        param="response_format",
    ),
    HttpCase(
        "chat forced tool_choice over an invalid parameters schema",
        chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "no-such-type"}}}], tool_choice="required"),
        path=CHAT,
        param="tools",
    ),
    HttpCase("logprobs true", completion(logprobs=True)),
    HttpCase("chat top_logprobs 3", chat(top_logprobs=3), path=CHAT),
    HttpCase("best_of 2", completion(best_of=2)),
    HttpCase("logprobs 21", completion(logprobs=21), param="logprobs"),
    HttpCase("prompt_logprobs -1", completion(prompt_logprobs=-1), param="prompt_logprobs"),
    HttpCase("echo string", completion(echo="yes")),
    HttpCase("presence_penalty 3", completion(presence_penalty=3), param="presence_penalty"),
    HttpCase("chat frequency_penalty -2.5", chat(frequency_penalty=-2.5), path=CHAT, param="frequency_penalty"),
    HttpCase("repetition_penalty 0", completion(repetition_penalty=0), param="repetition_penalty"),
    HttpCase("repetition_penalty string", completion(repetition_penalty="1.2")),
    HttpCase("stream string", completion(stream="yes")),
    HttpCase("ignore_eos string", completion(ignore_eos="yes")),
    HttpCase("chat stream_options without stream", chat(stream_options={"include_usage": True}), path=CHAT),
    HttpCase("stream_options not an object", completion(stream=True, stream_options="usage")),
    # structured outputs' grammars: limits, and what llguidance cannot follow (docs/hardening.md "Grammars")
    HttpCase(
        "json_schema $ref chain 1000 deep",
        completion(response_format={"type": "json_schema", "json_schema": {"name": "chain", "schema": ref_chain(1000)}}),
        param="response_format",
    ),
    HttpCase("lark grammar of 3000 chained rules", completion(structured_outputs={"grammar": RULE_CHAIN}), param="structured_outputs"),
    HttpCase(
        "lark grammar overflowing its check's stack", completion(structured_outputs={"grammar": STACK_BUSTER}), param="structured_outputs"
    ),
    HttpCase("regex of 1.5 MB", completion(structured_outputs={"regex": "a" * 1_500_000}), param="structured_outputs"),
    HttpCase(
        "choice of 2000 strings", completion(structured_outputs={"choice": [f"o{i}" for i in range(2000)]}), param="structured_outputs"
    ),
    HttpCase(
        "lark alternation of 3000 strings", completion(structured_outputs={"grammar": alternatives(3000)}), param="structured_outputs"
    ),
    HttpCase("chat tool_choice required of 3000 tools", chat(tools=TOOLS_3000, tool_choice="required"), path=CHAT, param="tools"),
    HttpCase("json_schema only a $ref to itself", completion(structured_outputs={"json": SELF_REF}), param="structured_outputs"),
    HttpCase(
        "json_schema requiring its own recursion", completion(structured_outputs={"json": REQUIRED_RECURSION}), param="structured_outputs"
    ),
    HttpCase(
        "choice of one with min_tokens past it",
        completion(structured_outputs={"choice": ["yes"]}, max_tokens=8, min_tokens=5),
        param="min_tokens",
    ),
    # model
    HttpCase("chat model gpt-4", chat(model="gpt-4"), (404,), path=CHAT, code="model_not_found"),
    HttpCase("streaming model gpt-4", completion(model="gpt-4", stream=True), (404,), code="model_not_found"),
    HttpCase("model not a string", completion(model=5), (400, 404)),
    # API key
    HttpCase("API key missing", completion(), (401,), authorization=None, code="invalid_api_key"),
    HttpCase("API key wrong", completion(), (401,), authorization="Bearer wrong-key", code="invalid_api_key"),
    HttpCase("API key Bearer only", completion(), (401,), authorization="Bearer", code="invalid_api_key"),
    HttpCase("API key of 10 KB", completion(), (401,), authorization="Bearer " + "k" * 10240, code="invalid_api_key"),
    HttpCase("API key non-ASCII bytes", completion(), (401,), authorization=b"Bearer \xff\xfe" + API_KEY.encode(), code="invalid_api_key"),
    HttpCase("API key as Basic auth", completion(), (401,), authorization="Basic " + API_KEY, code="invalid_api_key"),
    HttpCase("chat API key wrong with a bad body", b"not json", (401,), path=CHAT, authorization="Bearer x", code="invalid_api_key"),
    # routes and methods
    HttpCase("GET /v1/completions", b"", (405,), method="GET"),
    HttpCase("PUT /v1/chat/completions", chat(), (405,), path=CHAT, method="PUT"),
    HttpCase("DELETE /v1/completions", b"", (405,), method="DELETE"),
    HttpCase("POST /v1/models", b"{}", (405,), path="/v1/models"),
    HttpCase("POST /v1/nothing", completion(), (404,), path="/v1/nothing"),
    HttpCase("GET /v1/nothing", b"", (404,), path="/v1/nothing", method="GET"),
    # over the body limit
    HttpCase("body of 3 MiB", OVERSIZED, (413,)),
    HttpCase("chat body of 3 MiB", OVERSIZED_CHAT, (413,), path=CHAT),
    chunked_case("chunked body of 3 MiB", COMPLETIONS, OVERSIZED),
    chunked_case("chat chunked body of 3 MiB", CHAT, OVERSIZED_CHAT),
]


def send_http_case(cluster: ServingCluster, case: HttpCase) -> HttpReply:
    return send_http(cluster, case.method, case.path, case.payload(), case.authorization, case.chunked)


# ---------------------------------------------------------------- the gRPC cases


@dataclass(frozen=True)
class GrpcCase:
    id: str
    request: Message | bytes  # bytes: sent as they are
    code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT
    method: str = "Generate"
    metadata: tuple = AUTH


def generate(text: str | None = "hi", request_id: str = "", model: str = "", **sampling) -> pb.GenerateRequest:
    """A valid one-token Generate request with `sampling` fields replaced."""
    prompt = {} if text is None else {"text": text}
    return pb.GenerateRequest(request_id=request_id, model=model, sampling=pb.SamplingParams(**({"max_tokens": 1} | sampling)), **prompt)


def prompted(**prompt) -> pb.GenerateRequest:
    return pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=1), **prompt)


def length_delimited(field_number: int, payload: bytes) -> bytes:
    """One protobuf field of wire type 2, by hand (to carry bytes the library would not encode)."""
    assert len(payload) < 128
    return bytes([field_number << 3 | 2, len(payload)]) + payload


BAD_UTF8 = b"\xff\xfe"
BAD_CHAT = length_delimited(4, length_delimited(1, length_delimited(1, b"user") + length_delimited(2, BAD_UTF8)))
UNAUTHENTICATED, NOT_FOUND = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.NOT_FOUND
NO_KEY, WRONG_KEY = (), (("authorization", "Bearer wrong-key"),)

GRPC_CASES = [
    # payloads that do not decode
    GrpcCase("Generate undecodable payload", b"\xff\xff\xff"),
    GrpcCase("Generate truncated field", b"\x12\x10hi"),
    GrpcCase("Generate text invalid UTF-8", length_delimited(2, BAD_UTF8)),
    GrpcCase("Generate model invalid UTF-8", length_delimited(2, b"hi") + length_delimited(6, BAD_UTF8)),
    GrpcCase("Generate request_id invalid UTF-8", length_delimited(1, BAD_UTF8) + length_delimited(2, b"hi")),
    GrpcCase("Generate chat content invalid UTF-8", BAD_CHAT),
    GrpcCase("Abort undecodable payload", b"\xff\xff\xff", method="Abort"),
    GrpcCase("Abort request_id invalid UTF-8", length_delimited(1, BAD_UTF8), method="Abort"),
    GrpcCase("GetModelInfo undecodable payload", b"\xff\xff\xff", method="GetModelInfo"),
    # keys and models
    GrpcCase("Generate key missing", generate(), UNAUTHENTICATED, metadata=NO_KEY),
    GrpcCase("Generate key wrong", generate(), UNAUTHENTICATED, metadata=WRONG_KEY),
    GrpcCase("Generate key Bearer only", generate(), UNAUTHENTICATED, metadata=(("authorization", "Bearer"),)),
    GrpcCase("Abort key missing", pb.AbortRequest(request_id="x"), UNAUTHENTICATED, method="Abort", metadata=NO_KEY),
    GrpcCase("Abort key wrong", pb.AbortRequest(request_id="x"), UNAUTHENTICATED, method="Abort", metadata=WRONG_KEY),
    GrpcCase("GetModelInfo key missing", pb.GetModelInfoRequest(), UNAUTHENTICATED, method="GetModelInfo", metadata=NO_KEY),
    GrpcCase("GetModelInfo key wrong", pb.GetModelInfoRequest(), UNAUTHENTICATED, method="GetModelInfo", metadata=WRONG_KEY),
    GrpcCase("model gpt-4", generate(model="gpt-4"), NOT_FOUND),
    # prompts
    GrpcCase("no prompt", generate(text=None)),
    GrpcCase("text empty", generate(text="")),
    GrpcCase("token_ids empty", prompted(token_ids=pb.TokenIds())),
    GrpcCase("token_ids over the vocabulary", prompted(token_ids=pb.TokenIds(ids=[VOCAB]))),
    GrpcCase("token_ids 9000 (over the context)", prompted(token_ids=pb.TokenIds(ids=[1] * 9000))),
    GrpcCase("chat without messages", prompted(chat=pb.ChatMessages())),
    GrpcCase("chat role robot", prompted(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="robot", content="x")]))),
    GrpcCase("chat role empty", prompted(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="", content="x")]))),
    # sampling
    GrpcCase("top_k 2**32-1", generate(top_k=2**32 - 1)),
    GrpcCase("top_k over the vocabulary", generate(top_k=VOCAB + 1)),
    GrpcCase("temperature NaN", generate(temperature=float("nan"))),
    GrpcCase("temperature inf", generate(temperature=float("inf"))),
    GrpcCase("temperature -inf", generate(temperature=float("-inf"))),
    GrpcCase("temperature -1", generate(temperature=-1.0)),
    GrpcCase("top_p 0", generate(top_p=0.0)),
    GrpcCase("repetition_penalty NaN", generate(repetition_penalty=float("nan"))),
    GrpcCase("presence_penalty -3", generate(presence_penalty=-3.0)),
    GrpcCase("top_p 1.5", generate(top_p=1.5)),
    GrpcCase("top_p NaN", generate(top_p=float("nan"))),
    GrpcCase("max_tokens 0", generate(max_tokens=0)),
    GrpcCase("max_tokens 9000 (over the context)", generate(max_tokens=9000)),
    GrpcCase("max_tokens 2**32-1", generate(max_tokens=2**32 - 1)),
    GrpcCase("seed 2**63", generate(seed=2**63)),
    GrpcCase("seed 2**64-1", generate(seed=2**64 - 1)),
    GrpcCase("stop 17 strings", generate(stop=[f"s{i}" for i in range(17)])),
    GrpcCase("stop empty string", generate(stop=[""])),
    GrpcCase("stop_token_ids over the vocabulary", generate(stop_token_ids=[VOCAB])),
    # structured outputs' grammars
    GrpcCase(
        "structured json_schema $ref chain 1000 deep",
        generate(structured=pb.StructuredOutput(kind="json_schema", value=json.dumps(ref_chain(1000)))),
    ),
    GrpcCase(
        "structured choice of 2000 strings",
        generate(structured=pb.StructuredOutput(kind="choice", value=json.dumps([f"o{i}" for i in range(2000)]))),
    ),
    GrpcCase(
        "structured lark alternation of 3000 strings", generate(structured=pb.StructuredOutput(kind="lark", value=alternatives(3000)))
    ),
    GrpcCase(
        "structured choice of one with min_tokens past it",
        generate(max_tokens=8, min_tokens=5, structured=pb.StructuredOutput(kind="choice", value='["yes"]')),
    ),
    # request ids
    GrpcCase("request_id of 129 characters", generate(request_id="r" * 129)),
    GrpcCase("request_id of 1 MB", generate(request_id="r" * 1_000_000)),
    GrpcCase("request_id with a space", generate(request_id="my request")),
    GrpcCase("request_id with a newline", generate(request_id="req\n1")),
    GrpcCase("request_id with a NUL", generate(request_id="req\x001")),
    GrpcCase("request_id non-ASCII", generate(request_id="r\u00e9q")),
    GrpcCase("request_id ../x", generate(request_id="../x")),
]

assert len({c.id for c in HTTP_CASES}) == len(HTTP_CASES) and len({c.id for c in GRPC_CASES}) == len(GRPC_CASES)


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def cluster():
    cluster = ServingCluster("--workers", "1", "--host-kv-tokens", "16384", api_key=API_KEY)
    yield cluster
    assert cluster.stop() == 0


@pytest.fixture(scope="module")
def channel(cluster):
    with new_channel(cluster.grpc_address) as channel:
        yield channel


# ---------------------------------------------------------------- one case at a time


@pytest.mark.parametrize("case", HTTP_CASES, ids=[c.id for c in HTTP_CASES])
def test_http_hostile_request_gets_an_error(cluster, case):
    reply = send_http_case(cluster, case)
    problems = http_problems(reply, case.status, case.code, case.param)
    assert not problems, (problems, str(reply.body)[:300])


@pytest.mark.parametrize("case", GRPC_CASES, ids=[c.id for c in GRPC_CASES])
def test_grpc_hostile_request_gets_its_status(channel, case):
    reply = grpc_call(channel, case.method, case.request, case.metadata)
    assert not grpc_problems(reply, case.code), grpc_problems(reply, case.code)


# ---------------------------------------------------------------- all at once, beside normal requests

NEIGHBOUR_HTTP = {"prompt": "The history of the printing press", "max_tokens": 64, "temperature": 0, "ignore_eos": True, "stream": True}
NEIGHBOUR_GRPC = pb.GenerateRequest(
    text="A short poem about the sea:", sampling=pb.SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
)


def run_neighbours(cluster: ServingCluster, channel: grpc.Channel, pool: concurrent.futures.Executor):
    return pool.submit(http_json, cluster, COMPLETIONS, NEIGHBOUR_HTTP), pool.submit(grpc_call, channel, "Generate", NEIGHBOUR_GRPC)


@dataclass
class Barrage:
    alone: tuple[HttpReply, GrpcReply]
    beside: tuple[HttpReply, GrpcReply]
    http: dict[str, HttpReply]
    grpc: dict[str, GrpcReply]
    neighbours_running_at_start: bool


@pytest.fixture(scope="module")
def barrage(cluster, channel) -> Barrage:
    """The normal requests alone, then again while every hostile case is sent from 8 threads."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        alone = tuple(f.result() for f in run_neighbours(cluster, channel, pool))
    with concurrent.futures.ThreadPoolExecutor(2) as neighbours, concurrent.futures.ThreadPoolExecutor(8) as pool:
        beside = run_neighbours(cluster, channel, neighbours)
        running = cluster.wait_for(lambda: (cluster.metric("num_requests_running") or 0) >= 2, 60, "the two normal requests to start")
        http_futures = {c.id: pool.submit(send_http_case, cluster, c) for c in HTTP_CASES}
        grpc_futures = {c.id: pool.submit(grpc_call, channel, c.method, c.request, c.metadata) for c in GRPC_CASES}
        http_replies = {k: f.result() for k, f in http_futures.items()}
        grpc_replies = {k: f.result() for k, f in grpc_futures.items()}
        beside = tuple(f.result() for f in beside)
    return Barrage(alone, beside, http_replies, grpc_replies, running)


def test_barrage_every_case_gets_its_error_concurrently(barrage):
    problems = [f"HTTP {c.id}: {p}" for c in HTTP_CASES for p in http_problems(barrage.http[c.id], c.status, c.code, c.param)]
    problems += [f"gRPC {c.id}: {p}" for c in GRPC_CASES for p in grpc_problems(barrage.grpc[c.id], c.code)]
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems)


def test_barrage_leaves_normal_requests_unchanged(barrage):
    assert barrage.neighbours_running_at_start
    http_alone, grpc_alone = barrage.alone
    http_beside, grpc_beside = barrage.beside
    text, reasons = sse_text(http_alone)
    assert reasons == ["length"] and text
    assert sse_text(http_beside) == (text, reasons)
    text, ids, final = stream_result(grpc_alone)
    assert final.finish_reason == pb.FINISH_REASON_LENGTH and len(ids) == 64
    text_beside, ids_beside, final_beside = stream_result(grpc_beside)
    assert (text_beside, ids_beside, final_beside.finish_reason) == (text, ids, final.finish_reason)


def test_cluster_is_healthy_and_idle_after_the_barrage(cluster, barrage):
    reply = send_http(cluster, "GET", "/health")
    assert reply.status == 200 and reply.body["status"] == "ok", reply
    cluster.wait_for(lambda: cluster.metric("num_requests_running") == 0, 30, "num_requests_running to return to 0")
    reply = http_json(cluster, COMPLETIONS, completion(prompt="Hello", max_tokens=4, temperature=0))
    assert reply.status == 200 and reply.body["usage"]["completion_tokens"] >= 1, reply


# ---------------------------------------------------------------- request ownership on gRPC


def start_and_wait_for_first_chunk(channel: grpc.Channel, request: pb.GenerateRequest):
    """A Generate stream that has produced its first token; returns (call, responses so far)."""
    call = grpc_start(channel, "Generate", request)
    first = next(call)
    assert first.WhichOneof("event") == "chunk", first
    return call, [first]


def long_request(request_id: str, max_tokens: int) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return pb.GenerateRequest(request_id=request_id, text="Tell me a long story about a lighthouse.", sampling=sampling)


def test_another_client_cannot_abort_a_request(cluster):
    with new_channel(cluster.grpc_address) as a, new_channel(cluster.grpc_address) as b:
        call, responses = start_and_wait_for_first_chunk(a, long_request("victim-1", 24))
        abort = grpc_call(b, "Abort", pb.AbortRequest(request_id="victim-1"))
        responses += list(call)
    assert abort.code == grpc.StatusCode.OK and abort.responses[0].found is False, abort
    _, ids, final = stream_result(GrpcReply(grpc.StatusCode.OK, "", responses))
    assert final.finish_reason == pb.FINISH_REASON_LENGTH and len(ids) == 24 and final.usage.completion_tokens == 24


def test_a_client_can_abort_its_own_request(cluster):
    with new_channel(cluster.grpc_address) as a:
        call, responses = start_and_wait_for_first_chunk(a, long_request("victim-2", 400))
        abort = grpc_call(a, "Abort", pb.AbortRequest(request_id="victim-2"))
        found = abort.code == grpc.StatusCode.OK and abort.responses[0].found is True
        if not found:
            call.cancel()  # not 400 tokens for nothing
        assert found, abort
        responses += list(call)
    _, ids, final = stream_result(GrpcReply(grpc.StatusCode.OK, "", responses))
    assert final.finish_reason == pb.FINISH_REASON_ABORT and len(ids) < 400


def test_two_clients_may_use_the_same_request_id(cluster):
    with new_channel(cluster.grpc_address) as a, new_channel(cluster.grpc_address) as b:
        both = [long_request("shared-1", 6), long_request("shared-1", 6)]
        barrier = threading.Barrier(2)

        def run(channel, request):
            barrier.wait()
            return grpc_call(channel, "Generate", request)

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            replies = list(pool.map(run, (a, b), both))
    for reply in replies:
        _, ids, final = stream_result(reply)
        assert final.finish_reason == pb.FINISH_REASON_LENGTH and len(ids) == 6


# ---------------------------------------------------------------- sampling that could poison a batch

GREEDY_PROMPTS = ["The capital of Italy is", "def add(a, b):", "Water boils at"]


def greedy_stream(cluster: ServingCluster, prompt: str) -> HttpReply:
    return http_json(cluster, COMPLETIONS, {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True})


def test_tiny_temperatures_do_not_poison_the_batch(cluster, channel):
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        clean = [sse_text(r) for r in pool.map(lambda p: greedy_stream(cluster, p), GREEDY_PROMPTS)]
        greedy = [pool.submit(greedy_stream, cluster, p) for p in GREEDY_PROMPTS]
        poisoned_http = pool.submit(
            http_json, cluster, COMPLETIONS, completion(prompt="Once upon a time", max_tokens=24, temperature=1e-40)
        )
        poisoned_grpc = pool.submit(grpc_call, channel, "Generate", generate(text="Once upon a time", max_tokens=24, temperature=1e-45))
        beside = [sse_text(f.result()) for f in greedy]
        http_reply, grpc_reply = poisoned_http.result(), poisoned_grpc.result()
    assert all(reasons == ["length"] and text for text, reasons in clean)
    assert beside == clean
    assert http_reply.status == 200 and http_reply.body["choices"][0]["finish_reason"] in ("length", "stop"), http_reply
    _, _, final = stream_result(grpc_reply)
    assert final.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP), final


# ---------------------------------------------------------------- grammars: where they are compiled, what they end in


def where() -> tuple[int, str]:
    """The process and thread a call runs on (GrammarChecks.run pickles it by name into a helper)."""
    return os.getpid(), threading.current_thread().name


@pytest.fixture(scope="module")
def grammar_vocab() -> GrammarVocab:
    meta = load_model_meta()
    return GrammarVocab.of(meta.tokenizer, meta.config.vocab_size, [meta.tokenizer.eos_id])


def test_grammar_checks_run_in_a_helper_process_that_is_replaced_when_it_fails(grammar_vocab):
    async def run() -> None:
        checks = GrammarChecks(grammar_vocab, helpers=1, budget_s=2.0)
        try:
            helper, thread = await checks.run(where)
            assert helper != os.getpid() and thread.startswith("grammar-check")
            for fn, args, failure in [(os.abort, (), "crashed"), (time.sleep, (30,), "took over 2 s")]:
                with pytest.raises(HelperFailed, match=failure):
                    await checks.run(fn, *args)
                replaced, _ = await checks.run(where)
                assert replaced != helper
                helper = replaced
            with pytest.raises(ValueError, match="more memory"):
                await checks.run(bytearray, 4 << 30)  # over the helper's memory budget: refused, the helper lives on
            assert (await checks.run(where))[0] == helper
        finally:
            checks.close()

    asyncio.run(run())


def test_the_worker_compiles_a_grammar_once_on_its_grammar_thread_not_the_step_loop(monkeypatch):
    """Two admissions of one constraint (a request's two choices): one compile, off the step loop."""
    meta = load_model_meta()
    tokenizer = GrammarTokenizer(meta.tokenizer, meta.config.vocab_size, [meta.tokenizer.eos_id])
    compiled_on, build = [], grammar._built
    monkeypatch.setattr(grammar, "_built", lambda *args: compiled_on.append(threading.current_thread().name) or build(*args))
    table = RequestTable(meta.tokenizer.eos_id, windowed=False, grammars=lambda: tokenizer)
    spec = sampling_to_proto(SamplingSpec(0.0, 1.0, 0, 0, 0, structured=("choice", json.dumps(["yes", "no"]))))
    admitted = [worker_pb2.Admission(handle=h, seq_id=f"r{h}", length=3, sampling=spec) for h in (1, 2)]
    table.stage(worker_pb2.StepPlan(step_id=1, admitted=admitted))
    first, second = (table.running[h].sampling.grammar for h in (1, 2))
    assert first.error is None and second.error is None  # their first use waits for them
    yes = meta.tokenizer.backend.encode("yes", add_special_tokens=False).ids
    for token in yes:
        first.consume(token)
    assert first.done and not second.done  # copies: each follows its own tokens
    assert len(compiled_on) == 1 and compiled_on[0].startswith("grammar-matcher")
    assert compiled_on[0] != threading.current_thread().name


def grammar_helpers(cluster: ServingCluster, gateway: int) -> set[int]:
    """The gateway's grammar helpers, once both run (multiprocessing's spawned children)."""
    helpers = {pid for pid, cmdline in children_of(gateway).items() if any(b"spawn_main" in arg for arg in cmdline)}
    return helpers if len(helpers) == 2 else set()


def test_a_grammar_that_overflows_its_check_kills_a_helper_never_the_gateway(cluster):
    gateway = cluster.children()["gateway"]
    before = cluster.wait_for(lambda: grammar_helpers(cluster, gateway), 60, "two grammar helpers")
    reply = http_json(cluster, COMPLETIONS, completion(structured_outputs={"grammar": STACK_BUSTER}))
    assert not http_problems(reply, (400,), None, "structured_outputs") and "crashed" in reply.body["error"]["message"], reply
    assert cluster.children()["gateway"] == gateway
    after = cluster.wait_for(lambda: grammar_helpers(cluster, gateway), 60, "two grammar helpers again")
    assert len(before - after) == 1  # the helper that compiled it died, and another took its place
    reply = http_json(cluster, COMPLETIONS, completion(structured_outputs={"choice": ["yes", "no"]}, max_tokens=2))
    assert reply.status == 200 and reply.body["choices"][0]["text"] in ("yes", "no"), reply


def test_a_grammar_is_checked_once_a_request_whatever_its_prompts_and_n(cluster, channel):
    def checked() -> float:
        return cluster.metric("grammar_checks_total", result="ok") or 0

    before = checked()
    body = completion(prompt=["Yes or no?", "Is it?"], n=3, max_tokens=2, structured_outputs={"choice": ["yes", "no"]})
    reply = http_json(cluster, COMPLETIONS, body)
    assert reply.status == 200 and [c["text"] in ("yes", "no") for c in reply.body["choices"]] == [True] * 6, reply
    assert checked() == before + 1
    structured = pb.StructuredOutput(kind="choice", value=json.dumps(["yes", "no"]))
    text, _, _ = stream_result(grpc_call(channel, "Generate", generate(max_tokens=2, structured=structured)))
    assert text in ("yes", "no") and checked() == before + 2


def test_a_grammar_the_worker_cannot_follow_ends_in_an_error_never_stop(cluster, channel):
    """Its first token is free (the gateway's check passes); its second, llguidance fails on."""
    body = completion(max_tokens=8, temperature=0, structured_outputs={"grammar": LATE_FAILURE})
    reply = http_json(cluster, COMPLETIONS, body)
    assert reply.status == 503 and "cannot be followed" in reply.body["error"]["message"], reply
    events = sse_events(http_json(cluster, COMPLETIONS, body | {"stream": True}))
    assert "cannot be followed" in events[-1]["error"]["message"], events[-3:]
    assert all(c["finish_reason"] != "stop" for e in events if "choices" in e for c in e["choices"])
    structured = pb.StructuredOutput(kind="lark", value=LATE_FAILURE)
    final = grpc_call(channel, "Generate", generate(max_tokens=8, temperature=0.0, structured=structured)).responses[-1].final
    assert final.finish_reason == pb.FINISH_REASON_ERROR and "cannot be followed" in final.error, final


def test_min_tokens_past_the_grammar_fails_naming_the_grammar_not_the_model(cluster):
    """Two choices: the gateway cannot tell which ends sooner; the worker fails it once the grammar has ended."""
    reply = http_json(cluster, COMPLETIONS, completion(max_tokens=8, min_tokens=5, structured_outputs={"choice": ["yes", "no"]}))
    message = reply.body["error"]["message"] if isinstance(reply.body, dict) and "error" in reply.body else ""
    assert reply.status == 503 and "grammar" in message and "min_tokens" in message and "logits" not in message, reply


# as pydantic writes a model with an enum field: a local $ref into the schema's own $defs
UNIT_ARGUMENTS = {
    "$defs": {"Unit": {"enum": ["celsius", "fahrenheit"], "title": "Unit", "type": "string"}},
    "properties": {"unit": {"$ref": "#/$defs/Unit"}},
    "required": ["unit"],
    "title": "Arguments",
    "type": "object",
    "additionalProperties": False,
}


def test_tool_choice_required_resolves_each_functions_local_defs(cluster):
    tools = [{"type": "function", "function": {"name": name, "parameters": UNIT_ARGUMENTS}} for name in ("get_weather", "get_time")]
    body = chat(tools=tools, tool_choice="required", parallel_tool_calls=False, max_tokens=40, temperature=0)
    reply = http_json(cluster, CHAT, body)
    assert reply.status == 200, reply
    (call,) = reply.body["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] in ("get_weather", "get_time")
    assert json.loads(call["function"]["arguments"]) in ({"unit": "celsius"}, {"unit": "fahrenheit"})


# ---------------------------------------------------------------- bursts past gRPC core's queue

BURST = 1300  # over gRPC core's default 1,000 queued calls, which it answered by cancelling calls at random


def test_a_burst_of_calls_gets_answers_or_resource_exhausted_never_cancelled(cluster):
    async def burst() -> collections.Counter:
        async with grpc.aio.insecure_channel(cluster.grpc_address) as channel:
            call = generate_pb2_grpc.GenerationStub(channel).Generate

            async def one() -> str:
                try:
                    async for _ in call(generate("hi"), metadata=AUTH):
                        pass
                    return "OK"
                except grpc.aio.AioRpcError as e:
                    return e.code().name

            return collections.Counter(await asyncio.gather(*(one() for _ in range(BURST))))

    codes = asyncio.run(burst())
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"} and codes["OK"] > 0, codes
    cluster.wait_for(lambda: cluster.metric("num_requests_running") == 0 and cluster.metric("num_requests_waiting") == 0, 60, "idle")


# ---------------------------------------------------------------- n choices: streamed as they run, scored once

STORY = completion(prompt="Tell me a long story about a lighthouse.", max_tokens=2000, ignore_eos=True, temperature=1, stream=True)


@pytest.fixture(scope="module")
def narrow_cluster():
    """A worker that runs two requests at once: the choices of a request past two wait in its queue."""
    cluster = ServingCluster("--workers", "1", "--max-batch-size", "2", "--host-kv-tokens", "16384", api_key=API_KEY)
    yield cluster
    assert cluster.stop() == 0


def open_request(cluster: ServingCluster, path: str, body: dict) -> socket.socket:
    """A request sent on a socket left open: the caller reads what it wants, then hangs up by closing it."""
    payload = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nAuthorization: {BEARER}\r\n"
    sock = socket.create_connection(("127.0.0.1", cluster.http_port), timeout=120)
    sock.sendall(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def read_until(sock: socket.socket, marker: bytes) -> None:
    data = b""
    while marker not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed before {marker!r}: {data[-300:]!r}"
        data += chunk


def requests_queued(cluster: ServingCluster) -> tuple[float | None, float | None]:
    return cluster.metric("num_requests_running"), cluster.metric("num_requests_waiting")


def wait_until_idle(cluster: ServingCluster) -> None:
    cluster.wait_for(lambda: requests_queued(cluster) == (0, 0), 30, "no request running or waiting")


def test_running_choices_stream_while_others_wait_and_a_hang_up_aborts_them_all(narrow_cluster):
    with open_request(narrow_cluster, COMPLETIONS, STORY | {"n": 4}) as client:
        read_until(client, b"data: ")
        _, waiting = requests_queued(narrow_cluster)
        assert waiting >= 1, "the first chunk came only once every choice ran"
    wait_until_idle(narrow_cluster)  # the queued choices too: none of 2,000 tokens runs for nobody


def test_a_hang_up_before_the_response_aborts_the_choice_it_waited_for(narrow_cluster):
    with open_request(narrow_cluster, COMPLETIONS, STORY | {"n": 2}) as busy:
        read_until(busy, b"data: ")
        narrow_cluster.wait_for(lambda: requests_queued(narrow_cluster) == (2, 0), 30, "both choices running")
        # its first choice queues behind them: the response waits for its first token (its copy reuses the prompt)
        with open_request(narrow_cluster, COMPLETIONS, completion(n=2, max_tokens=8)):
            narrow_cluster.wait_for(lambda: requests_queued(narrow_cluster) == (2, 1), 30, "the second request queued")
        narrow_cluster.wait_for(lambda: requests_queued(narrow_cluster) == (2, 0), 10, "the queued choice aborted")
    wait_until_idle(narrow_cluster)


def sse_events(reply: HttpReply) -> list[dict]:
    assert reply.status == 200 and isinstance(reply.body, str), reply
    lines = [line[len("data: ") :] for line in reply.body.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines[-3:]
    return [json.loads(line) for line in lines[:-1]]


def scored_tokens(cluster: ServingCluster) -> float:
    return cluster.metric("prompt_tokens_scored_total") or 0


def test_echoed_logprobs_of_queued_choices_stream_and_are_scored_once(narrow_cluster):
    before = scored_tokens(narrow_cluster)
    body = completion(
        prompt="The lighthouse keeper climbed the stairs", n=3, max_tokens=4, ignore_eos=True, logprobs=1, echo=True, stream=True
    )
    events = sse_events(http_json(narrow_cluster, COMPLETIONS, body | {"stream_options": {"include_usage": True}}))
    echoed: dict[int, list] = collections.defaultdict(list)
    for event in events[:-1]:
        (choice,) = event["choices"]
        logprobs = choice["logprobs"]
        if logprobs and len(echoed[choice["index"]]) < 2:  # the prompt's first token, then the rest of its tokens
            echoed[choice["index"]].append(logprobs)
    assert sorted(echoed) == [0, 1, 2] and echoed[0] == echoed[1] == echoed[2]
    assert sum(1 for e in events[:-1] if e["choices"][0]["finish_reason"] == "length") == 3
    prompt_tokens = events[-1]["usage"]["prompt_tokens"]
    assert scored_tokens(narrow_cluster) - before == prompt_tokens - 1  # the first prompt token has no logprob


def test_prompt_logprobs_of_n_choices_are_scored_once_and_shared(cluster):
    before = scored_tokens(cluster)
    body = completion(prompt="The lighthouse keeper climbed the stairs", n=3, max_tokens=2, prompt_logprobs=2, temperature=1)
    reply = http_json(cluster, COMPLETIONS, body)
    assert reply.status == 200, reply
    scored = [choice["prompt_logprobs"] for choice in reply.body["choices"]]
    prompt_tokens = reply.body["usage"]["prompt_tokens"]
    assert len(scored[0]) == prompt_tokens and scored[0][0] is None and all(scored[0][1:])
    assert scored[0] == scored[1] == scored[2]
    assert scored_tokens(cluster) - before == prompt_tokens - 1
    chat_reply = http_json(cluster, CHAT, chat(n=3, max_tokens=2, prompt_logprobs=1))
    assert chat_reply.status == 200 and len(chat_reply.body["prompt_logprobs"]) == chat_reply.body["usage"]["prompt_tokens"], chat_reply
