"""READs asked of the data-plane worker in one turn of the event loop go to it in one call.

A pull's READs (and those of every other pull planned in the same turn) are queued as they are
asked for and sent at the end of the turn, :data:`READS_PER_CALL` to a ``reads`` call: one message
and one hop to the worker's NIXL thread for all of them, instead of one each. Each READ's waiter
gets that READ's own outcome, or the whole call's error (the worker lost). Used by
:class:`kvd.core.dataplane.DataPlane`, on the event loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable
from typing import Any

from kvd.dataplane_protocol import ReadOrder, decode_error
from kvd_client.errors import Unavailable

READS_PER_CALL = 64  # READs posted in one "reads" call (two index arrays each: MAX_BUFFERS bounds it)


class ReadBatcher:
    """Queues READs on ``loop`` and sends them with ``submit("reads", orders)`` once per turn."""

    def __init__(self, loop: asyncio.AbstractEventLoop, submit: Callable[..., asyncio.Future[Any]]) -> None:
        self._loop = loop
        self._submit = submit  # DataPlane._submit: raises where the message cannot be framed
        self._queued: list[tuple[ReadOrder, asyncio.Future[Any]]] = []

    def post(self, read: ReadOrder) -> asyncio.Future[Any]:
        """Queue one READ to be posted with the others asked for in this loop turn; its future
        gets the READ's (state, error), or raises as a lone call would (a cancel of the waiter
        does not retract it: the READ may be posted all the same)."""
        future: asyncio.Future[Any] = self._loop.create_future()
        future.add_done_callback(ignore_outcome)
        if not self._queued:
            self._loop.call_soon(self._send)
        self._queued.append((read, future))
        return future

    def _send(self) -> None:
        """Send the READs queued this turn: one "reads" call per READS_PER_CALL of them."""
        queued, self._queued = self._queued, []
        for start in range(0, len(queued), READS_PER_CALL):
            chunk = queued[start : start + READS_PER_CALL]
            try:
                call = self._submit("reads", tuple(read for read, _ in chunk))
            except Exception as exc:  # noqa: BLE001 - not framed: nothing was sent, each READ fails
                for _, future in chunk:
                    if not future.done():
                        future.set_exception(exc)
                continue
            call.add_done_callback(functools.partial(_hand_out, [future for _, future in chunk]))


def _hand_out(futures: list[asyncio.Future[Any]], call: asyncio.Future[Any]) -> None:
    """A "reads" call is answered: each READ's own outcome to its waiter (the whole call's
    error, the worker lost, to every one of them)."""
    if call.cancelled():
        error: BaseException | None = Unavailable("the data plane stopped while READs were posted")
    else:
        error = call.exception()
    for index, future in enumerate(futures):
        if future.done():
            continue
        if error is not None:
            future.set_exception(error)
            continue
        outcome = call.result()[index]
        if outcome[0] == "posted":
            future.set_result((outcome[1], outcome[2]))
        else:
            future.set_exception(decode_error(outcome[1]))


def ignore_outcome(future: asyncio.Future[Any]) -> None:
    """A done callback that retrieves a future's outcome: a waiter that was cancelled leaves an
    error nobody reads, which asyncio would otherwise log as never retrieved."""
    with contextlib.suppress(BaseException):
        future.exception()
