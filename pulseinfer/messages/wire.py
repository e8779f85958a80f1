"""Step plans, results and sampling parameters <-> their proto/ messages."""

from __future__ import annotations

from array import array
from dataclasses import asdict

from pulseinfer.messages.plan import (
    PENALTIES,
    RECALL_FIELDS,
    Admission,
    Logprobs,
    RecallStats,
    SampledToken,
    SamplingSpec,
    StepPlan,
    TokenHistory,
)
from pulseinfer.messages.sampling import SamplingParams
from pulseinfer.proto.pulseinfer.v1 import generate_pb2, worker_pb2


def plan_to_proto(plan: StepPlan) -> worker_pb2.StepPlan:
    """What changed since the last plan to the same worker (worker.proto StepPlan): the worker's
    RequestTable (gpu_worker/requests.py) rebuilds the plan's chunks from it."""
    message = worker_pb2.StepPlan(step_id=plan.step_id, released=plan.released_handles, admitted=[_admission(a) for a in plan.admitted])
    grant_handles, grant_blocks, prefill_handles, prefill_lengths, prefill_tokens, decode = [], [], [], [], [], []
    score_handles, score_next = [], []
    for chunk in plan.chunks:
        new_blocks = chunk.block_table[chunk.known_blocks :]
        if new_blocks:
            grant_handles += [chunk.handle] * len(new_blocks)
            grant_blocks += new_blocks
        if chunk.fed_back:
            decode.append(chunk.handle)
        else:
            prefill_handles.append(chunk.handle)
            prefill_lengths.append(len(chunk.token_ids))
            prefill_tokens += chunk.token_ids
            if chunk.prompt_top >= 0 and chunk.sampling is None:
                score_handles.append(chunk.handle)
                score_next.append(chunk.score_next)
    message.score_handles[:] = score_handles
    message.score_next[:] = score_next
    message.grant_handles[:] = grant_handles
    message.grant_blocks[:] = grant_blocks
    message.prefill_handles[:] = prefill_handles
    message.prefill_lengths[:] = prefill_lengths
    message.prefill_tokens[:] = prefill_tokens
    message.decode[:] = decode
    message.demote_blocks[:] = [block for block, _ in plan.demote]
    message.demote_names[:] = [name for _, name in plan.demote]
    for named in plan.names:
        message.name_handles.extend([named.handle] * len(named.names))
        message.name_blocks.extend(range(named.first, named.first + len(named.names)))
        message.names.extend(named.names)
    return message


def _admission(a: Admission) -> worker_pb2.Admission:
    return worker_pb2.Admission(
        handle=a.handle,
        seq_id=a.seq_id,
        start_pos=a.start_pos,
        length=a.length,
        sampling=sampling_to_proto(a.sampling),
        offloaded=a.offloaded,
        host_prefix=a.host_prefix,
        stop_token_ids=a.stop_token_ids,
        ignore_eos=a.ignore_eos,
        score_prompt=a.prompt_top >= 0,
        prompt_top=max(a.prompt_top, 0),
    )


def sampling_to_proto(s: SamplingSpec) -> worker_pb2.SamplingSpec:
    message = worker_pb2.SamplingSpec(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed, step=s.step, min_p=s.min_p, min_tokens=s.min_tokens,
        stop_ids=s.stop_ids, bias_ids=s.bias_ids, bias_values=s.bias_values, logprobs=s.logprobs, top_logprobs=s.top_logprobs,
    )  # fmt: skip
    if s.penalized:
        message.penalized = True
        for name in PENALTIES:
            setattr(message, name, getattr(s, name))
    if s.history is not None:
        message.history_prompt.extend(s.history.prompt)
        message.history_outputs.extend(s.history.outputs)
    if s.structured is not None:
        message.structured_kind, message.structured_value = s.structured
    return message


