from kvd_client.v1 import common_pb2 as _common_pb2
from kvd_client.v1 import router_pb2 as _router_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HoldCheckAction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HOLD_CHECK_ACTION_UNSPECIFIED: _ClassVar[HoldCheckAction]
    HOLD_CHECK_ACTION_PIN: _ClassVar[HoldCheckAction]
    HOLD_CHECK_ACTION_VERIFY_UNPIN: _ClassVar[HoldCheckAction]
    HOLD_CHECK_ACTION_UNPIN: _ClassVar[HoldCheckAction]
HOLD_CHECK_ACTION_UNSPECIFIED: HoldCheckAction
HOLD_CHECK_ACTION_PIN: HoldCheckAction
HOLD_CHECK_ACTION_VERIFY_UNPIN: HoldCheckAction
HOLD_CHECK_ACTION_UNPIN: HoldCheckAction

class RegisterKvCacheRequest(_message.Message):
    __slots__ = ("engine_id", "layout", "regions", "layers", "require_commits", "engine_pid", "groups")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    REQUIRE_COMMITS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_PID_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    layout: _common_pb2.KvLayoutSpec
    regions: _containers.RepeatedCompositeFieldContainer[_common_pb2.MemoryRegion]
    layers: _containers.RepeatedCompositeFieldContainer[_common_pb2.LayerPlacement]
    require_commits: bool
    engine_pid: int
    groups: _containers.RepeatedCompositeFieldContainer[_common_pb2.KvCacheGroup]
    def __init__(self, engine_id: _Optional[str] = ..., layout: _Optional[_Union[_common_pb2.KvLayoutSpec, _Mapping]] = ..., regions: _Optional[_Iterable[_Union[_common_pb2.MemoryRegion, _Mapping]]] = ..., layers: _Optional[_Iterable[_Union[_common_pb2.LayerPlacement, _Mapping]]] = ..., require_commits: _Optional[bool] = ..., engine_pid: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[_common_pb2.KvCacheGroup, _Mapping]]] = ...) -> None: ...

class RegisterKvCacheResponse(_message.Message):
    __slots__ = ("daemon_incarnation", "agent_name", "registration_id")
    DAEMON_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_ID_FIELD_NUMBER: _ClassVar[int]
    daemon_incarnation: str
    agent_name: str
    registration_id: int
    def __init__(self, daemon_incarnation: _Optional[str] = ..., agent_name: _Optional[str] = ..., registration_id: _Optional[int] = ...) -> None: ...

class UnregisterKvCacheRequest(_message.Message):
    __slots__ = ("engine_id", "tp_rank")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    tp_rank: int
    def __init__(self, engine_id: _Optional[str] = ..., tp_rank: _Optional[int] = ...) -> None: ...

class UnregisterKvCacheResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Commit(_message.Message):
    __slots__ = ("request_id", "committed_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    committed_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., committed_tokens: _Optional[int] = ...) -> None: ...

class PostForward(_message.Message):
    __slots__ = ("step", "finished_request_ids")
    STEP_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    step: int
    finished_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step: _Optional[int] = ..., finished_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class EngineHello(_message.Message):
    __slots__ = ("engine_id", "tp_rank", "accepts_batches", "starts_pulls", "user_agent")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_BATCHES_FIELD_NUMBER: _ClassVar[int]
    STARTS_PULLS_FIELD_NUMBER: _ClassVar[int]
    USER_AGENT_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    tp_rank: int
    accepts_batches: bool
    starts_pulls: bool
    user_agent: str
    def __init__(self, engine_id: _Optional[str] = ..., tp_rank: _Optional[int] = ..., accepts_batches: _Optional[bool] = ..., starts_pulls: _Optional[bool] = ..., user_agent: _Optional[str] = ...) -> None: ...

class StartPullsOnStream(_message.Message):
    __slots__ = ("seq", "pulls")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    PULLS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    pulls: _containers.RepeatedCompositeFieldContainer[_router_pb2.StartPullRequest]
    def __init__(self, seq: _Optional[int] = ..., pulls: _Optional[_Iterable[_Union[_router_pb2.StartPullRequest, _Mapping]]] = ...) -> None: ...

class EngineMessage(_message.Message):
    __slots__ = ("hello", "commit", "post_forward", "start_pulls")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    POST_FORWARD_FIELD_NUMBER: _ClassVar[int]
    START_PULLS_FIELD_NUMBER: _ClassVar[int]
    hello: EngineHello
    commit: Commit
    post_forward: PostForward
    start_pulls: StartPullsOnStream
    def __init__(self, hello: _Optional[_Union[EngineHello, _Mapping]] = ..., commit: _Optional[_Union[Commit, _Mapping]] = ..., post_forward: _Optional[_Union[PostForward, _Mapping]] = ..., start_pulls: _Optional[_Union[StartPullsOnStream, _Mapping]] = ...) -> None: ...

class FinishedSending(_message.Message):
    __slots__ = ("request_id", "lease_id", "expired")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    lease_id: str
    expired: bool
    def __init__(self, request_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., expired: _Optional[bool] = ...) -> None: ...

class FinishedRecving(_message.Message):
    __slots__ = ("request_id", "transfer_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_id: str
    def __init__(self, request_id: _Optional[str] = ..., transfer_id: _Optional[str] = ...) -> None: ...

class LoadFailed(_message.Message):
    __slots__ = ("request_id", "transfer_id", "error_code", "error_message", "block_ids", "error_class")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_CLASS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_id: str
    error_code: str
    error_message: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    error_class: str
    def __init__(self, request_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., error_code: _Optional[str] = ..., error_message: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., error_class: _Optional[str] = ...) -> None: ...

class DaemonMessage(_message.Message):
    __slots__ = ("finished_sending", "finished_recving", "load_failed", "batch", "ready", "pulls_started")
    FINISHED_SENDING_FIELD_NUMBER: _ClassVar[int]
    FINISHED_RECVING_FIELD_NUMBER: _ClassVar[int]
    LOAD_FAILED_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    PULLS_STARTED_FIELD_NUMBER: _ClassVar[int]
    finished_sending: FinishedSending
    finished_recving: FinishedRecving
    load_failed: LoadFailed
    batch: DaemonMessageBatch
    ready: StreamReady
    pulls_started: PullsStarted
    def __init__(self, finished_sending: _Optional[_Union[FinishedSending, _Mapping]] = ..., finished_recving: _Optional[_Union[FinishedRecving, _Mapping]] = ..., load_failed: _Optional[_Union[LoadFailed, _Mapping]] = ..., batch: _Optional[_Union[DaemonMessageBatch, _Mapping]] = ..., ready: _Optional[_Union[StreamReady, _Mapping]] = ..., pulls_started: _Optional[_Union[PullsStarted, _Mapping]] = ...) -> None: ...

class StreamReady(_message.Message):
    __slots__ = ("takes_pulls",)
    TAKES_PULLS_FIELD_NUMBER: _ClassVar[int]
    takes_pulls: bool
    def __init__(self, takes_pulls: _Optional[bool] = ...) -> None: ...

class PullsStarted(_message.Message):
    __slots__ = ("seq", "results")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    results: _containers.RepeatedCompositeFieldContainer[_router_pb2.StartPullResult]
    def __init__(self, seq: _Optional[int] = ..., results: _Optional[_Iterable[_Union[_router_pb2.StartPullResult, _Mapping]]] = ...) -> None: ...

class DaemonMessageBatch(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[DaemonMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[DaemonMessage, _Mapping]]] = ...) -> None: ...

class DaemonFrame(_message.Message):
    __slots__ = ("message", "end")
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    message: DaemonMessage
    end: _common_pb2.StreamEnd
    def __init__(self, message: _Optional[_Union[DaemonMessage, _Mapping]] = ..., end: _Optional[_Union[_common_pb2.StreamEnd, _Mapping]] = ...) -> None: ...

class HoldBlocksRequest(_message.Message):
    __slots__ = ("engine_id", "request_id", "block_ids", "num_tokens", "ttl_ms", "group_block_ids", "group_block_counts", "soft")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    GROUP_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    GROUP_BLOCK_COUNTS_FIELD_NUMBER: _ClassVar[int]
    SOFT_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    request_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    ttl_ms: int
    group_block_ids: _containers.RepeatedScalarFieldContainer[int]
    group_block_counts: _containers.RepeatedScalarFieldContainer[int]
    soft: bool
    def __init__(self, engine_id: _Optional[str] = ..., request_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., ttl_ms: _Optional[int] = ..., group_block_ids: _Optional[_Iterable[int]] = ..., group_block_counts: _Optional[_Iterable[int]] = ..., soft: _Optional[bool] = ...) -> None: ...

class HoldBlocksResponse(_message.Message):
    __slots__ = ("lease", "kv_transfer_params")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    lease: _common_pb2.LeaseInfo
    kv_transfer_params: _common_pb2.KvTransferParams
    def __init__(self, lease: _Optional[_Union[_common_pb2.LeaseInfo, _Mapping]] = ..., kv_transfer_params: _Optional[_Union[_common_pb2.KvTransferParams, _Mapping]] = ...) -> None: ...

class SchedulerHello(_message.Message):
    __slots__ = ("engine_id",)
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    def __init__(self, engine_id: _Optional[str] = ...) -> None: ...

class HoldCheck(_message.Message):
    __slots__ = ("seq", "request_id", "lease_id", "pin_id", "action")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PIN_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    seq: int
    request_id: str
    lease_id: str
    pin_id: str
    action: HoldCheckAction
    def __init__(self, seq: _Optional[int] = ..., request_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., pin_id: _Optional[str] = ..., action: _Optional[_Union[HoldCheckAction, str]] = ...) -> None: ...

class HoldEnded(_message.Message):
    __slots__ = ("request_id", "lease_id", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    lease_id: str
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class SchedulerCommand(_message.Message):
    __slots__ = ("check", "hold_ended")
    CHECK_FIELD_NUMBER: _ClassVar[int]
    HOLD_ENDED_FIELD_NUMBER: _ClassVar[int]
    check: HoldCheck
    hold_ended: HoldEnded
    def __init__(self, check: _Optional[_Union[HoldCheck, _Mapping]] = ..., hold_ended: _Optional[_Union[HoldEnded, _Mapping]] = ...) -> None: ...

class HoldCheckResult(_message.Message):
    __slots__ = ("seq", "ok", "reason")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    seq: int
    ok: bool
    reason: str
    def __init__(self, seq: _Optional[int] = ..., ok: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class RemoteLease(_message.Message):
    __slots__ = ("daemon_address", "lease_id")
    DAEMON_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    daemon_address: str
    lease_id: str
    def __init__(self, daemon_address: _Optional[str] = ..., lease_id: _Optional[str] = ...) -> None: ...

class RenewRemoteLeases(_message.Message):
    __slots__ = ("leases",)
    LEASES_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedCompositeFieldContainer[RemoteLease]
    def __init__(self, leases: _Optional[_Iterable[_Union[RemoteLease, _Mapping]]] = ...) -> None: ...

class ReleaseRemoteLeases(_message.Message):
    __slots__ = ("leases", "reason")
    LEASES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedCompositeFieldContainer[RemoteLease]
    reason: str
    def __init__(self, leases: _Optional[_Iterable[_Union[RemoteLease, _Mapping]]] = ..., reason: _Optional[str] = ...) -> None: ...

class SchedulerMessage(_message.Message):
    __slots__ = ("hello", "check_result", "renew", "release")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    CHECK_RESULT_FIELD_NUMBER: _ClassVar[int]
    RENEW_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    hello: SchedulerHello
    check_result: HoldCheckResult
    renew: RenewRemoteLeases
    release: ReleaseRemoteLeases
    def __init__(self, hello: _Optional[_Union[SchedulerHello, _Mapping]] = ..., check_result: _Optional[_Union[HoldCheckResult, _Mapping]] = ..., renew: _Optional[_Union[RenewRemoteLeases, _Mapping]] = ..., release: _Optional[_Union[ReleaseRemoteLeases, _Mapping]] = ...) -> None: ...
