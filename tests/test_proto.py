"""The schemas in proto/: generated code is current, messages round-trip."""

from __future__ import annotations

from pathlib import Path

from pulseinfer.proto.generate import PROTO, generate
from pulseinfer.proto.pulseinfer.v1 import generate_pb2, kv_store_pb2, worker_pb2

GENERATED = PROTO / "pulseinfer" / "v1"


def test_generated_code_is_current(tmp_path: Path):
    generate(tmp_path)
    fresh = sorted((tmp_path / "pulseinfer" / "v1").glob("*_pb2*"))
    assert [p.name for p in fresh] == sorted(p.name for p in GENERATED.glob("*_pb2*"))
    for path in fresh:
        assert path.read_bytes() == (GENERATED / path.name).read_bytes(), f"{path.name} is stale: run `make proto`"


def test_optional_sampling_fields_keep_presence():
    request = generate_pb2.GenerateRequest(text="hi", sampling=generate_pb2.SamplingParams(temperature=0.0))
    decoded = generate_pb2.GenerateRequest.FromString(request.SerializeToString())
    assert decoded.sampling.HasField("temperature") and decoded.sampling.temperature == 0.0
    assert not decoded.sampling.HasField("max_tokens")
    assert decoded.WhichOneof("prompt") == "text"


def test_step_messages_round_trip():
    admission = worker_pb2.Admission(handle=7, seq_id="a", length=2, sampling=worker_pb2.SamplingSpec(seed=1 << 63))
    plan = worker_pb2.StepPlan(
        step_id=3,
        admitted=[admission],
        grant_handles=[7],
        grant_blocks=[5],
        prefill_handles=[7],
        prefill_lengths=[2],
        prefill_tokens=[1, 2],
    )
    message = worker_pb2.SchedulerMessage(plan=plan)
    decoded = worker_pb2.SchedulerMessage.FromString(message.SerializeToString())
    assert decoded.plan == plan and decoded.plan.admitted[0].sampling.seed == 1 << 63
    reply = kv_store_pb2.KVStoreResponse(code=kv_store_pb2.KV_STORE_RESOURCE_EXHAUSTED, error="full")
    assert kv_store_pb2.KVStoreResponse.FromString(reply.SerializeToString()).code == kv_store_pb2.KV_STORE_RESOURCE_EXHAUSTED
