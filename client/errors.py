"""One exception hierarchy for kvd, shared by the daemon, the client and the engine patch.

The daemon raises these in its core; the server edge maps each class to a gRPC status code
(:data:`STATUS_OF`); the client maps codes back to the same classes (:func:`from_status`). So a
caller catches ``LeaseExpired`` whether it talks to the core in-process or to a daemon over gRPC.
This module imports grpc only for the status-code enum (no torch, no nixl).
"""

from __future__ import annotations

import grpc


class KvdError(Exception):
    """Base of every kvd error. ``code`` is the gRPC status it travels as."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(KvdError):
    """The request itself is malformed: lengths disagree, ids out of range, missing fields."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(KvdError):
    """An engine, lease, transfer or peer engine the request names does not exist."""

    code = grpc.StatusCode.NOT_FOUND


class UnknownEngine(NotFound):
    """No engine rank with that id is registered."""


class UnknownLease(NotFound):
    """No lease with that id is held (never was, or already released)."""


class UnknownTransfer(NotFound):
    """No transfer with that id is known."""


class AlreadyExists(KvdError):
    """The thing the request would create exists already (e.g. a second registration of a rank)."""

    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(KvdError):
    """The request is well formed but the system is not in a state that allows it."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class IncompatibleLayout(FailedPrecondition):
    """The two engines' KV layouts cannot be converted into each other."""


class MemoryOpenError(FailedPrecondition):
    """The engine's memory (shm file, CUDA IPC handle) could not be opened by the daemon."""


class DeadlineExceeded(KvdError):
    """A transfer or lease outlived its deadline."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class LeaseExpired(DeadlineExceeded):
    """The lease expired before the read: the holder may have reused the blocks."""


class Unavailable(KvdError):
    """A daemon or peer cannot be reached (down, restarting, disconnected). Retryable."""

    code = grpc.StatusCode.UNAVAILABLE


class PeerUnavailable(Unavailable):
    """A peer daemon died or disconnected; the message names it."""


class Aborted(KvdError):
    """The operation was cut short (cancelled, shutdown, engine gone)."""

    code = grpc.StatusCode.ABORTED


class ResourceExhausted(KvdError):
    """A bounded resource (staging memory, descriptors) is used up; retry later."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Cancelled(KvdError):
    """The caller cancelled the call."""

    code = grpc.StatusCode.CANCELLED


class Internal(KvdError):
    """A bug or an unexpected failure inside the daemon."""

    code = grpc.StatusCode.INTERNAL


# Status code -> the class a client raises for it (the most general class for each code).
ERROR_OF_STATUS: dict[grpc.StatusCode, type[KvdError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.ABORTED: Aborted,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.INTERNAL: Internal,
}

# Codes that mean "this endpoint is failing right now": safe to retry (idempotent calls) or fail over.
RETRYABLE_STATUS: frozenset[grpc.StatusCode] = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}
)

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


def from_status(code: grpc.StatusCode, details: str, class_name: str = "") -> KvdError:
    """Rebuild the exception a daemon raised from its status code, details and class name."""
    cls = error_class_named(class_name)
    if cls is None or cls.code != code:
        cls = ERROR_OF_STATUS.get(code, KvdError)
    err = cls(details or code.name)
    if cls is KvdError:
        err.code = code
    return err
