from kvd_client.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PeerCall(_message.Message):
    __slots__ = ("call_id", "timeout_ms", "cancel", "prepare_pull", "abandon_pull", "finish_read", "renew_leases", "release_leases")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    PREPARE_PULL_FIELD_NUMBER: _ClassVar[int]
    ABANDON_PULL_FIELD_NUMBER: _ClassVar[int]
    FINISH_READ_FIELD_NUMBER: _ClassVar[int]
    RENEW_LEASES_FIELD_NUMBER: _ClassVar[int]
    RELEASE_LEASES_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    timeout_ms: int
    cancel: bool
    prepare_pull: PreparePullRequest
    abandon_pull: AbandonPullRequest
    finish_read: FinishReadRequest
    renew_leases: RenewLeasesRequest
    release_leases: ReleaseLeasesRequest
    def __init__(self, call_id: _Optional[int] = ..., timeout_ms: _Optional[int] = ..., cancel: _Optional[bool] = ..., prepare_pull: _Optional[_Union[PreparePullRequest, _Mapping]] = ..., abandon_pull: _Optional[_Union[AbandonPullRequest, _Mapping]] = ..., finish_read: _Optional[_Union[FinishReadRequest, _Mapping]] = ..., renew_leases: _Optional[_Union[RenewLeasesRequest, _Mapping]] = ..., release_leases: _Optional[_Union[ReleaseLeasesRequest, _Mapping]] = ...) -> None: ...

class PeerCalls(_message.Message):
    __slots__ = ("calls",)
    CALLS_FIELD_NUMBER: _ClassVar[int]
    calls: _containers.RepeatedCompositeFieldContainer[PeerCall]
    def __init__(self, calls: _Optional[_Iterable[_Union[PeerCall, _Mapping]]] = ...) -> None: ...

class PeerReply(_message.Message):
    __slots__ = ("call_id", "code", "error_message", "error_class", "prepare_pull", "abandon_pull", "finish_read", "renew_leases", "release_leases")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_CLASS_FIELD_NUMBER: _ClassVar[int]
    PREPARE_PULL_FIELD_NUMBER: _ClassVar[int]
    ABANDON_PULL_FIELD_NUMBER: _ClassVar[int]
    FINISH_READ_FIELD_NUMBER: _ClassVar[int]
    RENEW_LEASES_FIELD_NUMBER: _ClassVar[int]
    RELEASE_LEASES_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    code: int
    error_message: str
    error_class: str
    prepare_pull: PreparePullResponse
    abandon_pull: AbandonPullResponse
    finish_read: FinishReadResponse
    renew_leases: RenewLeasesResponse
    release_leases: ReleaseLeasesResponse
    def __init__(self, call_id: _Optional[int] = ..., code: _Optional[int] = ..., error_message: _Optional[str] = ..., error_class: _Optional[str] = ..., prepare_pull: _Optional[_Union[PreparePullResponse, _Mapping]] = ..., abandon_pull: _Optional[_Union[AbandonPullResponse, _Mapping]] = ..., finish_read: _Optional[_Union[FinishReadResponse, _Mapping]] = ..., renew_leases: _Optional[_Union[RenewLeasesResponse, _Mapping]] = ..., release_leases: _Optional[_Union[ReleaseLeasesResponse, _Mapping]] = ...) -> None: ...

class PeerReplies(_message.Message):
    __slots__ = ("replies",)
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    replies: _containers.RepeatedCompositeFieldContainer[PeerReply]
    def __init__(self, replies: _Optional[_Iterable[_Union[PeerReply, _Mapping]]] = ...) -> None: ...

