"""kvd_client: the client library of the kvd daemon, for inference engines and request routers.

Light by design (grpcio and protobuf only; never torch or nixl): it runs inside other people's
processes. ``KvdClient`` blocks, ``AsyncKvdClient`` is for asyncio; both raise the classes of
:mod:`kvd_client.errors`, never ``grpc.RpcError``. It configures no logging handlers.

    from kvd_client import KvdClient, errors, pb

    with KvdClient("unix:///run/kvd/engine.sock") as kvd:
        status = kvd.get_status()
"""

from . import errors, pb
from ._aio_engine_stream import AsyncEngineStream
from ._base import DEFAULT_TIMEOUT_S
from ._channel import MAX_MESSAGE_BYTES, TlsConfig, create_aio_channel, create_channel
from ._engine_stream import EngineStream
from .aio import AsyncKvdClient
from .errors import (
    ERROR_CLASS_METADATA_KEY,
    ERROR_OF_STATUS,
    RETRYABLE_STATUS,
    Aborted,
    AlreadyExists,
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    IncompatibleLayout,
    Internal,
    InvalidArgument,
    KvdError,
    LeaseExpired,
    MemoryOpenError,
    NotFound,
    PeerUnavailable,
    ResourceExhausted,
    Unavailable,
    UnknownEngine,
    UnknownLease,
    UnknownTransfer,
    error_class_named,
    from_status,
)
from .sync import KvdClient

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "ERROR_CLASS_METADATA_KEY",
    "ERROR_OF_STATUS",
    "MAX_MESSAGE_BYTES",
    "RETRYABLE_STATUS",
    "Aborted",
    "AlreadyExists",
    "AsyncEngineStream",
    "AsyncKvdClient",
    "Cancelled",
    "DeadlineExceeded",
    "EngineStream",
    "FailedPrecondition",
    "IncompatibleLayout",
    "Internal",
    "InvalidArgument",
    "KvdClient",
    "KvdError",
    "LeaseExpired",
    "MemoryOpenError",
    "NotFound",
    "PeerUnavailable",
    "ResourceExhausted",
    "TlsConfig",
    "Unavailable",
    "UnknownEngine",
    "UnknownLease",
    "UnknownTransfer",
    "create_aio_channel",
    "create_channel",
    "error_class_named",
    "errors",
    "from_status",
    "pb",
]
