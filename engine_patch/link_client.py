"""The daemon as both links see it: how a link gets its client, and what a failure says.

:class:`~kvd_engine.worker_link.DaemonLink` and :class:`~kvd_engine.scheduler_link.SchedulerLink`
make their :class:`~kvd_client.KvdClient` through a :data:`ClientFactory` (tests pass a fake
daemon's); :func:`default_client` is looked up when a link is made, so a test may replace it
here. The predicates below read a :mod:`kvd_client.errors` error: did the daemon refuse, or is
its answer lost (it may have acted), or is it gone; :func:`ask_until_answered` asks a pull start
again while its answer is lost.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from kvd_client import errors

if TYPE_CHECKING:
    from kvd_client import KvdClient

logger = logging.getLogger(__name__)
T = TypeVar("T")

ClientFactory = Callable[[str, float], "KvdClient"]
"""(target, rpc timeout in seconds) -> a client of the daemon at ``target``."""


def default_client(target: str, timeout_s: float) -> KvdClient:
    from kvd_client import KvdClient  # noqa: PLC0415 - grpc loads with the first link, not the import

    return KvdClient(target, timeout_s=timeout_s)


# Codes after which the daemon may have acted on a call although it answered nothing usable.
_IN_DOUBT_CODES = frozenset(
    {
        errors.ErrorCode.DEADLINE_EXCEEDED,
        errors.ErrorCode.UNAVAILABLE,
        errors.ErrorCode.CANCELLED,
        errors.ErrorCode.UNKNOWN,
        errors.ErrorCode.INTERNAL,
    }
)


def answer_lost(err: errors.KvdError) -> bool:
    """Whether ``err`` leaves it unknown what the daemon did (rather than being its refusal)."""
    if isinstance(err, (errors.LeaseExpired, errors.PeerUnavailable)):
        return False  # the daemon's own verdict on the pull, not a lost answer
    return err.code in _IN_DOUBT_CODES


def socket_gone(target: str) -> bool:
    """Whether nothing listens on ``target``'s Unix socket (False for any other target).

    The daemon removes its socket only after its shutdown released everything, and a dead
    process's listening socket refuses connections: either way no pull of it can still write.
    """
    if not target.startswith("unix:"):
        return False
    path = target[len("unix:") :]
    if path.startswith("//"):
        path = path[2:]
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(0.5)
        probe.connect(path)
    except OSError as err:
        return err.errno in (errno.ENOENT, errno.ECONNREFUSED)
    finally:
        probe.close()
    return False


def daemon_gone(err: errors.KvdError) -> bool:
    """Whether ``err`` says this link's daemon is unreachable (a peer's being down is not)."""
    return isinstance(err, errors.Unavailable) and not isinstance(err, errors.PeerUnavailable)


START_ATTEMPTS = 3
"""How many times one StartPulls (StartPull) is asked when no answer comes back. Asking again is
safe (the daemon answers the same transfer id for the same order) and learns the transfer ids
the engine needs to cancel what the daemon started."""


class NoAnswer(Exception):
    """Every attempt of a call ended without the daemon's answer (it may have acted)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def ask_until_answered(call: Callable[[], T], stop: threading.Event, backoff0_s: float) -> T:
    """``call`` (a StartPulls or StartPull, idempotent) until the daemon answers.

    Returns the answer; raises the daemon's KvdError when it refused (nothing started), or
    :class:`NoAnswer` when :data:`START_ATTEMPTS` calls all ended without one (a deadline, a
    dropped connection, an internal error: the daemon may have started the pulls), or ``stop``
    was set while it waited to ask again.
    """
    reason = ""
    for attempt in range(START_ATTEMPTS):
        if attempt:
            logger.info("kvd link: no answer to a pull start (%s); asking again", reason)
            if stop.wait(backoff0_s * attempt):
                break
        try:
            return call()
        except errors.KvdError as err:
            if not answer_lost(err):
                raise
            reason = f"{type(err).__name__}: {err.message}"
        except Exception as exc:  # never let the link thread die; the call may have gone out
            logger.exception("kvd link: a pull start failed")
            reason = repr(exc)
    raise NoAnswer(reason)
