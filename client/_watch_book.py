"""What a client's transfer waits share on its one ``WatchTransfers`` stream (both front ends).

A router waits on every pull it starts. With one ``WatchTransfer`` stream per pull each wait cost
an RPC opened, served and torn down; instead every ``wait_transfer`` / ``wait_transfers`` of a
client rides one bidirectional stream (:class:`kvd_client._aio_transfer_watch.AsyncTransferWatch`
on asyncio, :class:`kvd_client._transfer_watch.TransferWatch` on a thread): the client sends each
transfer id once, however many callers wait on it, and the daemon answers each once.

This module is the part both front ends share, with no I/O, so that the rules are tested once
(the twins are not generated from one source: see tools/gen_sync.py):

* :class:`WatchBook`: who waits on which id, what a response settles (each waiter gets the exact
  class the daemon named, ``kvd_client.errors``), and what a stream's end does to the waiters;
* :func:`request_messages`: the ids to watch and unwatch queued meanwhile, as few messages as
  the daemon's per-message bound allows (an id's last order wins, so a wait given up and taken
  up again before the message went out leaves it watched);
* :func:`outcomes` (what ``wait_transfers`` returns per id) and :func:`stream_failure` (what a
  stream's failure means for its waiters), which the twins would otherwise each spell out.

The stream's life (:meth:`WatchBook.stream_ended`): a stream that had been answered (the daemon's
first message, its incarnation, arrived) and breaks is re-opened at once, every id still waited
on sent again (an id that ended meanwhile is answered at once with its outcome: the daemon keeps
it); a stream that fails before its first message fails every waiter with that error (the daemon
is unreachable or shutting down: ``Unavailable``), so nothing retries in a loop. A re-opened
stream that reaches another incarnation of the daemon (it restarted, and knows none of the
transfers) fails the waiters of the earlier ids with ``Unavailable`` instead of a misleading
``UnknownTransfer``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from typing import Protocol

import grpc

from kvd_client.v1 import common_pb2, router_pb2

from . import _base, errors
from .errors import ErrorCode
from .grpc_errors import to_kvd_error

logger = logging.getLogger(__name__)

MAX_IDS_PER_MESSAGE = 4096
"""The daemon's bound on the ids one WatchTransfersRequest names (kvd.core.watches)."""

CLOSE = object()
"""Put on a stream's outbox to end its request side."""


class Waiter(Protocol):
    """A future one caller waits on (asyncio's or concurrent.futures')."""

    def done(self) -> bool: ...

    def set_result(self, result: common_pb2.TransferStatus) -> None: ...

    def set_exception(self, exception: BaseException) -> None: ...

    def result(self) -> common_pb2.TransferStatus: ...

    def exception(self) -> BaseException | None: ...


@dataclasses.dataclass
class _Entry:
    waiters: list[Waiter]
    generation: int  # the stream on which the id was first sent


def copy_error(error: errors.KvdError) -> errors.KvdError:
    """A fresh instance of ``error``'s exact class, its message and cause: each waiter raises its own."""
    fresh = errors.from_status(error.code, error.message, type(error).__name__)
    fresh.__cause__ = error.__cause__
    return fresh


def unsupported(error: errors.KvdError) -> bool:
    """Whether a stream's failure says the daemon has no WatchTransfers (one older than 0.2.0)."""
    return error.code is ErrorCode.UNIMPLEMENTED


