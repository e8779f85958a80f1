from pulseinfer.proto.pulseinfer.v1 import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingSpec(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "step", "min_p", "min_tokens", "stop_ids", "bias_ids", "bias_values", "logprobs", "top_logprobs", "penalized", "presence_penalty", "frequency_penalty", "repetition_penalty", "history_prompt", "history_outputs", "structured_kind", "structured_value")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_IDS_FIELD_NUMBER: _ClassVar[int]
    BIAS_IDS_FIELD_NUMBER: _ClassVar[int]
    BIAS_VALUES_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PENALIZED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    HISTORY_PROMPT_FIELD_NUMBER: _ClassVar[int]
    HISTORY_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_KIND_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_VALUE_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    step: int
    min_p: float
    min_tokens: int
    stop_ids: _containers.RepeatedScalarFieldContainer[int]
    bias_ids: _containers.RepeatedScalarFieldContainer[int]
    bias_values: _containers.RepeatedScalarFieldContainer[float]
    logprobs: bool
    top_logprobs: int
    penalized: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    history_prompt: _containers.RepeatedScalarFieldContainer[int]
    history_outputs: _containers.RepeatedScalarFieldContainer[int]
    structured_kind: str
    structured_value: str
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., step: _Optional[int] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., stop_ids: _Optional[_Iterable[int]] = ..., bias_ids: _Optional[_Iterable[int]] = ..., bias_values: _Optional[_Iterable[float]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., penalized: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., history_prompt: _Optional[_Iterable[int]] = ..., history_outputs: _Optional[_Iterable[int]] = ..., structured_kind: _Optional[str] = ..., structured_value: _Optional[str] = ...) -> None: ...

class Admission(_message.Message):
    __slots__ = ("handle", "seq_id", "start_pos", "length", "sampling", "offloaded", "host_prefix", "stop_token_ids", "ignore_eos", "score_prompt", "prompt_top")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    START_POS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    OFFLOADED_FIELD_NUMBER: _ClassVar[int]
    HOST_PREFIX_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SCORE_PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_FIELD_NUMBER: _ClassVar[int]
    handle: int
    seq_id: str
    start_pos: int
    length: int
    sampling: SamplingSpec
    offloaded: bool
    host_prefix: _containers.RepeatedScalarFieldContainer[int]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    score_prompt: bool
    prompt_top: int
    def __init__(self, handle: _Optional[int] = ..., seq_id: _Optional[str] = ..., start_pos: _Optional[int] = ..., length: _Optional[int] = ..., sampling: _Optional[_Union[SamplingSpec, _Mapping]] = ..., offloaded: _Optional[bool] = ..., host_prefix: _Optional[_Iterable[int]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., score_prompt: _Optional[bool] = ..., prompt_top: _Optional[int] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "released", "admitted", "grant_handles", "grant_blocks", "prefill_handles", "prefill_lengths", "prefill_tokens", "decode", "name_handles", "name_blocks", "names", "demote_blocks", "demote_names", "score_handles", "score_next")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    GRANT_HANDLES_FIELD_NUMBER: _ClassVar[int]
    GRANT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_HANDLES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    NAME_HANDLES_FIELD_NUMBER: _ClassVar[int]
    NAME_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    DEMOTE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEMOTE_NAMES_FIELD_NUMBER: _ClassVar[int]
    SCORE_HANDLES_FIELD_NUMBER: _ClassVar[int]
    SCORE_NEXT_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    released: _containers.RepeatedScalarFieldContainer[int]
    admitted: _containers.RepeatedCompositeFieldContainer[Admission]
    grant_handles: _containers.RepeatedScalarFieldContainer[int]
    grant_blocks: _containers.RepeatedScalarFieldContainer[int]
    prefill_handles: _containers.RepeatedScalarFieldContainer[int]
    prefill_lengths: _containers.RepeatedScalarFieldContainer[int]
    prefill_tokens: _containers.RepeatedScalarFieldContainer[int]
    decode: _containers.RepeatedScalarFieldContainer[int]
    name_handles: _containers.RepeatedScalarFieldContainer[int]
    name_blocks: _containers.RepeatedScalarFieldContainer[int]
    names: _containers.RepeatedScalarFieldContainer[bytes]
    demote_blocks: _containers.RepeatedScalarFieldContainer[int]
    demote_names: _containers.RepeatedScalarFieldContainer[bytes]
    score_handles: _containers.RepeatedScalarFieldContainer[int]
    score_next: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step_id: _Optional[int] = ..., released: _Optional[_Iterable[int]] = ..., admitted: _Optional[_Iterable[_Union[Admission, _Mapping]]] = ..., grant_handles: _Optional[_Iterable[int]] = ..., grant_blocks: _Optional[_Iterable[int]] = ..., prefill_handles: _Optional[_Iterable[int]] = ..., prefill_lengths: _Optional[_Iterable[int]] = ..., prefill_tokens: _Optional[_Iterable[int]] = ..., decode: _Optional[_Iterable[int]] = ..., name_handles: _Optional[_Iterable[int]] = ..., name_blocks: _Optional[_Iterable[int]] = ..., names: _Optional[_Iterable[bytes]] = ..., demote_blocks: _Optional[_Iterable[int]] = ..., demote_names: _Optional[_Iterable[bytes]] = ..., score_handles: _Optional[_Iterable[int]] = ..., score_next: _Optional[_Iterable[int]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "handles", "token_ids", "forward_s", "idle_s", "error", "failed", "recall", "compute_s", "tier_copy_s", "logprob_handles", "logprobs", "prompt_handles", "prompt_logprobs", "isolated_failures")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    IDLE_S_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    RECALL_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    TIER_COPY_S_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_HANDLES_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_HANDLES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ISOLATED_FAILURES_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    handles: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    forward_s: float
    idle_s: float
    error: str
    failed: _containers.RepeatedCompositeFieldContainer[SequenceError]
    recall: RecallStats
    compute_s: float
    tier_copy_s: float
    logprob_handles: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_generate_pb2.Logprobs]
    prompt_handles: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generate_pb2.Logprobs]
    isolated_failures: int
    def __init__(self, step_id: _Optional[int] = ..., handles: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., forward_s: _Optional[float] = ..., idle_s: _Optional[float] = ..., error: _Optional[str] = ..., failed: _Optional[_Iterable[_Union[SequenceError, _Mapping]]] = ..., recall: _Optional[_Union[RecallStats, _Mapping]] = ..., compute_s: _Optional[float] = ..., tier_copy_s: _Optional[float] = ..., logprob_handles: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_generate_pb2.Logprobs, _Mapping]]] = ..., prompt_handles: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generate_pb2.Logprobs, _Mapping]]] = ..., isolated_failures: _Optional[int] = ...) -> None: ...

