"""Step plans, results and sampling parameters <-> their proto/ messages."""

from __future__ import annotations

from dataclasses import asdict

from pulseinfer.proto.pulseinfer.v1 import generate_pb2, worker_pb2
from pulseinfer.scheduler.plan import RECALL_FIELDS, Chunk, RecallStats, SampledToken, SamplingSpec, StepPlan
from pulseinfer.scheduler.request import SamplingParams


def plan_to_proto(plan: StepPlan) -> worker_pb2.StepPlan:
    return worker_pb2.StepPlan(step_id=plan.step_id, chunks=[_chunk_to_proto(c) for c in plan.chunks], released=plan.released)


def _chunk_to_proto(chunk: Chunk) -> worker_pb2.Chunk:
    message = worker_pb2.Chunk(
        seq_id=chunk.seq_id,
        token_ids=chunk.token_ids,
        start_pos=chunk.start_pos,
        block_table=chunk.block_table,
        offloaded=chunk.offloaded,
        host_prefix=chunk.host_prefix,
        block_names=chunk.block_names,
    )
    if chunk.sampling is not None:
        s = chunk.sampling
        message.sampling.CopyFrom(
            worker_pb2.SamplingSpec(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed, step=s.step)
        )
    return message


def plan_from_proto(message: worker_pb2.StepPlan) -> StepPlan:
    return StepPlan(message.step_id, tuple(_chunk_from_proto(c) for c in message.chunks), tuple(message.released))


def _chunk_from_proto(c: worker_pb2.Chunk) -> Chunk:
    sampling = None
    if c.HasField("sampling"):
        s = c.sampling
        sampling = SamplingSpec(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed, step=s.step)
    return Chunk(
        c.seq_id, tuple(c.token_ids), c.start_pos, tuple(c.block_table), sampling, c.offloaded, tuple(c.host_prefix), tuple(c.block_names)
    )


def tokens_to_proto(tokens: list[SampledToken]) -> list[worker_pb2.SampledToken]:
    return [worker_pb2.SampledToken(seq_id=t.seq_id, token_id=t.token_id) for t in tokens]


def tokens_from_proto(tokens) -> list[SampledToken]:
    return [SampledToken(t.seq_id, t.token_id) for t in tokens]


def recall_to_proto(recall: RecallStats) -> worker_pb2.RecallStats:
    return worker_pb2.RecallStats(**asdict(recall))


def recall_from_proto(message: worker_pb2.RecallStats) -> RecallStats:
    return RecallStats(**{name: getattr(message, name) for name in RECALL_FIELDS})


def params_to_proto(p: SamplingParams) -> generate_pb2.SamplingParams:
    message = generate_pb2.SamplingParams(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        stop=p.stop,
        stop_token_ids=p.stop_token_ids,
        ignore_eos=p.ignore_eos,
    )
    if p.seed is not None:
        message.seed = p.seed
    return message


def params_from_proto(message: generate_pb2.SamplingParams, default_max_tokens: int = SamplingParams.max_tokens) -> SamplingParams:
    """Fields the client left unset take SamplingParams' defaults (max_tokens: the caller's)."""

    def get(name: str, default):
        return getattr(message, name) if message.HasField(name) else default

    d = SamplingParams()
    return SamplingParams(
        max_tokens=get("max_tokens", default_max_tokens),
        temperature=get("temperature", d.temperature),
        top_p=get("top_p", d.top_p),
        top_k=get("top_k", d.top_k),
        seed=get("seed", None),
        stop=tuple(message.stop),
        stop_token_ids=tuple(message.stop_token_ids),
        ignore_eos=get("ignore_eos", d.ignore_eos),
    )
