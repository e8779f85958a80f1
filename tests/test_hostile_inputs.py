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
import select
import socket
import threading
from dataclasses import dataclass, field
from http.client import HTTPException, HTTPResponse

import grpc
import pytest
from google.protobuf.message import Message
from serving_cluster import ServingCluster

from pulseinfer.proto.pulseinfer.v1 import generate_pb2 as pb
from pulseinfer.proto.pulseinfer.v1 import generate_pb2_grpc

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


def http_problems(reply: HttpReply, status: tuple[int, ...], code: str | None) -> list[str]:
    """What is wrong with an error reply; empty when it meets the contract."""
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
    HttpCase("chat max_tokens 0", chat(max_tokens=0), path=CHAT),
    HttpCase("max_tokens -1", completion(max_tokens=-1)),
    HttpCase("max_tokens 1.5", completion(max_tokens=1.5)),
    HttpCase("max_tokens string", completion(max_tokens="10")),
    HttpCase("max_tokens true", completion(max_tokens=True)),
    HttpCase("max_tokens 2**32", completion(max_tokens=2**32)),
    HttpCase("max_tokens 2**64", completion(max_tokens=2**64)),
    HttpCase("max_completion_tokens 0", chat(max_tokens=..., max_completion_tokens=0), path=CHAT),
    HttpCase("max_completion_tokens string", chat(max_tokens=..., max_completion_tokens="8"), path=CHAT),
    HttpCase("max_completion_tokens 2**64", chat(max_tokens=..., max_completion_tokens=2**64), path=CHAT),
    # temperature
    HttpCase("temperature -1", completion(temperature=-1)),
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
    HttpCase("top_p 0", completion(top_p=0)),
    HttpCase("chat top_p 1.5", chat(top_p=1.5), path=CHAT),
    HttpCase("top_p -0.1", completion(top_p=-0.1)),
    HttpCase("top_p NaN", raw('"max_tokens": 1, "top_p": NaN')),
    # top_k
    HttpCase("top_k -1", completion(top_k=-1)),
    HttpCase("top_k 2**32", completion(top_k=2**32)),
    HttpCase("top_k 2**40", completion(top_k=2**40)),
    HttpCase("top_k over the vocabulary", completion(top_k=VOCAB + 1)),
    HttpCase("top_k 1.5", completion(top_k=1.5)),
    # seed
    HttpCase("seed -1", completion(seed=-1)),
    HttpCase("seed 2**63", completion(seed=2**63)),
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
    HttpCase("stop_token_ids negative", completion(stop_token_ids=[-1])),
    HttpCase("stop_token_ids over the vocabulary", completion(stop_token_ids=[VOCAB])),
    HttpCase("stop_token_ids strings", completion(stop_token_ids=["a"])),
    HttpCase("stop_token_ids not an array", completion(stop_token_ids=7)),
    HttpCase("stop_token_ids booleans", completion(stop_token_ids=[True])),
    # prompt
    HttpCase("prompt left out", completion(prompt=...)),
    HttpCase("prompt null", completion(prompt=None)),
    HttpCase("prompt empty string", completion(prompt="")),
    HttpCase("prompt empty array", completion(prompt=[])),
    HttpCase("prompt token id negative", completion(prompt=[-1])),
    HttpCase("prompt token id over the vocabulary", completion(prompt=[VOCAB])),
    HttpCase("prompt token id float", completion(prompt=[1.5])),
    HttpCase("prompt token id boolean", completion(prompt=[True])),
    HttpCase("prompt batch of a string and a number", completion(prompt=["hi", 3])),
    HttpCase("prompt batch whose second prompt is out of the vocabulary", completion(prompt=[[1, 2], [VOCAB]])),
    HttpCase("prompt batch with a lone surrogate in its second", raw('"max_tokens": 1', prompt=r'"prompt": ["hi", "a\ud800b"]')),
    HttpCase("prompt batch of one empty list", completion(prompt=[[]])),
    HttpCase("prompt object", completion(prompt={"a": 1})),
    HttpCase("prompt boolean", completion(prompt=True)),
    HttpCase("prompt 9000 token ids (over the context)", completion(prompt=[1] * 9000)),
    HttpCase("max_tokens 8000 after a 500-token prompt", completion(prompt=[1] * 500, max_tokens=8000)),
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
    HttpCase("logit_bias 1000", completion(logit_bias={"1": 1000})),
    HttpCase("logit_bias token out of vocabulary", completion(logit_bias={str(VOCAB): 1})),
    HttpCase("min_p 2", completion(min_p=2)),
    HttpCase("min_tokens over max_tokens", completion(max_tokens=4, min_tokens=5)),
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
    HttpCase("logprobs true", completion(logprobs=True)),
    HttpCase("chat top_logprobs 3", chat(top_logprobs=3), path=CHAT),
    HttpCase("best_of 2", completion(best_of=2)),
    HttpCase("logprobs 21", completion(logprobs=21)),
    HttpCase("prompt_logprobs -1", completion(prompt_logprobs=-1)),
    HttpCase("echo string", completion(echo="yes")),
    HttpCase("presence_penalty 3", completion(presence_penalty=3)),
    HttpCase("chat frequency_penalty -2.5", chat(frequency_penalty=-2.5), path=CHAT),
    HttpCase("repetition_penalty 0", completion(repetition_penalty=0)),
    HttpCase("repetition_penalty string", completion(repetition_penalty="1.2")),
    HttpCase("stream string", completion(stream="yes")),
    HttpCase("ignore_eos string", completion(ignore_eos="yes")),
    HttpCase("chat stream_options without stream", chat(stream_options={"include_usage": True}), path=CHAT),
    HttpCase("stream_options not an object", completion(stream=True, stream_options="usage")),
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
    assert not http_problems(reply, case.status, case.code), (http_problems(reply, case.status, case.code), str(reply.body)[:300])


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
    problems = [f"HTTP {c.id}: {p}" for c in HTTP_CASES for p in http_problems(barrage.http[c.id], c.status, c.code)]
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
