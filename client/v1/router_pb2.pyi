from kvd_client.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SelftestHoldRequest(_message.Message):
    __slots__ = ("size_bytes", "seed")
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    size_bytes: int
    seed: int
    def __init__(self, size_bytes: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class SelftestHoldResponse(_message.Message):
    __slots__ = ("kv_transfer_params", "layout")
    KV_TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    kv_transfer_params: _common_pb2.KvTransferParams
    layout: _common_pb2.KvLayoutSpec
    def __init__(self, kv_transfer_params: _Optional[_Union[_common_pb2.KvTransferParams, _Mapping]] = ..., layout: _Optional[_Union[_common_pb2.KvLayoutSpec, _Mapping]] = ...) -> None: ...

class StartPullRequest(_message.Message):
    __slots__ = ("engine_id", "tp_rank", "request_id", "local_block_ids", "remote", "deadline_ms", "local_group_block_ids", "local_group_block_counts")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LOCAL_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_GROUP_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_GROUP_BLOCK_COUNTS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    tp_rank: int
    request_id: str
    local_block_ids: _containers.RepeatedScalarFieldContainer[int]
    remote: _common_pb2.KvTransferParams
    deadline_ms: int
    local_group_block_ids: _containers.RepeatedScalarFieldContainer[int]
    local_group_block_counts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, engine_id: _Optional[str] = ..., tp_rank: _Optional[int] = ..., request_id: _Optional[str] = ..., local_block_ids: _Optional[_Iterable[int]] = ..., remote: _Optional[_Union[_common_pb2.KvTransferParams, _Mapping]] = ..., deadline_ms: _Optional[int] = ..., local_group_block_ids: _Optional[_Iterable[int]] = ..., local_group_block_counts: _Optional[_Iterable[int]] = ...) -> None: ...

class StartPullResponse(_message.Message):
    __slots__ = ("transfer_id",)
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    def __init__(self, transfer_id: _Optional[str] = ...) -> None: ...

class StartPullsRequest(_message.Message):
    __slots__ = ("pulls",)
    PULLS_FIELD_NUMBER: _ClassVar[int]
    pulls: _containers.RepeatedCompositeFieldContainer[StartPullRequest]
    def __init__(self, pulls: _Optional[_Iterable[_Union[StartPullRequest, _Mapping]]] = ...) -> None: ...

class StartPullResult(_message.Message):
    __slots__ = ("transfer_id", "error_code", "error_message", "error_class")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_CLASS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    error_code: str
    error_message: str
    error_class: str
    def __init__(self, transfer_id: _Optional[str] = ..., error_code: _Optional[str] = ..., error_message: _Optional[str] = ..., error_class: _Optional[str] = ...) -> None: ...

class StartPullsResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[StartPullResult]
    def __init__(self, results: _Optional[_Iterable[_Union[StartPullResult, _Mapping]]] = ...) -> None: ...

class GetTransferRequest(_message.Message):
    __slots__ = ("transfer_id",)
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    def __init__(self, transfer_id: _Optional[str] = ...) -> None: ...

class WatchTransfersRequest(_message.Message):
    __slots__ = ("transfer_ids", "unwatch_transfer_ids", "start_pulls")
    TRANSFER_IDS_FIELD_NUMBER: _ClassVar[int]
    UNWATCH_TRANSFER_IDS_FIELD_NUMBER: _ClassVar[int]
    START_PULLS_FIELD_NUMBER: _ClassVar[int]
    transfer_ids: _containers.RepeatedScalarFieldContainer[str]
    unwatch_transfer_ids: _containers.RepeatedScalarFieldContainer[str]
    start_pulls: _containers.RepeatedCompositeFieldContainer[WatchedPullStart]
    def __init__(self, transfer_ids: _Optional[_Iterable[str]] = ..., unwatch_transfer_ids: _Optional[_Iterable[str]] = ..., start_pulls: _Optional[_Iterable[_Union[WatchedPullStart, _Mapping]]] = ...) -> None: ...

class WatchedPullStart(_message.Message):
    __slots__ = ("seq", "pull")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    seq: int
    pull: StartPullRequest
    def __init__(self, seq: _Optional[int] = ..., pull: _Optional[_Union[StartPullRequest, _Mapping]] = ...) -> None: ...

class WatchedPullStarted(_message.Message):
    __slots__ = ("seq", "result")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    seq: int
    result: StartPullResult
    def __init__(self, seq: _Optional[int] = ..., result: _Optional[_Union[StartPullResult, _Mapping]] = ...) -> None: ...

class TransferWatchRefusal(_message.Message):
    __slots__ = ("transfer_id", "error_code", "error_message", "error_class")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_CLASS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    error_code: str
    error_message: str
    error_class: str
    def __init__(self, transfer_id: _Optional[str] = ..., error_code: _Optional[str] = ..., error_message: _Optional[str] = ..., error_class: _Optional[str] = ...) -> None: ...

class WatchTransfersResponse(_message.Message):
    __slots__ = ("incarnation", "finished", "refused", "takes_pulls", "started")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    TAKES_PULLS_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    incarnation: str
    finished: _containers.RepeatedCompositeFieldContainer[_common_pb2.TransferStatus]
    refused: _containers.RepeatedCompositeFieldContainer[TransferWatchRefusal]
    takes_pulls: bool
    started: _containers.RepeatedCompositeFieldContainer[WatchedPullStarted]
    def __init__(self, incarnation: _Optional[str] = ..., finished: _Optional[_Iterable[_Union[_common_pb2.TransferStatus, _Mapping]]] = ..., refused: _Optional[_Iterable[_Union[TransferWatchRefusal, _Mapping]]] = ..., takes_pulls: _Optional[bool] = ..., started: _Optional[_Iterable[_Union[WatchedPullStarted, _Mapping]]] = ...) -> None: ...