def sampling_from_proto(s: worker_pb2.SamplingSpec) -> SamplingSpec:
    """The spec; a penalized one with a history of its own, which its worker appends to."""
    spec = SamplingSpec(
        s.temperature, s.top_p, s.top_k, s.seed, s.step, s.min_p, s.min_tokens, tuple(s.stop_ids), tuple(s.bias_ids),
        tuple(s.bias_values), s.logprobs, s.top_logprobs,
    )  # fmt: skip
    if s.penalized:
        for name in PENALTIES:
            setattr(spec, name, getattr(s, name))
    if s.structured_kind:
        spec.structured = (s.structured_kind, s.structured_value)
    if s.penalized or s.structured_kind:
        spec.history = TokenHistory(tuple(s.history_prompt), array("q", s.history_outputs))
    return spec


def tokens_from_result(seq_ids: dict[int, str], result: worker_pb2.StepResult) -> list[SampledToken]:
    """The result's tokens, named by the requests of the step's handles (`seq_ids`), with their logprobs."""
    reported = dict(zip(result.logprob_handles, result.logprobs))
    return [
        SampledToken(seq_ids[h], t, logprobs_from_proto(reported[h]) if h in reported else None)
        for h, t in zip(result.handles, result.token_ids)
        if h in seq_ids
    ]


def prompt_logprobs_from_result(seq_ids: dict[int, str], result: worker_pb2.StepResult) -> dict[str, Logprobs]:
    """The prompt tokens the step's chunks scored, by request."""
    return {seq_ids[h]: logprobs_from_proto(m) for h, m in zip(result.prompt_handles, result.prompt_logprobs) if h in seq_ids}


def logprobs_to_proto(logprobs: Logprobs, message: generate_pb2.Logprobs) -> generate_pb2.Logprobs:
    """Appends them to `message` (whose top becomes theirs); returns it."""
    message.logprobs.extend(logprobs.logprobs)
    message.ranks.extend(logprobs.ranks)
    message.top = logprobs.top
    message.top_ids.extend(logprobs.top_ids)
    message.top_logprobs.extend(logprobs.top_logprobs)
    return message


def logprobs_from_proto(message: generate_pb2.Logprobs) -> Logprobs:
    return Logprobs(list(message.logprobs), list(message.ranks), message.top, list(message.top_ids), list(message.top_logprobs))


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
        min_p=p.min_p,
        min_tokens=p.min_tokens,
        logit_bias=dict(p.logit_bias),
        skip_special_tokens=p.skip_special_tokens,
        include_stop_str_in_output=p.include_stop_str_in_output,
        **{name: getattr(p, name) for name in PENALTIES},
    )
    if p.structured is not None:
        message.structured.kind, message.structured.value = p.structured
    for name in ("seed", "logprobs", "prompt_logprobs"):  # optional fields: None leaves them unset
        if (value := getattr(p, name)) is not None:
            setattr(message, name, value)
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
        min_p=get("min_p", d.min_p),
        min_tokens=get("min_tokens", d.min_tokens),
        logit_bias=tuple(sorted(message.logit_bias.items())),
        logprobs=get("logprobs", None),
        prompt_logprobs=get("prompt_logprobs", None),
        skip_special_tokens=get("skip_special_tokens", d.skip_special_tokens),
        include_stop_str_in_output=get("include_stop_str_in_output", d.include_stop_str_in_output),
        **{name: get(name, getattr(d, name)) for name in PENALTIES},
        structured=(message.structured.kind, message.structured.value) if message.HasField("structured") else None,
    )


def health_problems(stats: generate_pb2.SchedulerStats | None) -> list[str]:
    """Why a node cannot take requests (none: it can); the gateway's /health asks the same of each node."""
    if stats is None:
        return ["the scheduler is not answering"]
    problems = []
    if stats.workers_alive == 0:
        problems.append("no worker is alive")
    if not stats.kv_store_alive:
        problems.append("the kv_store is not answering")
    if stats.draining:
        problems.append("draining")
    corrupt = [stats.host_integrity_error] + [f"worker {w.worker_id}: {w.integrity_error}" for w in stats.workers if w.integrity_error]
    return problems + [p for p in corrupt if p]
