from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvLayout(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_LAYOUT_UNSPECIFIED: _ClassVar[KvLayout]
    KV_LAYOUT_NHD: _ClassVar[KvLayout]
    KV_LAYOUT_HND: _ClassVar[KvLayout]

class KvFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_FORMAT_UNSPECIFIED: _ClassVar[KvFormat]
    KV_FORMAT_SPLIT: _ClassVar[KvFormat]
    KV_FORMAT_JOINT: _ClassVar[KvFormat]
    KV_FORMAT_MLA: _ClassVar[KvFormat]
    KV_FORMAT_PACKED: _ClassVar[KvFormat]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT8_E4M3: _ClassVar[DType]
    DTYPE_FLOAT8_E5M2: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]

class MemoryKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMORY_KIND_UNSPECIFIED: _ClassVar[MemoryKind]
    MEMORY_KIND_SHM: _ClassVar[MemoryKind]
    MEMORY_KIND_CUDA_IPC: _ClassVar[MemoryKind]

class KvGroupKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_GROUP_KIND_UNSPECIFIED: _ClassVar[KvGroupKind]
    KV_GROUP_KIND_FULL_ATTENTION: _ClassVar[KvGroupKind]
    KV_GROUP_KIND_SLIDING_WINDOW: _ClassVar[KvGroupKind]
    KV_GROUP_KIND_STATE: _ClassVar[KvGroupKind]

class TransferState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_STATE_UNSPECIFIED: _ClassVar[TransferState]
    TRANSFER_STATE_PLANNED: _ClassVar[TransferState]
    TRANSFER_STATE_READING: _ClassVar[TransferState]
    TRANSFER_STATE_POSTPROCESSING: _ClassVar[TransferState]
    TRANSFER_STATE_DONE: _ClassVar[TransferState]
    TRANSFER_STATE_FAILED: _ClassVar[TransferState]
    TRANSFER_STATE_ABORTED: _ClassVar[TransferState]
    TRANSFER_STATE_FENCING: _ClassVar[TransferState]
KV_LAYOUT_UNSPECIFIED: KvLayout
KV_LAYOUT_NHD: KvLayout
KV_LAYOUT_HND: KvLayout
KV_FORMAT_UNSPECIFIED: KvFormat
KV_FORMAT_SPLIT: KvFormat
KV_FORMAT_JOINT: KvFormat
KV_FORMAT_MLA: KvFormat
KV_FORMAT_PACKED: KvFormat
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT8_E4M3: DType
DTYPE_FLOAT8_E5M2: DType
DTYPE_UINT8: DType
MEMORY_KIND_UNSPECIFIED: MemoryKind
MEMORY_KIND_SHM: MemoryKind
MEMORY_KIND_CUDA_IPC: MemoryKind
KV_GROUP_KIND_UNSPECIFIED: KvGroupKind
KV_GROUP_KIND_FULL_ATTENTION: KvGroupKind
KV_GROUP_KIND_SLIDING_WINDOW: KvGroupKind
KV_GROUP_KIND_STATE: KvGroupKind
TRANSFER_STATE_UNSPECIFIED: TransferState
TRANSFER_STATE_PLANNED: TransferState
TRANSFER_STATE_READING: TransferState
TRANSFER_STATE_POSTPROCESSING: TransferState
TRANSFER_STATE_DONE: TransferState
TRANSFER_STATE_FAILED: TransferState
TRANSFER_STATE_ABORTED: TransferState
TRANSFER_STATE_FENCING: TransferState

class KvLayoutSpec(_message.Message):
    __slots__ = ("num_layers", "kv_format", "layout", "block_size", "num_kv_heads", "total_num_kv_heads", "head_dim", "dtype", "num_blocks", "tp_rank", "tp_size")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_FORMAT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    kv_format: KvFormat
    layout: KvLayout
    block_size: int
    num_kv_heads: int
    total_num_kv_heads: int
    head_dim: int
    dtype: DType
    num_blocks: int
    tp_rank: int
    tp_size: int
    def __init__(self, num_layers: _Optional[int] = ..., kv_format: _Optional[_Union[KvFormat, str]] = ..., layout: _Optional[_Union[KvLayout, str]] = ..., block_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., total_num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., num_blocks: _Optional[int] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ...) -> None: ...

