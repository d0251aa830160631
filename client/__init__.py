"""kvd_client: the client library of the kvd daemon, for inference engines and request routers.

Light by design (grpcio and protobuf only; never torch or nixl): it runs inside other people's
processes, and it is the bottom layer of the repository (the daemon and the engine patch import
it, never the reverse). ``kvd_client.errors`` and ``kvd_client.v1.schema`` import no grpc; the
clients load on first use. ``KvdClient`` blocks, ``AsyncKvdClient`` is for asyncio; both raise the classes of
:mod:`kvd_client.errors`, never ``grpc.RpcError``. It configures no logging handlers.

    from kvd_client import KvdClient, errors, pb

    with KvdClient("unix:///run/kvd/engine.sock") as kvd:
        status = kvd.get_status()
"""

import importlib
from typing import TYPE_CHECKING, Any

from . import errors
from .errors import (
    ERROR_CLASS_METADATA_KEY,
    ERROR_OF_STATUS,
    RETRYABLE_STATUS,
    Aborted,
    AlreadyExists,
    Cancelled,
    DeadlineExceeded,
    ErrorCode,
    FailedPrecondition,
    HeldKvEvicted,
    IncompatibleLayout,
    Internal,
    InvalidArgument,
    KvdError,
    LeaseExpired,
    MemoryOpenError,
    NotFound,
    PeerUnavailable,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    UnknownEngine,
    UnknownLease,
    UnknownTransfer,
    error_class_named,
    from_status,
)
from .version import __version__

if TYPE_CHECKING:
    from . import pb
    from ._aio_engine_stream import AsyncEngineStream
    from ._base import DEFAULT_TIMEOUT_S, load_error, pull_results
    from ._engine_stream import EngineStream
    from ._scheduler_stream import SchedulerStream
    from .aio import AsyncKvdClient
    from .channel import MAX_MESSAGE_BYTES, TlsConfig, create_aio_channel, create_channel
    from .sync import KvdClient

# Loaded on first use (PEP 562): ``import kvd_client.errors`` (what the daemon's core and the
# engine patch import) must not load grpc, grpc.aio or the generated stubs.
_LAZY: dict[str, tuple[str, str | None]] = {
    "AsyncEngineStream": ("._aio_engine_stream", "AsyncEngineStream"),
    "AsyncKvdClient": (".aio", "AsyncKvdClient"),
    "DEFAULT_TIMEOUT_S": ("._base", "DEFAULT_TIMEOUT_S"),
    "EngineStream": ("._engine_stream", "EngineStream"),
    "KvdClient": (".sync", "KvdClient"),
    "SchedulerStream": ("._scheduler_stream", "SchedulerStream"),
    "load_error": ("._base", "load_error"),
    "pull_results": ("._base", "pull_results"),
    "MAX_MESSAGE_BYTES": (".channel", "MAX_MESSAGE_BYTES"),
    "TlsConfig": (".channel", "TlsConfig"),
    "create_aio_channel": (".channel", "create_aio_channel"),
    "create_channel": (".channel", "create_channel"),
    "pb": (".pb", None),
}


def __getattr__(name: str) -> Any:
    try:
        module_name, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    module = importlib.import_module(module_name, __name__)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "__version__",
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
    "ErrorCode",
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
    "PermissionDenied",
    "ResourceExhausted",
    "SchedulerStream",
    "TlsConfig",
    "Unauthenticated",
    "Unavailable",
    "UnknownEngine",
    "UnknownLease",
    "UnknownTransfer",
    "HeldKvEvicted",
    "create_aio_channel",
    "create_channel",
    "error_class_named",
    "errors",
    "from_status",
    "load_error",
    "pb",
    "pull_results",
]