class RecallStats(_message.Message):
    __slots__ = ("units", "transfers", "bytes", "wait_s", "prefetched_units", "corrected_units", "io_busy_s", "truncated_units", "suspended_rows", "resumed_layers")
    UNITS_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    PREFETCHED_UNITS_FIELD_NUMBER: _ClassVar[int]
    CORRECTED_UNITS_FIELD_NUMBER: _ClassVar[int]
    IO_BUSY_S_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_UNITS_FIELD_NUMBER: _ClassVar[int]
    SUSPENDED_ROWS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_LAYERS_FIELD_NUMBER: _ClassVar[int]
    units: int
    transfers: int
    bytes: int
    wait_s: float
    prefetched_units: int
    corrected_units: int
    io_busy_s: float
    truncated_units: int
    suspended_rows: int
    resumed_layers: int
    def __init__(self, units: _Optional[int] = ..., transfers: _Optional[int] = ..., bytes: _Optional[int] = ..., wait_s: _Optional[float] = ..., prefetched_units: _Optional[int] = ..., corrected_units: _Optional[int] = ..., io_busy_s: _Optional[float] = ..., truncated_units: _Optional[int] = ..., suspended_rows: _Optional[int] = ..., resumed_layers: _Optional[int] = ...) -> None: ...

class SequenceError(_message.Message):
    __slots__ = ("handle", "error")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    handle: int
    error: str
    def __init__(self, handle: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("worker_id", "pid", "device_blocks_total", "block_size", "max_position", "eos_id", "vocab_size", "model", "offload_blocks", "max_running", "host_tier", "window_history")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITION_FIELD_NUMBER: _ClassVar[int]
    EOS_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_FIELD_NUMBER: _ClassVar[int]
    WINDOW_HISTORY_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    pid: int
    device_blocks_total: int
    block_size: int
    max_position: int
    eos_id: int
    vocab_size: int
    model: str
    offload_blocks: int
    max_running: int
    host_tier: bool
    window_history: bool
    def __init__(self, worker_id: _Optional[int] = ..., pid: _Optional[int] = ..., device_blocks_total: _Optional[int] = ..., block_size: _Optional[int] = ..., max_position: _Optional[int] = ..., eos_id: _Optional[int] = ..., vocab_size: _Optional[int] = ..., model: _Optional[str] = ..., offload_blocks: _Optional[int] = ..., max_running: _Optional[int] = ..., host_tier: _Optional[bool] = ..., window_history: _Optional[bool] = ...) -> None: ...

class WorkerMessage(_message.Message):
    __slots__ = ("result", "heartbeat")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    result: StepResult
    heartbeat: Heartbeat
    def __init__(self, result: _Optional[_Union[StepResult, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ...) -> None: ...

class SchedulerMessage(_message.Message):
    __slots__ = ("plan", "shutdown")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    plan: StepPlan
    shutdown: Shutdown
    def __init__(self, plan: _Optional[_Union[StepPlan, _Mapping]] = ..., shutdown: _Optional[_Union[Shutdown, _Mapping]] = ...) -> None: ...

class Shutdown(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