class KvCacheGroup(_message.Message):
    __slots__ = ("kind", "layout", "layers", "sliding_window", "name", "block_table")
    KIND_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    kind: KvGroupKind
    layout: KvLayoutSpec
    layers: _containers.RepeatedCompositeFieldContainer[LayerPlacement]
    sliding_window: int
    name: str
    block_table: int
    def __init__(self, kind: _Optional[_Union[KvGroupKind, str]] = ..., layout: _Optional[_Union[KvLayoutSpec, _Mapping]] = ..., layers: _Optional[_Iterable[_Union[LayerPlacement, _Mapping]]] = ..., sliding_window: _Optional[int] = ..., name: _Optional[str] = ..., block_table: _Optional[int] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("device_index", "handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    device_index: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, device_index: _Optional[int] = ..., handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class MemoryRegion(_message.Message):
    __slots__ = ("kind", "size_bytes", "shm_name", "cuda_ipc")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    kind: MemoryKind
    size_bytes: int
    shm_name: str
    cuda_ipc: CudaIpcHandle
    def __init__(self, kind: _Optional[_Union[MemoryKind, str]] = ..., size_bytes: _Optional[int] = ..., shm_name: _Optional[str] = ..., cuda_ipc: _Optional[_Union[CudaIpcHandle, _Mapping]] = ...) -> None: ...

class LayerPlacement(_message.Message):
    __slots__ = ("region", "k_offset", "v_offset")
    REGION_FIELD_NUMBER: _ClassVar[int]
    K_OFFSET_FIELD_NUMBER: _ClassVar[int]
    V_OFFSET_FIELD_NUMBER: _ClassVar[int]
    region: int
    k_offset: int
    v_offset: int
    def __init__(self, region: _Optional[int] = ..., k_offset: _Optional[int] = ..., v_offset: _Optional[int] = ...) -> None: ...

class KvTransferParams(_message.Message):
    __slots__ = ("daemon_address", "daemon_incarnation", "engine_id", "tp_size", "lease_id", "block_ids", "num_tokens", "request_id", "lease_expires_unix_ms", "registration_ids", "group_block_ids", "group_block_counts")
    DAEMON_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DAEMON_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_IDS_FIELD_NUMBER: _ClassVar[int]
    GROUP_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    GROUP_BLOCK_COUNTS_FIELD_NUMBER: _ClassVar[int]
    daemon_address: str
    daemon_incarnation: str
    engine_id: str
    tp_size: int
    lease_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    request_id: str
    lease_expires_unix_ms: int
    registration_ids: _containers.RepeatedScalarFieldContainer[int]
    group_block_ids: _containers.RepeatedScalarFieldContainer[int]
    group_block_counts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, daemon_address: _Optional[str] = ..., daemon_incarnation: _Optional[str] = ..., engine_id: _Optional[str] = ..., tp_size: _Optional[int] = ..., lease_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., request_id: _Optional[str] = ..., lease_expires_unix_ms: _Optional[int] = ..., registration_ids: _Optional[_Iterable[int]] = ..., group_block_ids: _Optional[_Iterable[int]] = ..., group_block_counts: _Optional[_Iterable[int]] = ...) -> None: ...

class TransferStatus(_message.Message):
    __slots__ = ("transfer_id", "request_id", "engine_id", "tp_rank", "peer_address", "state", "bytes", "descriptors", "error_code", "error_message", "elapsed_s", "direct", "phase_s", "error_class")
    class PhaseSEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTORS_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    DIRECT_FIELD_NUMBER: _ClassVar[int]
    PHASE_S_FIELD_NUMBER: _ClassVar[int]
    ERROR_CLASS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    request_id: str
    engine_id: str
    tp_rank: int
    peer_address: str
    state: TransferState
    bytes: int
    descriptors: int
    error_code: str
    error_message: str
    elapsed_s: float
    direct: bool
    phase_s: _containers.ScalarMap[str, float]
    error_class: str
    def __init__(self, transfer_id: _Optional[str] = ..., request_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., tp_rank: _Optional[int] = ..., peer_address: _Optional[str] = ..., state: _Optional[_Union[TransferState, str]] = ..., bytes: _Optional[int] = ..., descriptors: _Optional[int] = ..., error_code: _Optional[str] = ..., error_message: _Optional[str] = ..., elapsed_s: _Optional[float] = ..., direct: _Optional[bool] = ..., phase_s: _Optional[_Mapping[str, float]] = ..., error_class: _Optional[str] = ...) -> None: ...

class LeaseInfo(_message.Message):
    __slots__ = ("lease_id", "engine_id", "request_id", "block_ids", "num_tokens", "expires_unix_ms", "group_block_ids", "group_block_counts")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    GROUP_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    GROUP_BLOCK_COUNTS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    engine_id: str
    request_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    expires_unix_ms: int
    group_block_ids: _containers.RepeatedScalarFieldContainer[int]
    group_block_counts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., request_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., expires_unix_ms: _Optional[int] = ..., group_block_ids: _Optional[_Iterable[int]] = ..., group_block_counts: _Optional[_Iterable[int]] = ...) -> None: ...

class StreamEnd(_message.Message):
    __slots__ = ("code", "message", "error_class")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_CLASS_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    error_class: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., error_class: _Optional[str] = ...) -> None: ...
