from pulseinfer.proto.pulseinfer.v1 import kv_store_pb2 as _kv_store_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "min_p", "min_tokens", "logit_bias", "logprobs", "prompt_logprobs", "skip_special_tokens", "include_stop_str_in_output", "presence_penalty", "frequency_penalty", "repetition_penalty", "structured")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    min_p: float
    min_tokens: int
    logit_bias: _containers.ScalarMap[int, float]
    logprobs: int
    prompt_logprobs: int
    skip_special_tokens: bool
    include_stop_str_in_output: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    structured: StructuredOutput
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., skip_special_tokens: _Optional[bool] = ..., include_stop_str_in_output: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., structured: _Optional[_Union[StructuredOutput, _Mapping]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("kind", "value")
    KIND_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    value: str
    def __init__(self, kind: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class Logprobs(_message.Message):
    __slots__ = ("logprobs", "ranks", "top", "top_ids", "top_logprobs")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    top: int
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ..., ranks: _Optional[_Iterable[int]] = ..., top: _Optional[int] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "chat", "sampling", "model")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    chat: ChatMessages
    sampling: SamplingParams
    model: str
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., model: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_s", "ttft_s", "e2e_s")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    E2E_S_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    ttft_s: float
    e2e_s: float
    def __init__(self, queue_s: _Optional[float] = ..., ttft_s: _Optional[float] = ..., e2e_s: _Optional[float] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("text", "token_ids", "logprobs", "prompt_logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: Logprobs
    prompt_logprobs: Logprobs
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Union[Logprobs, _Mapping]] = ..., prompt_logprobs: _Optional[_Union[Logprobs, _Mapping]] = ...) -> None: ...

class GenerateFinal(_message.Message):
    __slots__ = ("finish_reason", "usage", "timings", "error")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    error: str
    def __init__(self, finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., error: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "chunk", "final")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunk: GenerateChunk
    final: GenerateFinal
    def __init__(self, request_id: _Optional[str] = ..., chunk: _Optional[_Union[GenerateChunk, _Mapping]] = ..., final: _Optional[_Union[GenerateFinal, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("id", "max_context", "vocab_size", "num_layers", "num_kv_heads", "head_dim")
    ID_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    id: str
    max_context: int
    vocab_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    def __init__(self, id: _Optional[str] = ..., max_context: _Optional[int] = ..., vocab_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ...) -> None: ...

class ScheduleRequest(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class ScheduleResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "finish_reason", "error", "timings", "accepted", "cached_tokens", "refused_code", "logprobs", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_CODE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    error: str
    timings: Timings
    accepted: bool
    cached_tokens: int
    refused_code: int
    logprobs: Logprobs
    prompt_logprobs: Logprobs
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., error: _Optional[str] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., accepted: _Optional[bool] = ..., cached_tokens: _Optional[int] = ..., refused_code: _Optional[int] = ..., logprobs: _Optional[_Union[Logprobs, _Mapping]] = ..., prompt_logprobs: _Optional[_Union[Logprobs, _Mapping]] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("submit", "abort")
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    submit: ScheduleRequest
    abort: str
    def __init__(self, submit: _Optional[_Union[ScheduleRequest, _Mapping]] = ..., abort: _Optional[str] = ...) -> None: ...

class SessionEvents(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[ScheduleResponse]
    def __init__(self, responses: _Optional[_Iterable[_Union[ScheduleResponse, _Mapping]]] = ...) -> None: ...

class SchedulerStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_id", "running", "waiting", "device_blocks_total", "device_blocks_free", "steps", "decode_tokens", "decode_steps", "max_decode_batch", "last_decode_batch", "step_overhead_s", "preemptions", "pid", "offloaded", "integrity_error", "offloaded_admissions", "recall_units", "recall_transfers", "recall_bytes", "recall_wait_s", "recall_prefetched_units", "recall_corrected_units", "recall_io_busy_s", "recall_truncated_units", "recall_suspended_rows", "recall_resumed_layers", "link_bytes_per_s", "recall_bytes_per_offloaded_step", "decode_compute_s", "held_for_link", "max_running", "prefix_cached_blocks", "prefix_evicted_blocks", "prefix_queried_tokens", "prefix_hit_tokens", "prefix_host_hit_tokens", "busy_s", "idle_s", "plan_bytes", "steady_steps", "steady_plan_bytes", "steady_plan_bytes_max", "inflight", "prefix_promoted_blocks", "prefix_demoted_blocks", "tier_copy_s", "tier_copy_s_max", "node_name", "isolated_failures")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_DECODE_BATCH_FIELD_NUMBER: _ClassVar[int]
    LAST_DECODE_BATCH_FIELD_NUMBER: _ClassVar[int]
    STEP_OVERHEAD_S_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    OFFLOADED_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_ERROR_FIELD_NUMBER: _ClassVar[int]
    OFFLOADED_ADMISSIONS_FIELD_NUMBER: _ClassVar[int]
    RECALL_UNITS_FIELD_NUMBER: _ClassVar[int]
    RECALL_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    RECALL_BYTES_FIELD_NUMBER: _ClassVar[int]
    RECALL_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    RECALL_PREFETCHED_UNITS_FIELD_NUMBER: _ClassVar[int]
    RECALL_CORRECTED_UNITS_FIELD_NUMBER: _ClassVar[int]
    RECALL_IO_BUSY_S_FIELD_NUMBER: _ClassVar[int]
    RECALL_TRUNCATED_UNITS_FIELD_NUMBER: _ClassVar[int]
    RECALL_SUSPENDED_ROWS_FIELD_NUMBER: _ClassVar[int]
    RECALL_RESUMED_LAYERS_FIELD_NUMBER: _ClassVar[int]
    LINK_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    RECALL_BYTES_PER_OFFLOADED_STEP_FIELD_NUMBER: _ClassVar[int]
    DECODE_COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    HELD_FOR_LINK_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HOST_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BUSY_S_FIELD_NUMBER: _ClassVar[int]
    IDLE_S_FIELD_NUMBER: _ClassVar[int]
    PLAN_BYTES_FIELD_NUMBER: _ClassVar[int]
    STEADY_STEPS_FIELD_NUMBER: _ClassVar[int]
    STEADY_PLAN_BYTES_FIELD_NUMBER: _ClassVar[int]
    STEADY_PLAN_BYTES_MAX_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_PROMOTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_DEMOTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIER_COPY_S_FIELD_NUMBER: _ClassVar[int]
    TIER_COPY_S_MAX_FIELD_NUMBER: _ClassVar[int]
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    ISOLATED_FAILURES_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    running: int
    waiting: int
    device_blocks_total: int
    device_blocks_free: int
    steps: int
    decode_tokens: int
    decode_steps: int
    max_decode_batch: int
    last_decode_batch: int
    step_overhead_s: float
    preemptions: int
    pid: int
    offloaded: int
    integrity_error: str
    offloaded_admissions: int
    recall_units: int
    recall_transfers: int
    recall_bytes: int
    recall_wait_s: float
    recall_prefetched_units: int
    recall_corrected_units: int
    recall_io_busy_s: float
    recall_truncated_units: int
    recall_suspended_rows: int
    recall_resumed_layers: int
    link_bytes_per_s: float
    recall_bytes_per_offloaded_step: float
    decode_compute_s: float
    held_for_link: int
    max_running: int
    prefix_cached_blocks: int
    prefix_evicted_blocks: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    prefix_host_hit_tokens: int
    busy_s: float
    idle_s: float
    plan_bytes: int
    steady_steps: int
    steady_plan_bytes: int
    steady_plan_bytes_max: int
    inflight: int
    prefix_promoted_blocks: int
    prefix_demoted_blocks: int
    tier_copy_s: float
    tier_copy_s_max: float
    node_name: str
    isolated_failures: int
    def __init__(self, worker_id: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., device_blocks_total: _Optional[int] = ..., device_blocks_free: _Optional[int] = ..., steps: _Optional[int] = ..., decode_tokens: _Optional[int] = ..., decode_steps: _Optional[int] = ..., max_decode_batch: _Optional[int] = ..., last_decode_batch: _Optional[int] = ..., step_overhead_s: _Optional[float] = ..., preemptions: _Optional[int] = ..., pid: _Optional[int] = ..., offloaded: _Optional[int] = ..., integrity_error: _Optional[str] = ..., offloaded_admissions: _Optional[int] = ..., recall_units: _Optional[int] = ..., recall_transfers: _Optional[int] = ..., recall_bytes: _Optional[int] = ..., recall_wait_s: _Optional[float] = ..., recall_prefetched_units: _Optional[int] = ..., recall_corrected_units: _Optional[int] = ..., recall_io_busy_s: _Optional[float] = ..., recall_truncated_units: _Optional[int] = ..., recall_suspended_rows: _Optional[int] = ..., recall_resumed_layers: _Optional[int] = ..., link_bytes_per_s: _Optional[float] = ..., recall_bytes_per_offloaded_step: _Optional[float] = ..., decode_compute_s: _Optional[float] = ..., held_for_link: _Optional[int] = ..., max_running: _Optional[int] = ..., prefix_cached_blocks: _Optional[int] = ..., prefix_evicted_blocks: _Optional[int] = ..., prefix_queried_tokens: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., prefix_host_hit_tokens: _Optional[int] = ..., busy_s: _Optional[float] = ..., idle_s: _Optional[float] = ..., plan_bytes: _Optional[int] = ..., steady_steps: _Optional[int] = ..., steady_plan_bytes: _Optional[int] = ..., steady_plan_bytes_max: _Optional[int] = ..., inflight: _Optional[int] = ..., prefix_promoted_blocks: _Optional[int] = ..., prefix_demoted_blocks: _Optional[int] = ..., tier_copy_s: _Optional[float] = ..., tier_copy_s_max: _Optional[float] = ..., node_name: _Optional[str] = ..., isolated_failures: _Optional[int] = ...) -> None: ...

class SchedulerStats(_message.Message):
    __slots__ = ("running", "waiting", "workers_alive", "device_blocks_total", "device_blocks_free", "host_blocks_total", "host_blocks_free", "workers", "kv_store_alive", "host_integrity_error", "kv_store_engine_recalls", "kv_store_engine_busy_s", "host_prefix_cached_blocks", "host_prefix_evicted_blocks", "cpu_s", "overlap", "host_prefix_demoted_blocks", "host_block_bytes", "node_name", "draining", "block_size")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    WORKERS_ALIVE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_ALIVE_FIELD_NUMBER: _ClassVar[int]
    HOST_INTEGRITY_ERROR_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_ENGINE_RECALLS_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_ENGINE_BUSY_S_FIELD_NUMBER: _ClassVar[int]
    HOST_PREFIX_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_PREFIX_EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CPU_S_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_FIELD_NUMBER: _ClassVar[int]
    HOST_PREFIX_DEMOTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    workers_alive: int
    device_blocks_total: int
    device_blocks_free: int
    host_blocks_total: int
    host_blocks_free: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStats]
    kv_store_alive: bool
    host_integrity_error: str
    kv_store_engine_recalls: int
    kv_store_engine_busy_s: float
    host_prefix_cached_blocks: int
    host_prefix_evicted_blocks: int
    cpu_s: float
    overlap: bool
    host_prefix_demoted_blocks: int
    host_block_bytes: int
    node_name: str
    draining: bool
    block_size: int
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., workers_alive: _Optional[int] = ..., device_blocks_total: _Optional[int] = ..., device_blocks_free: _Optional[int] = ..., host_blocks_total: _Optional[int] = ..., host_blocks_free: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerStats, _Mapping]]] = ..., kv_store_alive: _Optional[bool] = ..., host_integrity_error: _Optional[str] = ..., kv_store_engine_recalls: _Optional[int] = ..., kv_store_engine_busy_s: _Optional[float] = ..., host_prefix_cached_blocks: _Optional[int] = ..., host_prefix_evicted_blocks: _Optional[int] = ..., cpu_s: _Optional[float] = ..., overlap: _Optional[bool] = ..., host_prefix_demoted_blocks: _Optional[int] = ..., host_block_bytes: _Optional[int] = ..., node_name: _Optional[str] = ..., draining: _Optional[bool] = ..., block_size: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("running",)
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    running: int
    def __init__(self, running: _Optional[int] = ...) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ("freed_blocks",)
    FREED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    freed_blocks: int
    def __init__(self, freed_blocks: _Optional[int] = ...) -> None: ...
