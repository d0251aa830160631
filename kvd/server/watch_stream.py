"""``RouterService.WatchTransfers``: one stream on which a caller waits on many transfers.

The rules (what each id is answered, the bounds, the end at shutdown) are the core's
(:mod:`kvd.core.watches`); this module reads the caller's messages into the stream's watch and
writes its answers, batched: whatever answers queued while the previous message was being written
go out together in the next one, and an idle stream sends each answer at once, with no timer.

A caller may also start pulls on the stream (``start_pulls``): each is started as StartPull would
(:func:`kvd.server.pull_starts.pull_order`, the core's ``start_pulls``), its start answered
(``started``) and its transfer then watched, so its end comes on the same stream.

The first message carries the daemon's incarnation, before any answer: a client that re-opens
its stream after a failure learns whether the daemon it now talks to is the one its transfers ran
on (a restarted daemon knows none of them).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence

from kvd.core.pulls import PullOrder
from kvd.core.transfers import Transfer
from kvd.core.watches import Answer, Started, TransferWatch, TransferWatches
from kvd.server import convert
from kvd.server.edge import bounded
from kvd.server.pull_starts import read_orders, result_to_pb
from kvd_client.errors import InvalidArgument, KvdError
from kvd_client.v1 import router_pb2

StartPulls = Callable[[Sequence[PullOrder | KvdError]], Sequence[Transfer | KvdError]]
"""The core's ``start_pulls``: each order's transfer or error, in order (raises for the whole
batch: over its bound, or the daemon not serving)."""


def answers_to_pb(answers: list[Answer]) -> router_pb2.WatchTransfersResponse:
    """One response carrying ``answers``: final statuses and refusals."""
    response = router_pb2.WatchTransfersResponse()
    for answer in answers:
        if isinstance(answer, Transfer):
            response.finished.append(convert.transfer_to_pb(answer))
        elif isinstance(answer, Started):
            result_to_pb(response.started.add(seq=answer.seq).result, answer.result)
        else:
            response.refused.add(
                transfer_id=answer.transfer_id,
                error_code=answer.error.code.name,
                error_message=bounded(answer.error.message),
                error_class=type(answer.error).__name__,
            )
    return response


def _start(watch: TransferWatch, start_pulls: StartPulls | None, starts: Sequence[router_pb2.WatchedPullStart]) -> None:
    """Start a message's pulls, each as StartPull would; each one's answer, then its watch."""
    if start_pulls is None:  # this stream said it does not take them (takes_pulls unset)
        for item in starts:
            watch.started(item.seq, InvalidArgument("this WatchTransfers stream does not start pulls: use StartPull"))
        return
    orders = read_orders(item.pull for item in starts)
    try:
        results: Sequence[Transfer | KvdError] = start_pulls(orders)
    except KvdError as exc:  # the whole message refused: every pull says why
        results = [exc] * len(orders)
    for item, result in zip(starts, results, strict=True):
        watch.started(item.seq, result)


async def _read(
    watch: TransferWatch, requests: AsyncIterator[router_pb2.WatchTransfersRequest], start_pulls: StartPulls | None
) -> None:
    """The caller's messages into the watch; no further message while too many answers wait."""
    async for request in requests:
        # Unwatches first: they come from waits given up before the message went out, and one may
        # name the transfer a start in the same message answers again (a pull retried at once
        # after its wait timed out: StartPull is idempotent), which must stay watched.
        watch.remove(request.unwatch_transfer_ids)
        if request.start_pulls:
            _start(watch, start_pulls, request.start_pulls)
        watch.add(request.transfer_ids)
        await watch.room()


async def serve_watch_stream(
    watches: TransferWatches,
    incarnation: str,
    requests: AsyncIterator[router_pb2.WatchTransfersRequest],
    start_pulls: StartPulls | None = None,
) -> AsyncIterator[router_pb2.WatchTransfersResponse]:
    """The responses of one WatchTransfers stream, until the caller half-closes and every id it
    watched is answered (OK), its messages are bad (the reader's error), or the daemon shuts down
    (what was queued, then the watch's error: UNAVAILABLE). With ``start_pulls`` it also starts
    the pulls its caller sends (``takes_pulls`` in its first message)."""
    watch = watches.open()
    reader = asyncio.get_running_loop().create_task(
        _read(watch, requests, start_pulls), name="kvd-watch-transfers-reader"
    )
    reader.add_done_callback(lambda _reader: watch.wakeup.set())
    half_closed = False
    try:
        yield router_pb2.WatchTransfersResponse(incarnation=incarnation, takes_pulls=start_pulls is not None)
        while True:
            answers = watch.drain()
            if answers:
                yield answers_to_pb(answers)
                continue
            if watch.ended is not None:
                raise watch.ended
            if reader.done() and not half_closed:
                error = None if reader.cancelled() else reader.exception()
                if error is not None:
                    raise error
                half_closed = True
            if half_closed and not watch.watched:
                return
            watch.wakeup.clear()
            if watch.has_answers or watch.ended is not None or (reader.done() and not half_closed):
                continue
            await watch.wakeup.wait()
    finally:
        reader.cancel()
        watches.release(watch)
