"""READs asked of the data-plane worker in one turn of the event loop go to it in one call.

A pull's READs (and those of every other pull planned in the same turn) are queued as they are
asked for and sent at the end of the turn, :data:`READS_PER_CALL` to a ``reads`` call: one message
and one hop to the worker's NIXL thread for all of them, instead of one each. READs of the turn
that can share a NIXL transfer (same lists, peer and geometries; the pull gave a
:class:`~kvd.core.step_reads.StepPart`) go as one step READ (:mod:`kvd.core.step_reads`), whose
outcome every one of them gets. Each READ's waiter gets its READ's own outcome (its step READ's),
or the whole call's error (the worker lost). Used by :class:`kvd.core.dataplane.DataPlane`, on
the event loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable
from typing import Any

from kvd.core import notif
from kvd.core.step_reads import Posting, Queued, StepPart, combine
from kvd.dataplane_protocol import ReadOrder, XferState, decode_error
from kvd_client.errors import Unavailable

READS_PER_CALL = 64  # READs posted in one "reads" call (two index arrays each: MAX_BUFFERS bounds it)


class StepReadBook:
    """Which READs each step READ carries, from its post until it is final (the DataPlane's):
    the worker settles a step READ by its own id, and every READ it carries is settled with it."""

    def __init__(self, next_xfer_id: Callable[[], int], on_open: Callable[[int], None] = lambda _: None) -> None:
        self.next_xfer_id = next_xfer_id  # the DataPlane's READ ids: a step READ is one more READ there
        self._on_open = on_open  # the READs each step READ carries (kvd_step_read_reads)
        self._carried: dict[int, tuple[int, ...]] = {}

    def open(self, posting: Posting) -> None:
        self._carried[posting.order.xfer_id] = posting.merged
        self._on_open(len(posting.merged))

    def answered(self, xfer_id: int, settles_later: bool) -> None:
        """The post was answered: a READ refused, or final within its post, gets no SETTLED."""
        if not settles_later:
            self._carried.pop(xfer_id, None)

    def settled(self, xfer_id: int) -> tuple[int, ...]:
        """The READs a step READ carried, once it is final (empty for any other READ)."""
        return self._carried.pop(xfer_id, ())

    def clear(self) -> None:
        self._carried.clear()

    def __len__(self) -> int:
        return len(self._carried)


class ReadBatcher:
    """Queues READs on ``loop`` and sends them with ``submit("reads", orders)`` once per turn."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        submit: Callable[..., asyncio.Future[Any]],
        book: StepReadBook | None = None,
    ) -> None:
        self._loop = loop
        self._submit = submit  # DataPlane._submit: raises where the message cannot be framed
        self._book = book  # None: every READ is posted alone
        self._queued: list[Queued] = []

    def post(self, read: ReadOrder, part: StepPart | None = None) -> asyncio.Future[Any]:
        """Queue one READ to be posted with the others asked for in this loop turn; its future
        gets the READ's (state, error), or raises as a lone call would (a cancel of the waiter
        does not retract it: the READ may be posted all the same). With ``part``, the READ may
        be posted within a step READ (:mod:`kvd.core.step_reads`)."""
        future: asyncio.Future[Any] = self._loop.create_future()
        future.add_done_callback(ignore_outcome)
        if not self._queued:
            self._loop.call_soon(self._send)
        self._queued.append(Queued(read, future, part if self._book is not None else None))
        return future

    def flush(self) -> None:
        """Send what is queued now rather than at the end of the turn (an engine step's pulls,
        all queued by StartPulls itself: their READs leave before anything else of the step runs)."""
        if self._queued:
            self._send()

    def _send(self) -> None:
        """Send the READs queued this turn: one "reads" call per READS_PER_CALL of them."""
        queued, self._queued = self._queued, []
        book = self._book
        if book is None:
            postings = [Posting(q.order, (q.future,)) for q in queued]
        else:
            postings = combine(queued, book.next_xfer_id, notif.MAX_READS_PER_NOTIFICATION)
        for start in range(0, len(postings), READS_PER_CALL):
            chunk = postings[start : start + READS_PER_CALL]
            try:
                call = self._submit("reads", tuple(posting.order for posting in chunk))
            except Exception as exc:  # noqa: BLE001 - not framed: nothing was sent, each READ fails
                for posting in chunk:
                    for future in posting.futures:
                        if not future.done():
                            future.set_exception(exc)
                continue
            if book is not None:
                for posting in chunk:
                    if posting.merged:
                        book.open(posting)
            call.add_done_callback(functools.partial(_hand_out, chunk, book))


def _hand_out(postings: list[Posting], book: StepReadBook | None, call: asyncio.Future[Any]) -> None:
    """A "reads" call is answered: each READ's own outcome to its waiters (the whole call's
    error, the worker lost, to every one of them)."""
    if call.cancelled():
        error: BaseException | None = Unavailable("the data plane stopped while READs were posted")
    else:
        error = call.exception()
    for index, posting in enumerate(postings):
        outcome = None if error is not None else call.result()[index]
        if posting.merged and book is not None:
            posted_in_flight = outcome is not None and outcome[0] == "posted" and outcome[1] != XferState.DONE.value
            book.answered(posting.order.xfer_id, posted_in_flight)
        for future in posting.futures:
            if future.done():
                continue
            if outcome is None:
                assert error is not None
                future.set_exception(error)
            elif outcome[0] == "posted":
                future.set_result((outcome[1], outcome[2]))
            else:
                future.set_exception(decode_error(outcome[1]))


def ignore_outcome(future: asyncio.Future[Any]) -> None:
    """A done callback that retrieves a future's outcome: a waiter that was cancelled leaves an
    error nobody reads, which asyncio would otherwise log as never retrieved."""
    with contextlib.suppress(BaseException):
        future.exception()
