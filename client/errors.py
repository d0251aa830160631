"""One exception hierarchy for kvd, shared by the daemon, the client and the engine patch.

The daemon raises these in its core; each class carries a kvd-owned :class:`ErrorCode` (the
canonical RPC code names, so a code's name is the same on every transport). The edges map codes
to gRPC status codes and back (:mod:`kvd_client.grpc_status`: the server, the peer client and
the client), so a caller catches ``LeaseExpired`` whether it talks to the core in-process or to
a daemon over gRPC. This module imports only the standard library: no grpc, no protobuf.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.Enum):
    """The canonical RPC status codes (google.rpc.Code): names and numbers as gRPC has them."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class KvdError(Exception):
    """Base of every kvd error. ``code`` is the status it travels as."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(KvdError):
    """The request itself is malformed: lengths disagree, ids out of range, missing fields."""

    code = ErrorCode.INVALID_ARGUMENT


class NotFound(KvdError):
    """An engine, lease, transfer or peer engine the request names does not exist."""

    code = ErrorCode.NOT_FOUND


class UnknownEngine(NotFound):
    """No engine rank with that id is registered."""


class UnknownLease(NotFound):
    """No lease with that id is held (never was, or already released)."""


class UnknownTransfer(NotFound):
    """No transfer with that id is known."""


class HeldKvEvicted(NotFound):
    """A soft hold's blocks no longer hold its request's KV (the engine evicted or reused them):
    recompute. Raised before a read (nothing was read) or after it (the pull fails, never DONE)."""


class AlreadyExists(KvdError):
    """The thing the request would create exists already (e.g. a second registration of a rank)."""

    code = ErrorCode.ALREADY_EXISTS


class FailedPrecondition(KvdError):
    """The request is well formed but the system is not in a state that allows it."""

    code = ErrorCode.FAILED_PRECONDITION


class IncompatibleLayout(FailedPrecondition):
    """The two engines' KV layouts cannot be converted into each other."""


class UnsupportedModelFeature(IncompatibleLayout):
    """A model feature kvd cannot serve (a KV cache group kind, a TP pair for a group kind):
    refused at registration or at hold/pull, naming the feature, never silently skipped."""


class MemoryOpenError(FailedPrecondition):
    """The engine's memory (shm file, CUDA IPC handle) could not be opened by the daemon."""


class StaleRegistration(FailedPrecondition):
    """A read planned against a holder engine's registration that has since been replaced (the
    engine registered again): the holder admitted nothing; handshake again and retry."""


class DeadlineExceeded(KvdError):
    """A transfer or lease outlived its deadline."""

    code = ErrorCode.DEADLINE_EXCEEDED


class LeaseExpired(DeadlineExceeded):
    """The lease expired before the read: the holder may have reused the blocks."""


class Unavailable(KvdError):
    """A daemon or peer cannot be reached (down, restarting, disconnected). Retryable."""

    code = ErrorCode.UNAVAILABLE


class PeerUnavailable(Unavailable):
    """A peer daemon died or disconnected; the message names it."""


class Aborted(KvdError):
    """The operation was cut short (cancelled, shutdown, engine gone)."""

    code = ErrorCode.ABORTED


class ResourceExhausted(KvdError):
    """A bounded resource (staging memory, descriptors) is used up; retry later."""

    code = ErrorCode.RESOURCE_EXHAUSTED


class Cancelled(KvdError):
    """The caller cancelled the call."""

    code = ErrorCode.CANCELLED


class PermissionDenied(KvdError):
    """The caller is known but its roles do not include the one the RPC needs (the message names it)."""

    code = ErrorCode.PERMISSION_DENIED


class Unauthenticated(KvdError):
    """The caller presented no identity the daemon accepts (no client certificate, no trusted uid,
    no valid bearer token); the message names the role the RPC needs."""

    code = ErrorCode.UNAUTHENTICATED


class Internal(KvdError):
    """A bug or an unexpected failure inside the daemon."""

    code = ErrorCode.INTERNAL


# Code -> the class a client raises for it (the most general class for each code).
ERROR_OF_STATUS: dict[ErrorCode, type[KvdError]] = {
    ErrorCode.INVALID_ARGUMENT: InvalidArgument,
    ErrorCode.NOT_FOUND: NotFound,
    ErrorCode.ALREADY_EXISTS: AlreadyExists,
    ErrorCode.FAILED_PRECONDITION: FailedPrecondition,
    ErrorCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    ErrorCode.UNAVAILABLE: Unavailable,
    ErrorCode.ABORTED: Aborted,
    ErrorCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    ErrorCode.CANCELLED: Cancelled,
    ErrorCode.INTERNAL: Internal,
    ErrorCode.PERMISSION_DENIED: PermissionDenied,
    ErrorCode.UNAUTHENTICATED: Unauthenticated,
}

# Codes that mean "this endpoint is failing right now": safe to retry (idempotent calls) or fail over.
RETRYABLE_STATUS: frozenset[ErrorCode] = frozenset({ErrorCode.UNAVAILABLE, ErrorCode.RESOURCE_EXHAUSTED})

# The most specific class may travel in trailing metadata so that the client can rebuild it.
ERROR_CLASS_METADATA_KEY = "kvd-error-class"

_CLASSES_BY_NAME: dict[str, type[KvdError]] = {}


def _collect(cls: type[KvdError]) -> None:
    _CLASSES_BY_NAME[cls.__name__] = cls
    for sub in cls.__subclasses__():
        _collect(sub)


_collect(KvdError)


def error_class_named(name: str) -> type[KvdError] | None:
    """The KvdError subclass called ``name``, or None (names travel in trailing metadata)."""
    return _CLASSES_BY_NAME.get(name)


def from_status(code: ErrorCode, details: str, class_name: str = "") -> KvdError:
    """Rebuild the exception a daemon raised from its status code, details and class name."""
    cls = error_class_named(class_name)
    if cls is None or cls.code != code:
        cls = ERROR_OF_STATUS.get(code, KvdError)
    err = cls(details or code.name)
    if cls is KvdError:
        err.code = code
    return err
