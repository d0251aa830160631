"""Many transfers waited on through one stream: the core of ``RouterService.WatchTransfers``.

A router used to learn each pull's outcome on a ``WatchTransfer`` stream of its own: one RPC
opened, served and torn down per pull, on top of the pull's own ``StartPull``. Here one stream
watches any number of transfers. Its :class:`TransferWatch` holds the ids it watches and the
answers not sent yet; :class:`TransferWatches` (one per daemon) maps each watched id to the
streams watching it and, told by the :class:`~kvd.core.transfers.TransferTable` in the very call
that ends a transfer, queues that transfer on each of them: no task, no timer, no poll per id.

Every id a stream is sent is answered exactly once (each time it is sent while not watched):

* a transfer still running: its final state (DONE, FAILED or ABORTED), when it ends;
* a transfer that ended already: that final state, at once: a caller that asks after the pull
  ended still learns how it ended (while the table keeps it: its last ``KEEP_FINISHED``);
* an id that cannot be watched: a :class:`Refusal` of that id alone, the stream going on
  (``UnknownTransfer``: not known here; ``InvalidArgument``: empty; ``ResourceExhausted``: the
  stream already watches :data:`MAX_WATCHED` ids).

Bounds against a hostile or broken caller: at most :data:`MAX_IDS_PER_MESSAGE` ids in one
message (more is malformed: ``InvalidArgument`` ends the stream), at most :data:`MAX_WATCHED`
watched per stream, and while :data:`MAX_UNSENT_ANSWERS` answers wait to be sent the stream's
reader takes no further message (:meth:`TransferWatch.room`): a caller that does not read its
answers is not read either, and HTTP/2 flow control holds it back.

A stream may also start pulls (``start_pulls``, a router's pull in one message instead of a
StartPull call and a watch): the edge starts each as StartPull would and hands its outcome to
:meth:`TransferWatch.started`, which queues the answer (:class:`Started`) and then watches the
transfer, so a pull's start is always answered before its end.

When the daemon shuts down it closes every watch (:meth:`TransferWatches.close`) once its pulls
have ended, so a watch sends the outcomes of the pulls that finished or were aborted in the
grace period, then ends with the error it was closed with (``Unavailable``).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from collections.abc import Sequence

from kvd.core.transfers import Transfer, TransferTable
from kvd_client.errors import InvalidArgument, KvdError, ResourceExhausted, UnknownTransfer

logger = logging.getLogger(__name__)

MAX_IDS_PER_MESSAGE = 4096
"""Most transfer ids one WatchTransfersRequest may name (to watch and to unwatch, each)."""
MAX_WATCHED = 16384
"""Most transfers one stream watches at once (a router's pulls in flight on one daemon)."""
MAX_ANSWERS_PER_MESSAGE = 512
"""Most answers in one WatchTransfersResponse: a backlog goes out in messages of bounded size."""
MAX_UNSENT_ANSWERS = 4096
"""While this many answers wait to be sent, the stream's caller is not read (back-pressure)."""

_ECHO = 120
"""Characters of a caller's id quoted in a refusal's message (the id itself travels whole)."""


@dataclasses.dataclass(frozen=True)
class Refusal:
    """An id of a request that is not watched, and why (the error a GetTransfer of it would raise)."""

    transfer_id: str
    error: KvdError


@dataclasses.dataclass(frozen=True)
class Started:
    """A pull started on the stream (the caller's ``seq``): its transfer, or why it did not start."""

    seq: int
    result: Transfer | KvdError


Answer = Transfer | Refusal | Started
"""What a stream sends: an id's final transfer or its refusal, or a pull's start."""


def _quoted(transfer_id: str) -> str:
    text = transfer_id if len(transfer_id) <= _ECHO else f"{transfer_id[:_ECHO]}...({len(transfer_id) - _ECHO} more)"
    return repr(text)


class TransferWatch:
    """One WatchTransfers stream: the ids it watches and its answers not sent yet.

    Used from the event loop only (the stream's reader, its writer, and the table's end
    callbacks all run there), so it needs no lock.
    """

    def __init__(self, owner: TransferWatches) -> None:
        self._owner = owner
        self.watched: set[str] = set()
        self._answers: collections.deque[Answer] = collections.deque()
        self.wakeup = asyncio.Event()  # an answer was queued, or the watch was closed
        self._room = asyncio.Event()  # fewer than MAX_UNSENT_ANSWERS answers wait
        self._room.set()
        self.ended: KvdError | None = None  # set when the daemon closed every watch

    @property
    def has_answers(self) -> bool:
        return bool(self._answers)

    def add(self, transfer_ids: Sequence[str]) -> None:
        """Watch ``transfer_ids``: each is answered once (now if it ended or cannot be watched)."""
        if len(transfer_ids) > MAX_IDS_PER_MESSAGE:
            raise InvalidArgument(
                f"a WatchTransfers message names {len(transfer_ids)} transfer ids; at most "
                f"{MAX_IDS_PER_MESSAGE} are accepted per message: send them in several"
            )
        table = self._owner.table
        for transfer_id in transfer_ids:
            if transfer_id in self.watched:
                continue
            if not transfer_id:
                self._queue(Refusal("", InvalidArgument("an empty transfer id: send the id StartPull answered")))
                continue
            try:
                transfer = table.get(transfer_id)
            except UnknownTransfer:
                error = UnknownTransfer(
                    f"no transfer {_quoted(transfer_id)} is known here (finished long ago, never started, "
                    "or started on another daemon or before this daemon restarted)"
                )
                self._queue(Refusal(transfer_id, error))
                continue
            if transfer.state.final:
                self._queue(transfer)
            elif len(self.watched) >= MAX_WATCHED:
                self._queue(
                    Refusal(
                        transfer_id,
                        ResourceExhausted(
                            f"this stream already watches {MAX_WATCHED} transfers: wait for some to end "
                            f"before watching {_quoted(transfer_id)}, or open another stream"
                        ),
                    )
                )
            else:
                self.watched.add(transfer_id)
                self._owner.add_watcher(transfer_id, self)

    def started(self, seq: int, result: Transfer | KvdError) -> None:
        """A pull this stream started: its answer first, then its transfer watched (answered when
        it ends, or at once if it ended already), as an id sent on the stream would be."""
        self._queue(Started(seq, result))
        if isinstance(result, Transfer):
            self.add((result.transfer_id,))

    def remove(self, transfer_ids: Sequence[str]) -> None:
        """Stop watching ``transfer_ids`` (ids not watched are ignored): no answer comes for them."""
        if len(transfer_ids) > MAX_IDS_PER_MESSAGE:
            raise InvalidArgument(
                f"a WatchTransfers message unwatches {len(transfer_ids)} transfer ids; at most "
                f"{MAX_IDS_PER_MESSAGE} are accepted per message"
            )
        for transfer_id in transfer_ids:
            if transfer_id in self.watched:
                self.watched.discard(transfer_id)
                self._owner.remove_watcher(transfer_id, self)

    def drain(self) -> list[Answer]:
        """The answers to send now, oldest first, at most MAX_ANSWERS_PER_MESSAGE."""
        answers = self._answers
        out = [answers.popleft() for _ in range(min(len(answers), MAX_ANSWERS_PER_MESSAGE))]
        if len(answers) < MAX_UNSENT_ANSWERS:
            self._room.set()
        return out

    async def room(self) -> None:
        """Wait until fewer than MAX_UNSENT_ANSWERS answers wait (or the watch is closed)."""
        while len(self._answers) >= MAX_UNSENT_ANSWERS and self.ended is None:
            self._room.clear()
            await self._room.wait()

    def close(self, error: KvdError) -> None:
        """The daemon is going away: the stream sends what is queued, then ends with ``error``."""
        self.ended = error
        self.wakeup.set()
        self._room.set()

    def transfer_ended(self, transfer: Transfer) -> None:
        """A watched transfer ended (called by TransferWatches, inside the state change)."""
        self.watched.discard(transfer.transfer_id)
        self._queue(transfer)

    def _queue(self, answer: Answer) -> None:
        self._answers.append(answer)
        self.wakeup.set()


class TransferWatches:
    """Every open WatchTransfers stream of a daemon, by the transfer ids they watch."""

    def __init__(self, table: TransferTable) -> None:
        self.table = table
        self._by_id: dict[str, list[TransferWatch]] = {}
        self._open: set[TransferWatch] = set()
        self._closed: KvdError | None = None
        table.on_final(self._transfer_ended)

    def open(self) -> TransferWatch:
        """A new stream's watch; the error the watches were closed with once the daemon stops."""
        if self._closed is not None:
            raise self._closed
        watch = TransferWatch(self)
        self._open.add(watch)
        return watch

    def release(self, watch: TransferWatch) -> None:
        """The stream ended: forget what it watched."""
        for transfer_id in watch.watched:
            self.remove_watcher(transfer_id, watch)
        watch.watched.clear()
        self._open.discard(watch)

    def close(self, error: KvdError) -> None:
        """End every stream (after its queued answers) with ``error``; refuse new ones with it."""
        self._closed = error
        for watch in list(self._open):
            watch.close(error)

    @property
    def streams(self) -> int:
        return len(self._open)

    @property
    def watched(self) -> int:
        """Transfer ids watched now, over every stream."""
        return sum(len(watchers) for watchers in self._by_id.values())

    def add_watcher(self, transfer_id: str, watch: TransferWatch) -> None:
        self._by_id.setdefault(transfer_id, []).append(watch)

    def remove_watcher(self, transfer_id: str, watch: TransferWatch) -> None:
        watchers = self._by_id.get(transfer_id)
        if watchers is None:
            return
        if watch in watchers:
            watchers.remove(watch)
        if not watchers:
            del self._by_id[transfer_id]

    def _transfer_ended(self, transfer: Transfer) -> None:
        """The table's end callback: queue the transfer on every stream watching it. Never raises
        (it runs inside the pull's state change)."""
        watchers = self._by_id.pop(transfer.transfer_id, None)
        if watchers is None:
            return
        for watch in watchers:
            try:
                watch.transfer_ended(transfer)
            except Exception:  # must not fail the pull whose end this reports
                logger.exception("queueing the end of transfer %s on a watch failed", transfer.transfer_id)
