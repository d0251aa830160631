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

A daemon that says so in its first message (``takes_pulls``) also starts pulls sent on the stream
(:meth:`WatchBook.add_start`): a router's pull is then one message up and the answers down, not a
StartPull call beside the wait. A start is answered (``started``, by its seq) before its transfer's
end; once answered, its waiter waits on the transfer id like any other. A start still unanswered
when its stream ends fails with the stream's error, saying the pull may have started (StartPull
of the same pull is idempotent: it answers the transfer started).

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
import itertools
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
MAX_STARTS_PER_MESSAGE = 1024
"""The daemon's bound on the pulls one WatchTransfersRequest starts (kvd.core.pulls)."""

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


@dataclasses.dataclass
class PullStart:
    """A pull started on the stream: its seq and waiter; its transfer id once answered."""

    seq: int
    request: router_pb2.StartPullRequest
    waiter: Waiter
    transfer_id: str = ""
    answered: bool = False


Order = tuple[str, bool] | router_pb2.WatchedPullStart
"""What a front end queues for its stream: (transfer id, watch it: True / stop: False), or a pull to start."""


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
        self.takes_pulls = False  # the current stream's first message said it starts pulls
        self._starts: dict[int, PullStart] = {}  # sent, not answered yet
        self._seqs = itertools.count(1)

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

    def add_start(self, request: router_pb2.StartPullRequest, waiter: Waiter) -> PullStart | None:
        """A caller starts a pull and waits for its end: the start to send on the stream, or None
        when the current stream does not start pulls (not answered yet, or an older daemon)."""
        if not (self.answered and self.takes_pulls):
            return None
        start = PullStart(next(self._seqs), request, waiter)
        self._starts[start.seq] = start
        return start

    def discard_start(self, start: PullStart) -> bool:
        """The caller stopped waiting on ``start``; True when it was answered with a transfer its
        waiter now waits on (discard that waiter from the id: :meth:`discard`)."""
        if self._starts.pop(start.seq, None) is not None:
            return False
        return bool(start.transfer_id)

    def stream_opened(self) -> list[str]:
        """A new stream: every id waited on, to send first on it."""
        self.generation += 1
        self.answered = False
        self.takes_pulls = False
        return list(self._entries)

    def settle(self, response: router_pb2.WatchTransfersResponse) -> None:
        """Hand each answer of ``response`` to the waiters of its id."""
        if response.incarnation:
            self._first_message(response.incarnation, response.takes_pulls)
        for started in response.started:  # before the finished: a start's end may be in this message
            self._started(started)
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

    def _started(self, started: router_pb2.WatchedPullStarted) -> None:
        start = self._starts.pop(started.seq, None)
        if start is None:
            return  # the caller stopped waiting (its transfer, if any, ends unwaited)
        start.answered = True
        result = started.result
        if result.error_code or not result.transfer_id:
            code = ErrorCode.__members__.get(result.error_code, ErrorCode.UNKNOWN)
            text = result.error_message or f"the pull of {start.request.request_id} did not start"
            if not start.waiter.done():
                start.waiter.set_exception(errors.from_status(code, text, result.error_class))
            return
        start.transfer_id = result.transfer_id
        entry = self._entries.get(result.transfer_id)
        if entry is None:  # the daemon watches it on this stream already: nothing to send
            self._entries[result.transfer_id] = _Entry([start.waiter], self.generation)
        else:
            entry.waiters.append(start.waiter)

    def _fail_starts(self, error: errors.KvdError) -> None:
        """Every start not answered: failed with ``error``'s class, saying the pull may have started."""
        starts, self._starts = self._starts, {}
        for start in starts.values():
            if not start.waiter.done():
                start.waiter.set_exception(
                    errors.from_status(
                        error.code,
                        f"{error.message} (before the daemon answered the start of the pull of "
                        f"{start.request.request_id!r}: it may have started; StartPull of the same pull answers "
                        "its transfer)",
                        type(error).__name__,
                    )
                )

    def stream_ended(self, error: errors.KvdError) -> bool:
        """The current stream ended with ``error``: True to open another at once (it had been
        answered, and ids are still waited on); otherwise every waiter fails with ``error``. A
        daemon without WatchTransfers turns :attr:`supported` off before the waiters hear of it (they
        fall back on WatchTransfer)."""
        if unsupported(error) and not self.answered:
            self.supported = False
        self._fail_starts(error)
        if self.answered and self._entries and not unsupported(error):
            return True
        self.fail_all(error)
        return False

    def fail_all(self, error: errors.KvdError) -> None:
        """Every waiter fails with ``error`` (each its own instance of the class)."""
        self._fail_starts(error)
        entries, self._entries = self._entries, {}
        for entry in entries.values():
            self._fail(entry, error)

    def _first_message(self, incarnation: str, takes_pulls: bool = False) -> None:
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
        self.takes_pulls = takes_pulls

    @staticmethod
    def _fail(entry: _Entry, error: errors.KvdError) -> None:
        for waiter in entry.waiters:
            if not waiter.done():
                waiter.set_exception(copy_error(error))


def request_messages(orders: Iterable[Order]) -> list[router_pb2.WatchTransfersRequest]:
    """``orders`` ((transfer id, watch?) and pulls to start, in the order they were queued) as
    requests: each id's last order only, at most MAX_IDS_PER_MESSAGE ids to watch and to unwatch
    and MAX_STARTS_PER_MESSAGE pulls to start per message."""
    last: dict[str, bool] = {}
    starts: list[router_pb2.WatchedPullStart] = []
    for order in orders:
        if isinstance(order, router_pb2.WatchedPullStart):
            starts.append(order)
            continue
        transfer_id, watch = order
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
    for start in range(0, len(starts), MAX_STARTS_PER_MESSAGE):
        chunk = starts[start : start + MAX_STARTS_PER_MESSAGE]
        if start == 0 and messages:
            messages[0].start_pulls.extend(chunk)
        else:
            messages.append(router_pb2.WatchTransfersRequest(start_pulls=chunk))
    return messages


def pull_took_too_long(start: PullStart, timeout: float) -> errors.DeadlineExceeded:
    """A pull started on the stream that did not end within ``timeout`` (it goes on)."""
    what = f"transfer {start.transfer_id}" if start.transfer_id else f"the pull of {start.request.request_id!r}"
    return errors.DeadlineExceeded(f"{what} did not end within {timeout:.3g} s (it goes on)")


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