class PeerFrame(_message.Message):
    __slots__ = ("replies", "end")
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    replies: PeerReplies
    end: _common_pb2.StreamEnd
    def __init__(self, replies: _Optional[_Union[PeerReplies, _Mapping]] = ..., end: _Optional[_Union[_common_pb2.StreamEnd, _Mapping]] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("caller_incarnation", "caller_address")
    CALLER_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    CALLER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    caller_incarnation: str
    caller_address: str
    def __init__(self, caller_incarnation: _Optional[str] = ..., caller_address: _Optional[str] = ...) -> None: ...

class RegionDescriptor(_message.Message):
    __slots__ = ("address", "size_bytes", "vram", "device_index", "registration_serial")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    VRAM_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_SERIAL_FIELD_NUMBER: _ClassVar[int]
    address: int
    size_bytes: int
    vram: bool
    device_index: int
    registration_serial: int
    def __init__(self, address: _Optional[int] = ..., size_bytes: _Optional[int] = ..., vram: _Optional[bool] = ..., device_index: _Optional[int] = ..., registration_serial: _Optional[int] = ...) -> None: ...

class EngineDescriptor(_message.Message):
    __slots__ = ("engine_id", "layout", "regions", "layers", "registration_id", "early_reads", "step_notifications", "finish_read_ends_reads", "groups")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_ID_FIELD_NUMBER: _ClassVar[int]
    EARLY_READS_FIELD_NUMBER: _ClassVar[int]
    STEP_NOTIFICATIONS_FIELD_NUMBER: _ClassVar[int]
    FINISH_READ_ENDS_READS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    layout: _common_pb2.KvLayoutSpec
    regions: _containers.RepeatedCompositeFieldContainer[RegionDescriptor]
    layers: _containers.RepeatedCompositeFieldContainer[_common_pb2.LayerPlacement]
    registration_id: int
    early_reads: bool
    step_notifications: bool
    finish_read_ends_reads: bool
    groups: _containers.RepeatedCompositeFieldContainer[_common_pb2.KvCacheGroup]
    def __init__(self, engine_id: _Optional[str] = ..., layout: _Optional[_Union[_common_pb2.KvLayoutSpec, _Mapping]] = ..., regions: _Optional[_Iterable[_Union[RegionDescriptor, _Mapping]]] = ..., layers: _Optional[_Iterable[_Union[_common_pb2.LayerPlacement, _Mapping]]] = ..., registration_id: _Optional[int] = ..., early_reads: _Optional[bool] = ..., step_notifications: _Optional[bool] = ..., finish_read_ends_reads: _Optional[bool] = ..., groups: _Optional[_Iterable[_Union[_common_pb2.KvCacheGroup, _Mapping]]] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("incarnation", "agent_name", "agent_metadata", "engines", "agent_regions", "early_read_window_ms", "peer_stream_port")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    AGENT_REGIONS_FIELD_NUMBER: _ClassVar[int]
    EARLY_READ_WINDOW_MS_FIELD_NUMBER: _ClassVar[int]
    PEER_STREAM_PORT_FIELD_NUMBER: _ClassVar[int]
    incarnation: str
    agent_name: str
    agent_metadata: bytes
    engines: _containers.RepeatedCompositeFieldContainer[EngineDescriptor]
    agent_regions: _containers.RepeatedCompositeFieldContainer[RegionDescriptor]
    early_read_window_ms: int
    peer_stream_port: int
    def __init__(self, incarnation: _Optional[str] = ..., agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., engines: _Optional[_Iterable[_Union[EngineDescriptor, _Mapping]]] = ..., agent_regions: _Optional[_Iterable[_Union[RegionDescriptor, _Mapping]]] = ..., early_read_window_ms: _Optional[int] = ..., peer_stream_port: _Optional[int] = ...) -> None: ...

class PreparePullRequest(_message.Message):
    __slots__ = ("lease_id", "engine_id", "block_ids", "num_tokens", "reader_incarnation", "reader_tp_rank", "reader_tp_size", "remote_tp_ranks", "reader_address", "reader_transfer_id", "read_timeout_ms", "read_id", "registration_ids", "group_block_ids", "group_block_counts")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    READER_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    READER_TP_RANK_FIELD_NUMBER: _ClassVar[int]
    READER_TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    REMOTE_TP_RANKS_FIELD_NUMBER: _ClassVar[int]
    READER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    READER_TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    READ_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    READ_ID_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_IDS_FIELD_NUMBER: _ClassVar[int]
    GROUP_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    GROUP_BLOCK_COUNTS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    engine_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    reader_incarnation: str
    reader_tp_rank: int
    reader_tp_size: int
    remote_tp_ranks: _containers.RepeatedScalarFieldContainer[int]
    reader_address: str
    reader_transfer_id: str
    read_timeout_ms: int
    read_id: str
    registration_ids: _containers.RepeatedScalarFieldContainer[int]
    group_block_ids: _containers.RepeatedScalarFieldContainer[int]
    group_block_counts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., reader_incarnation: _Optional[str] = ..., reader_tp_rank: _Optional[int] = ..., reader_tp_size: _Optional[int] = ..., remote_tp_ranks: _Optional[_Iterable[int]] = ..., reader_address: _Optional[str] = ..., reader_transfer_id: _Optional[str] = ..., read_timeout_ms: _Optional[int] = ..., read_id: _Optional[str] = ..., registration_ids: _Optional[_Iterable[int]] = ..., group_block_ids: _Optional[_Iterable[int]] = ..., group_block_counts: _Optional[_Iterable[int]] = ...) -> None: ...

class PreparePullResponse(_message.Message):
    __slots__ = ("registration_ids", "notif_tag", "verify_after_read")
    REGISTRATION_IDS_FIELD_NUMBER: _ClassVar[int]
    NOTIF_TAG_FIELD_NUMBER: _ClassVar[int]
    VERIFY_AFTER_READ_FIELD_NUMBER: _ClassVar[int]
    registration_ids: _containers.RepeatedScalarFieldContainer[int]
    notif_tag: str
    verify_after_read: bool
    def __init__(self, registration_ids: _Optional[_Iterable[int]] = ..., notif_tag: _Optional[str] = ..., verify_after_read: _Optional[bool] = ...) -> None: ...

class AbandonPullRequest(_message.Message):
    __slots__ = ("lease_id", "reader_tp_rank", "reason", "reader_incarnation", "reader_transfer_id")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    READER_TP_RANK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    READER_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    READER_TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    reader_tp_rank: int
    reason: str
    reader_incarnation: str
    reader_transfer_id: str
    def __init__(self, lease_id: _Optional[str] = ..., reader_tp_rank: _Optional[int] = ..., reason: _Optional[str] = ..., reader_incarnation: _Optional[str] = ..., reader_transfer_id: _Optional[str] = ...) -> None: ...

class AbandonPullResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FinishReadRequest(_message.Message):
    __slots__ = ("lease_id", "reader_tp_rank", "reader_incarnation", "reader_transfer_id", "nbytes")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    READER_TP_RANK_FIELD_NUMBER: _ClassVar[int]
    READER_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    READER_TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    reader_tp_rank: int
    reader_incarnation: str
    reader_transfer_id: str
    nbytes: int
    def __init__(self, lease_id: _Optional[str] = ..., reader_tp_rank: _Optional[int] = ..., reader_incarnation: _Optional[str] = ..., reader_transfer_id: _Optional[str] = ..., nbytes: _Optional[int] = ...) -> None: ...

class FinishReadResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RenewLeasesRequest(_message.Message):
    __slots__ = ("lease_ids",)
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lease_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RenewLeasesResponse(_message.Message):
    __slots__ = ("unknown_lease_ids",)
    UNKNOWN_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    unknown_lease_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, unknown_lease_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseLeasesRequest(_message.Message):
    __slots__ = ("lease_ids", "reason")
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[str]
    reason: str
    def __init__(self, lease_ids: _Optional[_Iterable[str]] = ..., reason: _Optional[str] = ...) -> None: ...

class ReleaseLeasesResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
