"""``RouterService.WatchTransfers``: one stream on which a caller waits on many transfers.

The rules (what each id is answered, the bounds, the end at shutdown) are the core's
(:mod:`kvd.core.watches`); this module reads the caller's messages into the stream's watch and
writes its answers, batched: whatever answers queued while the previous message was being written
go out together in the next one, and an idle stream sends each answer at once, with no timer.

The first message carries the daemon's incarnation, before any answer: a client that re-opens
its stream after a failure learns whether the daemon it now talks to is the one its transfers ran
on (a restarted daemon knows none of them).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from kvd.core.transfers import Transfer
from kvd.core.watches import Answer, TransferWatch, TransferWatches
from kvd.server import convert
from kvd.server.edge import bounded
from kvd_client.v1 import router_pb2


def answers_to_pb(answers: list[Answer]) -> router_pb2.WatchTransfersResponse:
    """One response carrying ``answers``: final statuses and refusals."""
    response = router_pb2.WatchTransfersResponse()
    for answer in answers:
        if isinstance(answer, Transfer):
            response.finished.append(convert.transfer_to_pb(answer))
        else:
            response.refused.add(
                transfer_id=answer.transfer_id,
                error_code=answer.error.code.name,
                error_message=bounded(answer.error.message),
                error_class=type(answer.error).__name__,
            )
    return response


async def _read(watch: TransferWatch, requests: AsyncIterator[router_pb2.WatchTransfersRequest]) -> None:
    """The caller's messages into the watch; no further message while too many answers wait."""
    async for request in requests:
        watch.add(request.transfer_ids)
        watch.remove(request.unwatch_transfer_ids)
        await watch.room()


async def serve_watch_stream(
    watches: TransferWatches,
    incarnation: str,
    requests: AsyncIterator[router_pb2.WatchTransfersRequest],
) -> AsyncIterator[router_pb2.WatchTransfersResponse]:
    """The responses of one WatchTransfers stream, until the caller half-closes and every id it
    watched is answered (OK), its messages are bad (the reader's error), or the daemon shuts down
    (what was queued, then the watch's error: UNAVAILABLE)."""
    watch = watches.open()
    reader = asyncio.get_running_loop().create_task(_read(watch, requests), name="kvd-watch-transfers-reader")
    reader.add_done_callback(lambda _reader: watch.wakeup.set())
    half_closed = False
    try:
        yield router_pb2.WatchTransfersResponse(incarnation=incarnation)
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