class WatchBook:
    """The ids one client waits on, their waiters, and the stream they ride (not thread-safe:
    the asyncio front end uses it from its loop, the thread front end under its lock)."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self.generation = 0  # streams opened so far; the current one's number
        self.incarnation = ""  # the daemon's, from the last stream's first message
        self.answered = False  # the current stream's first message arrived
        self.supported = True  # False once the daemon answered UNIMPLEMENTED (older than 0.2.0)

    @property
    def waiting(self) -> int:
        """Transfer ids waited on now."""
        return len(self._entries)

    def add(self, transfer_id: str, waiter: Waiter) -> bool:
        """A caller waits on ``transfer_id``; True when it is the id's first waiter (send the id)."""
        entry = self._entries.get(transfer_id)
        if entry is not None:
            entry.waiters.append(waiter)
            return False
        self._entries[transfer_id] = _Entry([waiter], self.generation)
        return True

    def discard(self, transfer_id: str, waiter: Waiter) -> bool:
        """A caller stopped waiting (answered, timed out, cancelled); True when it was the id's last
        waiter and the id was not answered (tell the daemon to stop watching it)."""
        entry = self._entries.get(transfer_id)
        if entry is None or waiter not in entry.waiters:
            return False
        entry.waiters.remove(waiter)
        if entry.waiters:
            return False
        del self._entries[transfer_id]
        return True

    def stream_opened(self) -> list[str]:
        """A new stream: every id waited on, to send first on it."""
        self.generation += 1
        self.answered = False
        return list(self._entries)

    def settle(self, response: router_pb2.WatchTransfersResponse) -> None:
        """Hand each answer of ``response`` to the waiters of its id."""
        if response.incarnation:
            self._first_message(response.incarnation)
        for status in response.finished:
            entry = self._entries.pop(status.transfer_id, None)
            if entry is None:
                continue  # nobody waits any more (timed out, or answered twice)
            if not _base.is_terminal(status):
                self._fail(
                    entry,
                    errors.Internal(f"the daemon answered transfer {status.transfer_id} in a state that is not final"),
                )
                continue
            for waiter in entry.waiters:
                if not waiter.done():
                    error = _base.transfer_error(status)
                    if error is None:
                        waiter.set_result(status)
                    else:
                        waiter.set_exception(error)
        for refusal in response.refused:
            entry = self._entries.pop(refusal.transfer_id, None)
            if entry is not None:
                code = ErrorCode.__members__.get(refusal.error_code, ErrorCode.UNKNOWN)
                self._fail(entry, errors.from_status(code, refusal.error_message, refusal.error_class))

    def stream_ended(self, error: errors.KvdError) -> bool:
        """The current stream ended with ``error``: True to open another at once (it had been
        answered, and ids are still waited on); otherwise every waiter fails with ``error``. A
        daemon without WatchTransfers turns :attr:`supported` off before the waiters hear of it (they
        fall back on WatchTransfer)."""
        if unsupported(error) and not self.answered:
            self.supported = False
        if self.answered and self._entries and not unsupported(error):
            return True
        self.fail_all(error)
        return False

    def fail_all(self, error: errors.KvdError) -> None:
        """Every waiter fails with ``error`` (each its own instance of the class)."""
        entries, self._entries = self._entries, {}
        for entry in entries.values():
            self._fail(entry, error)

    def _first_message(self, incarnation: str) -> None:
        if self.incarnation and incarnation != self.incarnation:
            lost = [tid for tid, entry in self._entries.items() if entry.generation < self.generation]
            logger.warning(
                "the daemon restarted (incarnation %s, was %s): %d watched transfers were lost with it",
                incarnation,
                self.incarnation,
                len(lost),
            )
            for transfer_id in lost:
                self._fail(
                    self._entries.pop(transfer_id),
                    errors.Unavailable(
                        f"transfer {transfer_id} was lost: the daemon restarted (incarnation {incarnation}, "
                        f"was {self.incarnation}) before it ended"
                    ),
                )
        self.incarnation = incarnation
        self.answered = True

    @staticmethod
    def _fail(entry: _Entry, error: errors.KvdError) -> None:
        for waiter in entry.waiters:
            if not waiter.done():
                waiter.set_exception(copy_error(error))


def request_messages(orders: Iterable[tuple[str, bool]]) -> list[router_pb2.WatchTransfersRequest]:
    """``orders`` ((transfer id, watch?) in the order they were queued) as requests: each id's last
    order only, at most MAX_IDS_PER_MESSAGE ids to watch and to unwatch per message."""
    last: dict[str, bool] = {}
    for transfer_id, watch in orders:
        last.pop(transfer_id, None)  # keeps the dict in the order of each id's last order
        last[transfer_id] = watch
    adds = [tid for tid, watch in last.items() if watch]
    removes = [tid for tid, watch in last.items() if not watch]
    messages = []
    for start in range(0, max(len(adds), len(removes)), MAX_IDS_PER_MESSAGE):
        end = start + MAX_IDS_PER_MESSAGE
        messages.append(
            router_pb2.WatchTransfersRequest(transfer_ids=adds[start:end], unwatch_transfer_ids=removes[start:end])
        )
    return messages


def ended_by_daemon() -> errors.KvdError:
    """The error for a stream the daemon ended OK although ids were still waited on."""
    return errors.Unavailable("the daemon ended the transfer watch stream")


def waited_too_long(transfer_id: str, timeout: float) -> errors.DeadlineExceeded:
    return errors.DeadlineExceeded(f"transfer {transfer_id} did not end within {timeout:.3g} s")


def outcomes(
    transfer_ids: Sequence[str], waiters: Sequence[Waiter], timeout: float | None
) -> list[common_pb2.TransferStatus | errors.KvdError]:
    """Per id, in order, its waiter's DONE status or KvdError (returned, not raised); an id whose
    waiter is not done after ``timeout`` seconds gets DeadlineExceeded. Any other error is raised."""
    out: list[common_pb2.TransferStatus | errors.KvdError] = []
    for transfer_id, waiter in zip(transfer_ids, waiters, strict=True):
        if not waiter.done():
            out.append(waited_too_long(transfer_id, timeout or 0.0))
        elif isinstance(error := waiter.exception(), errors.KvdError):
            out.append(error)
        elif error is not None:
            raise error
        else:
            out.append(waiter.result())
    return out


def stream_failure(exc: Exception, target: str) -> errors.KvdError:
    """What a stream's failure means for its waiters: the daemon's error for an RpcError, else
    Internal (logged with its traceback: call it while handling ``exc``); ``exc`` is its cause."""
    if isinstance(exc, grpc.RpcError):
        error = to_kvd_error(exc)
    else:  # the background work must record what killed it
        logger.exception("transfer watch stream to %s failed", target)
        error = errors.Internal(f"transfer watch stream failed: {exc!r}")
    error.__cause__ = exc
    return error
