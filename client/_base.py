"""What the sync and asyncio clients share: request building, deadlines, transfer outcomes.

Kept free of any I/O so that both front ends behave identically and the rules are tested once.
"""

from __future__ import annotations

import math
import time
from typing import Any, TypeVar

from google.protobuf.message import Message

from kvd_client.v1 import common_pb2, engine_pb2, router_pb2

from . import errors
from .errors import ErrorCode

M = TypeVar("M", bound=Message)

DEFAULT_TIMEOUT_S = 10.0
"""Per-call deadline when neither the call nor the client names one: long enough for a
registration (the daemon maps and registers memory), short enough that a hung daemon is noticed."""

TERMINAL_STATES: frozenset[int] = frozenset(
    {
        common_pb2.TRANSFER_STATE_DONE,
        common_pb2.TRANSFER_STATE_FAILED,
        common_pb2.TRANSFER_STATE_ABORTED,
    }
)

UNREACHABLE_STATUS: frozenset[ErrorCode] = frozenset({ErrorCode.UNAVAILABLE, ErrorCode.DEADLINE_EXCEEDED})
"""Codes for which a health check answers False (the daemon is not healthy) rather than raising."""


def build_request(cls: type[M], request: M | None, **fields: Any) -> M:
    """The request message: ``request`` as given, or one built from the fields that are not None.

    Fields left at None take the proto default, so callers name only what they mean. Passing both
    a prebuilt request and fields is ambiguous (which wins?) and is refused.
    """
    given = {name: value for name, value in fields.items() if value is not None}
    if request is None:
        return cls(**given)
    if not isinstance(request, cls):
        raise TypeError(f"request= must be a {cls.__name__}, not {type(request).__name__}")
    if given:
        raise TypeError(f"pass either request= or {', '.join(sorted(given))}, not both")
    return request


def grpc_timeout(timeout_s: float | None, default_s: float | None) -> float | None:
    """The grpc ``timeout=`` of a call: None picks the client's default, ``math.inf`` means none."""
    value = default_s if timeout_s is None else timeout_s
    if value is None or math.isinf(value):
        return None
    if value <= 0:
        raise ValueError(f"timeout_s must be positive, got {value}")
    return value


def deadline_after(timeout: float | None) -> float | None:
    """A monotonic deadline ``timeout`` seconds from now (None: no deadline)."""
    return None if timeout is None else time.monotonic() + timeout


def time_left(deadline: float | None) -> float:
    """Seconds until ``deadline`` (``math.inf`` without one); at least a millisecond, so that a
    last call still fails DEADLINE_EXCEEDED rather than with a local ValueError."""
    if deadline is None:
        return math.inf
    return max(deadline - time.monotonic(), 1e-3)


def is_terminal(status: common_pb2.TransferStatus) -> bool:
    """Whether the transfer has ended (done, failed or aborted)."""
    return status.state in TERMINAL_STATES


def transfer_error(status: common_pb2.TransferStatus) -> errors.KvdError | None:
    """The error a FAILED or ABORTED transfer stands for; None for any other state.

    The daemon reports the error code *name* (e.g. ``"UNAVAILABLE"``) in ``error_code`` and the
    exact class (e.g. ``"PeerUnavailable"``) in ``error_class``: the caller gets that class. An
    unknown or missing name falls back to ABORTED / INTERNAL so that a caller still gets a class.
    """
    if status.state == common_pb2.TRANSFER_STATE_ABORTED:
        fallback = ErrorCode.ABORTED
    elif status.state == common_pb2.TRANSFER_STATE_FAILED:
        fallback = ErrorCode.INTERNAL
    else:
        return None
    code = ErrorCode.__members__.get(status.error_code, fallback)
    message = status.error_message or (f"transfer {status.transfer_id} {common_pb2.TransferState.Name(status.state)}")
    return errors.from_status(code, message, status.error_class)


def load_error(message: engine_pb2.LoadFailed) -> errors.KvdError:
    """The error a LoadFailed (on the engine stream) stands for: its exact class when the daemon
    named one (``error_class``), else the general class of ``error_code``."""
    code = ErrorCode.__members__.get(message.error_code, ErrorCode.INTERNAL)
    text = message.error_message or f"loading {message.request_id} failed ({message.error_code or 'no code'})"
    return errors.from_status(code, text, message.error_class)


def pull_results(
    response: router_pb2.StartPullsResponse | engine_pb2.PullsStarted, expected: int
) -> list[str | errors.KvdError]:
    """Each StartPulls result (or each of an engine stream's ``pulls_started``) as its transfer id
    or the exact error of that pull (the class the daemon named in ``error_class``, else the
    general class of ``error_code``).

    A daemon answers one result per pull; any other count is a broken daemon, and no result can
    then be trusted to be the one of its pull (the caller gets Internal for the call).
    """
    if len(response.results) != expected:
        raise errors.Internal(f"StartPulls answered {len(response.results)} results for {expected} pulls")
    out: list[str | errors.KvdError] = []
    for result in response.results:
        if result.error_code:
            code = ErrorCode.__members__.get(result.error_code, ErrorCode.UNKNOWN)
            out.append(errors.from_status(code, result.error_message, result.error_class))
        else:
            out.append(result.transfer_id)
    return out


def final_status(status: common_pb2.TransferStatus) -> common_pb2.TransferStatus:
    """``status`` if the transfer is DONE; the mapped error raised if it failed or was aborted."""
    err = transfer_error(status)
    if err is not None:
        raise err
    return status


def watch_ended_early(transfer_id: str) -> errors.KvdError:
    """The error for a watch that ended before the transfer did (the daemon went away)."""
    return errors.Unavailable(f"watch of transfer {transfer_id} ended before the transfer did")
