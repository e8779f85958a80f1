from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVStoreCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_STORE_OK: _ClassVar[KVStoreCode]
    KV_STORE_RESOURCE_EXHAUSTED: _ClassVar[KVStoreCode]
    KV_STORE_INVALID_ARGUMENT: _ClassVar[KVStoreCode]
    KV_STORE_UNKNOWN_WORKER: _ClassVar[KVStoreCode]
KV_STORE_OK: KVStoreCode
KV_STORE_RESOURCE_EXHAUSTED: KVStoreCode
KV_STORE_INVALID_ARGUMENT: KVStoreCode
KV_STORE_UNKNOWN_WORKER: KVStoreCode

class RegisterWorker(_message.Message):
    __slots__ = ("worker_id", "pid", "pid_namespace")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    PID_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    pid: int
    pid_namespace: str
    def __init__(self, worker_id: _Optional[int] = ..., pid: _Optional[int] = ..., pid_namespace: _Optional[str] = ...) -> None: ...

class Allocate(_message.Message):
    __slots__ = ("owner", "blocks", "worker_id")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    owner: str
    blocks: int
    worker_id: int
    def __init__(self, owner: _Optional[str] = ..., blocks: _Optional[int] = ..., worker_id: _Optional[int] = ...) -> None: ...

class Release(_message.Message):
    __slots__ = ("owner",)
    OWNER_FIELD_NUMBER: _ClassVar[int]
    owner: str
    def __init__(self, owner: _Optional[str] = ...) -> None: ...