class CancelTransferRequest(_message.Message):
    __slots__ = ("transfer_id",)
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    def __init__(self, transfer_id: _Optional[str] = ...) -> None: ...

class LookupHeldRequest(_message.Message):
    __slots__ = ("engine_id", "request_id")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    request_id: str
    def __init__(self, engine_id: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class LookupHeldResponse(_message.Message):
    __slots__ = ("held",)
    HELD_FIELD_NUMBER: _ClassVar[int]
    held: _containers.RepeatedCompositeFieldContainer[_common_pb2.KvTransferParams]
    def __init__(self, held: _Optional[_Iterable[_Union[_common_pb2.KvTransferParams, _Mapping]]] = ...) -> None: ...

class RenewLeaseRequest(_message.Message):
    __slots__ = ("lease_id", "ttl_ms")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    ttl_ms: int
    def __init__(self, lease_id: _Optional[str] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineSummary(_message.Message):
    __slots__ = ("engine_id", "tp_rank", "tp_size", "registered_bytes", "stream_connected", "layout", "held_bytes", "soft_held_bytes", "draining_bytes")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_BYTES_FIELD_NUMBER: _ClassVar[int]
    STREAM_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    HELD_BYTES_FIELD_NUMBER: _ClassVar[int]
    SOFT_HELD_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAINING_BYTES_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    tp_rank: int
    tp_size: int
    registered_bytes: int
    stream_connected: bool
    layout: _common_pb2.KvLayoutSpec
    held_bytes: int
    soft_held_bytes: int
    draining_bytes: int
    def __init__(self, engine_id: _Optional[str] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., registered_bytes: _Optional[int] = ..., stream_connected: _Optional[bool] = ..., layout: _Optional[_Union[_common_pb2.KvLayoutSpec, _Mapping]] = ..., held_bytes: _Optional[int] = ..., soft_held_bytes: _Optional[int] = ..., draining_bytes: _Optional[int] = ...) -> None: ...

class PeerSummary(_message.Message):
    __slots__ = ("address", "incarnation", "agent_name", "last_contact_s_ago", "framed_stream")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    LAST_CONTACT_S_AGO_FIELD_NUMBER: _ClassVar[int]
    FRAMED_STREAM_FIELD_NUMBER: _ClassVar[int]
    address: str
    incarnation: str
    agent_name: str
    last_contact_s_ago: float
    framed_stream: bool
    def __init__(self, address: _Optional[str] = ..., incarnation: _Optional[str] = ..., agent_name: _Optional[str] = ..., last_contact_s_ago: _Optional[float] = ..., framed_stream: _Optional[bool] = ...) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("incarnation", "agent_name", "peer_address", "engines", "peers", "transfers_in_flight", "leases_held", "serving", "uptime_s", "leases_draining", "metrics_address", "admitted_reads", "quarantined_bytes", "remote_agents", "version", "holds_ended", "dataplane_pid", "dataplane_restarts", "dataplane_last_restart", "finishing_calls")
    class HoldsEndedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    LEASES_HELD_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    LEASES_DRAINING_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_READS_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_BYTES_FIELD_NUMBER: _ClassVar[int]
    REMOTE_AGENTS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HOLDS_ENDED_FIELD_NUMBER: _ClassVar[int]
    DATAPLANE_PID_FIELD_NUMBER: _ClassVar[int]
    DATAPLANE_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    DATAPLANE_LAST_RESTART_FIELD_NUMBER: _ClassVar[int]
    FINISHING_CALLS_FIELD_NUMBER: _ClassVar[int]
    incarnation: str
    agent_name: str
    peer_address: str
    engines: _containers.RepeatedCompositeFieldContainer[EngineSummary]
    peers: _containers.RepeatedCompositeFieldContainer[PeerSummary]
    transfers_in_flight: int
    leases_held: int
    serving: bool
    uptime_s: float
    leases_draining: int
    metrics_address: str
    admitted_reads: int
    quarantined_bytes: int
    remote_agents: int
    version: str
    holds_ended: _containers.ScalarMap[str, int]
    dataplane_pid: int
    dataplane_restarts: int
    dataplane_last_restart: str
    finishing_calls: int
    def __init__(self, incarnation: _Optional[str] = ..., agent_name: _Optional[str] = ..., peer_address: _Optional[str] = ..., engines: _Optional[_Iterable[_Union[EngineSummary, _Mapping]]] = ..., peers: _Optional[_Iterable[_Union[PeerSummary, _Mapping]]] = ..., transfers_in_flight: _Optional[int] = ..., leases_held: _Optional[int] = ..., serving: _Optional[bool] = ..., uptime_s: _Optional[float] = ..., leases_draining: _Optional[int] = ..., metrics_address: _Optional[str] = ..., admitted_reads: _Optional[int] = ..., quarantined_bytes: _Optional[int] = ..., remote_agents: _Optional[int] = ..., version: _Optional[str] = ..., holds_ended: _Optional[_Mapping[str, int]] = ..., dataplane_pid: _Optional[int] = ..., dataplane_restarts: _Optional[int] = ..., dataplane_last_restart: _Optional[str] = ..., finishing_calls: _Optional[int] = ...) -> None: ...