class Ping(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AcquirePrefix(_message.Message):
    __slots__ = ("owner", "worker_id", "names", "match_only")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    MATCH_ONLY_FIELD_NUMBER: _ClassVar[int]
    owner: str
    worker_id: int
    names: _containers.RepeatedScalarFieldContainer[bytes]
    match_only: bool
    def __init__(self, owner: _Optional[str] = ..., worker_id: _Optional[int] = ..., names: _Optional[_Iterable[bytes]] = ..., match_only: _Optional[bool] = ...) -> None: ...

class NameBlocks(_message.Message):
    __slots__ = ("names", "blocks", "owner")
    NAMES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[bytes]
    blocks: _containers.RepeatedScalarFieldContainer[int]
    owner: str
    def __init__(self, names: _Optional[_Iterable[bytes]] = ..., blocks: _Optional[_Iterable[int]] = ..., owner: _Optional[str] = ...) -> None: ...

class ReserveDemotion(_message.Message):
    __slots__ = ("owner", "worker_id", "names")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    owner: str
    worker_id: int
    names: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, owner: _Optional[str] = ..., worker_id: _Optional[int] = ..., names: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DropPrefixCache(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class OpenRecallTarget(_message.Message):
    __slots__ = ("worker_id", "num_layers", "slots", "kv_heads", "head_dim", "block_size", "cuda", "dtype")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    num_layers: int
    slots: int
    kv_heads: int
    head_dim: int
    block_size: int
    cuda: CudaCache
    dtype: str
    def __init__(self, worker_id: _Optional[int] = ..., num_layers: _Optional[int] = ..., slots: _Optional[int] = ..., kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., cuda: _Optional[_Union[CudaCache, _Mapping]] = ..., dtype: _Optional[str] = ...) -> None: ...

class CudaCache(_message.Message):
    __slots__ = ("device", "memory_handle", "storage_bytes", "storage_offset", "ref_counter_handle", "ref_counter_offset", "sync_event", "sync_required", "ready_event", "landed_event")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SYNC_EVENT_FIELD_NUMBER: _ClassVar[int]
    SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    READY_EVENT_FIELD_NUMBER: _ClassVar[int]
    LANDED_EVENT_FIELD_NUMBER: _ClassVar[int]
    device: int
    memory_handle: bytes
    storage_bytes: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    sync_event: bytes
    sync_required: bool
    ready_event: bytes
    landed_event: bytes
    def __init__(self, device: _Optional[int] = ..., memory_handle: _Optional[bytes] = ..., storage_bytes: _Optional[int] = ..., storage_offset: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., sync_event: _Optional[bytes] = ..., sync_required: _Optional[bool] = ..., ready_event: _Optional[bytes] = ..., landed_event: _Optional[bytes] = ...) -> None: ...

class StatsQuery(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVStoreRequest(_message.Message):
    __slots__ = ("register", "allocate", "release", "ping", "stats", "open_recall", "acquire_prefix", "name_blocks", "drop_prefix_cache", "reserve_demotion", "prefix_events")
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    ALLOCATE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    PING_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    OPEN_RECALL_FIELD_NUMBER: _ClassVar[int]
    ACQUIRE_PREFIX_FIELD_NUMBER: _ClassVar[int]
    NAME_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DROP_PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    RESERVE_DEMOTION_FIELD_NUMBER: _ClassVar[int]
    PREFIX_EVENTS_FIELD_NUMBER: _ClassVar[int]
    register: RegisterWorker
    allocate: Allocate
    release: Release
    ping: Ping
    stats: StatsQuery
    open_recall: OpenRecallTarget
    acquire_prefix: AcquirePrefix
    name_blocks: NameBlocks
    drop_prefix_cache: DropPrefixCache
    reserve_demotion: ReserveDemotion
    prefix_events: PrefixEventsQuery
    def __init__(self, register: _Optional[_Union[RegisterWorker, _Mapping]] = ..., allocate: _Optional[_Union[Allocate, _Mapping]] = ..., release: _Optional[_Union[Release, _Mapping]] = ..., ping: _Optional[_Union[Ping, _Mapping]] = ..., stats: _Optional[_Union[StatsQuery, _Mapping]] = ..., open_recall: _Optional[_Union[OpenRecallTarget, _Mapping]] = ..., acquire_prefix: _Optional[_Union[AcquirePrefix, _Mapping]] = ..., name_blocks: _Optional[_Union[NameBlocks, _Mapping]] = ..., drop_prefix_cache: _Optional[_Union[DropPrefixCache, _Mapping]] = ..., reserve_demotion: _Optional[_Union[ReserveDemotion, _Mapping]] = ..., prefix_events: _Optional[_Union[PrefixEventsQuery, _Mapping]] = ...) -> None: ...

class PrefixEventsQuery(_message.Message):
    __slots__ = ("epoch", "since")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    since: int
    def __init__(self, epoch: _Optional[int] = ..., since: _Optional[int] = ...) -> None: ...

class PrefixEvents(_message.Message):
    __slots__ = ("epoch", "next", "snapshot", "stored", "removed")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NEXT_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    next: int
    snapshot: bool
    stored: _containers.RepeatedScalarFieldContainer[bytes]
    removed: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, epoch: _Optional[int] = ..., next: _Optional[int] = ..., snapshot: _Optional[bool] = ..., stored: _Optional[_Iterable[bytes]] = ..., removed: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PoolLayout(_message.Message):
    __slots__ = ("shm_name", "num_blocks", "unit_bytes", "num_layers", "dtype")
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    UNIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    shm_name: str
    num_blocks: int
    unit_bytes: int
    num_layers: int
    dtype: str
    def __init__(self, shm_name: _Optional[str] = ..., num_blocks: _Optional[int] = ..., unit_bytes: _Optional[int] = ..., num_layers: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class KVStoreStats(_message.Message):
    __slots__ = ("blocks_total", "blocks_free", "owners", "workers", "integrity_error", "engine_recalls", "engine_busy_s", "prefix_cached_blocks", "prefix_evicted_blocks", "prefix_demoted_blocks", "block_bytes")
    BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    OWNERS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_ERROR_FIELD_NUMBER: _ClassVar[int]
    ENGINE_RECALLS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_BUSY_S_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_DEMOTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    blocks_total: int
    blocks_free: int
    owners: int
    workers: int
    integrity_error: str
    engine_recalls: int
    engine_busy_s: float
    prefix_cached_blocks: int
    prefix_evicted_blocks: int
    prefix_demoted_blocks: int
    block_bytes: int
    def __init__(self, blocks_total: _Optional[int] = ..., blocks_free: _Optional[int] = ..., owners: _Optional[int] = ..., workers: _Optional[int] = ..., integrity_error: _Optional[str] = ..., engine_recalls: _Optional[int] = ..., engine_busy_s: _Optional[float] = ..., prefix_cached_blocks: _Optional[int] = ..., prefix_evicted_blocks: _Optional[int] = ..., prefix_demoted_blocks: _Optional[int] = ..., block_bytes: _Optional[int] = ...) -> None: ...

class KVStoreResponse(_message.Message):
    __slots__ = ("code", "error", "blocks", "reserved", "freed", "layout", "stats", "prefix_events")
    CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    FREED_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_EVENTS_FIELD_NUMBER: _ClassVar[int]
    code: KVStoreCode
    error: str
    blocks: _containers.RepeatedScalarFieldContainer[int]
    reserved: _containers.RepeatedScalarFieldContainer[int]
    freed: int
    layout: PoolLayout
    stats: KVStoreStats
    prefix_events: PrefixEvents
    def __init__(self, code: _Optional[_Union[KVStoreCode, str]] = ..., error: _Optional[str] = ..., blocks: _Optional[_Iterable[int]] = ..., reserved: _Optional[_Iterable[int]] = ..., freed: _Optional[int] = ..., layout: _Optional[_Union[PoolLayout, _Mapping]] = ..., stats: _Optional[_Union[KVStoreStats, _Mapping]] = ..., prefix_events: _Optional[_Union[PrefixEvents, _Mapping]] = ...) -> None: ...

class RecallRequest(_message.Message):
    __slots__ = ("worker_id", "sequence", "layer", "host_blocks", "device_blocks", "heads")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HEADS_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    sequence: int
    layer: int
    host_blocks: bytes
    device_blocks: bytes
    heads: bytes
    def __init__(self, worker_id: _Optional[int] = ..., sequence: _Optional[int] = ..., layer: _Optional[int] = ..., host_blocks: _Optional[bytes] = ..., device_blocks: _Optional[bytes] = ..., heads: _Optional[bytes] = ...) -> None: ...

class RecallDone(_message.Message):
    __slots__ = ("sequence", "error", "busy_s")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BUSY_S_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    error: str
    busy_s: float
    def __init__(self, sequence: _Optional[int] = ..., error: _Optional[str] = ..., busy_s: _Optional[float] = ...) -> None: ...
