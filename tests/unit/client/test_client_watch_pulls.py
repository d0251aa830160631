"""A router's pulls started on the WatchTransfers stream: the book's rules (kvd_client._watch_book)
and the daemon's side (kvd.server.watch_stream with kvd.core.watches), each against fakes.

The book: a start goes on the stream only once the stream said it takes pulls; its answer comes
before its end and hands the waiter over to the transfer id; a refusal fails it with the exact
class; a stream that ends before the answer fails it saying the pull may have started. The
daemon's side: each start answered once, before its transfer's end; bad items and a message over
the bound refused per item; a stream that does not take pulls refuses them."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import AsyncIterator, Sequence

import pytest

from kvd.core.transfers import Transfer, TransferState, TransferTable
from kvd.core.watches import TransferWatches
from kvd.server.watch_stream import serve_watch_stream
from kvd_client import errors
from kvd_client._watch_book import MAX_STARTS_PER_MESSAGE, WatchBook, request_messages
from kvd_client.v1 import common_pb2, router_pb2

PULL = router_pb2.StartPullRequest(engine_id="eng", request_id="r1", local_block_ids=[1])


def _answered_book(takes_pulls: bool = True) -> WatchBook:
    book = WatchBook()
    book.stream_opened()
    book.settle(router_pb2.WatchTransfersResponse(incarnation="inc", takes_pulls=takes_pulls))
    return book


def _started(seq: int, transfer_id: str = "", error: errors.KvdError | None = None) -> router_pb2.WatchedPullStarted:
    started = router_pb2.WatchedPullStarted(seq=seq)
    if error is not None:
        started.result.error_code = error.code.name
        started.result.error_message = error.message
        started.result.error_class = type(error).__name__
    else:
        started.result.transfer_id = transfer_id
    return started


def test_a_start_waits_for_a_stream_that_said_it_takes_pulls() -> None:
    waiter: concurrent.futures.Future[common_pb2.TransferStatus] = concurrent.futures.Future()
    book = WatchBook()
    book.stream_opened()
    assert book.add_start(PULL, waiter) is None  # not answered yet: StartPull it
    assert _answered_book(takes_pulls=False).add_start(PULL, waiter) is None  # an older daemon
    assert _answered_book().add_start(PULL, waiter) is not None
    reopened = _answered_book()
    reopened.stream_opened()  # a new stream forgets what the last one said
    assert reopened.add_start(PULL, waiter) is None


def test_a_start_and_its_end_in_one_message_settle_its_waiter() -> None:
    book = _answered_book()
    waiter: concurrent.futures.Future[common_pb2.TransferStatus] = concurrent.futures.Future()
    start = book.add_start(PULL, waiter)
    assert start is not None
    status = common_pb2.TransferStatus(transfer_id="t1", state=common_pb2.TRANSFER_STATE_DONE)
    book.settle(router_pb2.WatchTransfersResponse(started=[_started(start.seq, "t1")], finished=[status]))
    assert waiter.result(0).transfer_id == "t1" and start.transfer_id == "t1"
    assert book.waiting == 0 and book.discard_start(start) is not None


def test_a_started_pull_is_waited_on_by_its_id_until_it_ends() -> None:
    book = _answered_book()
    waiter: concurrent.futures.Future[common_pb2.TransferStatus] = concurrent.futures.Future()
    start = book.add_start(PULL, waiter)
    assert start is not None
    book.settle(router_pb2.WatchTransfersResponse(started=[_started(start.seq, "t1")]))
    assert not waiter.done() and book.waiting == 1
    assert book.discard_start(start)  # the caller gives up: it waits on "t1" now...
    assert book.discard(start.transfer_id, waiter)  # ...so that is where it is forgotten (and unwatched)
    assert book.waiting == 0


def test_a_refused_start_fails_with_the_exact_class() -> None:
    book = _answered_book()
    waiter: concurrent.futures.Future[common_pb2.TransferStatus] = concurrent.futures.Future()
    start = book.add_start(PULL, waiter)
    assert start is not None
    book.settle(
        router_pb2.WatchTransfersResponse(started=[_started(start.seq, error=errors.UnknownEngine("no engine eng"))])
    )
    error = waiter.exception(0)
    assert type(error) is errors.UnknownEngine and "no engine eng" in str(error)
    assert not book.discard_start(start) and book.waiting == 0


def test_a_start_unanswered_when_its_stream_ends_fails_saying_the_pull_may_have_started() -> None:
    book = _answered_book()
    waiter: concurrent.futures.Future[common_pb2.TransferStatus] = concurrent.futures.Future()
    start = book.add_start(PULL, waiter)
    assert start is not None
    book.stream_ended(errors.Unavailable("stream reset"))
    error = waiter.exception(0)
    assert type(error) is errors.Unavailable and "may have started" in str(error) and "'r1'" in str(error)
    book.settle(router_pb2.WatchTransfersResponse(started=[_started(start.seq, "t1")]))  # an answer after it
    assert book.waiting == 0  # is nobody's


def test_close_fails_the_starts_too() -> None:
    book = _answered_book()
    waiter: concurrent.futures.Future[common_pb2.TransferStatus] = concurrent.futures.Future()
    assert book.add_start(PULL, waiter) is not None
    book.fail_all(errors.Cancelled("closed"))
    assert type(waiter.exception(0)) is errors.Cancelled


def test_request_messages_carry_the_starts_within_the_bound() -> None:
    starts = [router_pb2.WatchedPullStart(seq=i, pull=PULL) for i in range(MAX_STARTS_PER_MESSAGE + 5)]
    messages = request_messages([("a", True), *starts, ("b", False)])
    assert [len(m.start_pulls) for m in messages] == [MAX_STARTS_PER_MESSAGE, 5]
    assert list(messages[0].transfer_ids) == ["a"] and list(messages[0].unwatch_transfer_ids) == ["b"]
    assert [s.seq for m in messages for s in m.start_pulls] == list(range(MAX_STARTS_PER_MESSAGE + 5))
    (only,) = request_messages(starts[:2])
    assert [s.seq for s in only.start_pulls] == [0, 1] and not only.transfer_ids


# --- the daemon's side ------------------------------------------------------------------------


class _Caller:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[router_pb2.WatchTransfersRequest | None] = asyncio.Queue()

    async def requests(self) -> AsyncIterator[router_pb2.WatchTransfersRequest]:
        while (item := await self.queue.get()) is not None:
            yield item


def _new(table: TransferTable, request_id: str) -> Transfer:
    return table.new(
        request_id=request_id, engine_id="eng", tp_rank=0, peer_address="p:1", local_block_ids=(1,), deadline_s=30.0
    )


async def _next(stream: AsyncIterator[router_pb2.WatchTransfersResponse]) -> router_pb2.WatchTransfersResponse:
    return await asyncio.wait_for(anext(stream), 2.0)


def _start(seq: int, pull: router_pb2.StartPullRequest) -> router_pb2.WatchedPullStart:
    return router_pb2.WatchedPullStart(seq=seq, pull=pull)


def _remote() -> common_pb2.KvTransferParams:
    return common_pb2.KvTransferParams(daemon_address="h:1", lease_id="L", engine_id="e", num_tokens=4)


def test_the_daemon_answers_each_start_before_its_end_and_refuses_bad_items_alone() -> None:
    async def main() -> None:
        table = TransferTable()
        hub = TransferWatches(table)
        started: list[Transfer] = []

        def start_pulls(orders: Sequence[object]) -> list[Transfer | errors.KvdError]:
            out: list[Transfer | errors.KvdError] = []
            for order in orders:
                if isinstance(order, errors.KvdError):
                    out.append(order)
                else:
                    started.append(_new(table, order.request_id))  # type: ignore[attr-defined]
                    out.append(started[-1])
            return out

        caller = _Caller()
        stream = serve_watch_stream(hub, "inc", caller.requests(), start_pulls)
        first = await _next(stream)
        assert first.incarnation == "inc" and first.takes_pulls
        good = router_pb2.StartPullRequest(engine_id="eng", request_id="g", local_block_ids=[1], remote=_remote())
        bad = router_pb2.StartPullRequest(engine_id="eng", request_id="b")  # no remote
        caller.queue.put_nowait(
            router_pb2.WatchTransfersRequest(
                start_pulls=[
                    router_pb2.WatchedPullStart(seq=7, pull=good),
                    router_pb2.WatchedPullStart(seq=8, pull=bad),
                ]
            )
        )
        answers = await _next(stream)
        by_seq = {s.seq: s.result for s in answers.started}
        assert by_seq[7].transfer_id == started[0].transfer_id and not by_seq[7].error_code
        assert (by_seq[8].error_code, by_seq[8].error_class) == ("INVALID_ARGUMENT", "InvalidArgument")
        assert "remote kv_transfer_params are required" in by_seq[8].error_message
        assert not answers.finished  # still running: watched, its end comes later
        started[0].advance(TransferState.READING)
        started[0].advance(TransferState.DONE)
        ended = await _next(stream)
        assert [s.transfer_id for s in ended.finished] == [started[0].transfer_id]
        caller.queue.put_nowait(None)
        with pytest.raises(StopAsyncIteration):
            await _next(stream)

    asyncio.run(main())


def test_a_whole_message_refused_refuses_each_start_and_the_stream_goes_on() -> None:
    async def main() -> None:
        hub = TransferWatches(TransferTable())

        def start_pulls(orders: Sequence[object]) -> list[Transfer | errors.KvdError]:
            raise errors.InvalidArgument(f"StartPulls takes at most 1024 pulls per call, got {len(orders)}")

        caller = _Caller()
        stream = serve_watch_stream(hub, "inc", caller.requests(), start_pulls)
        await _next(stream)
        pull = router_pb2.StartPullRequest(engine_id="eng", request_id="x", remote=_remote())
        caller.queue.put_nowait(
            router_pb2.WatchTransfersRequest(
                start_pulls=[router_pb2.WatchedPullStart(seq=i, pull=pull) for i in range(3)]
            )
        )
        answers = await _next(stream)
        assert [s.seq for s in answers.started] == [0, 1, 2]
        assert all(
            s.result.error_class == "InvalidArgument" and "at most 1024" in s.result.error_message
            for s in answers.started
        )
        caller.queue.put_nowait(router_pb2.WatchTransfersRequest(transfer_ids=["nosuch"]))
        assert [r.transfer_id for r in (await _next(stream)).refused] == ["nosuch"]  # still serving

    asyncio.run(main())


def test_a_stream_that_does_not_take_pulls_says_so_and_refuses_them() -> None:
    async def main() -> None:
        hub = TransferWatches(TransferTable())
        caller = _Caller()
        stream = serve_watch_stream(hub, "inc", caller.requests())
        assert not (await _next(stream)).takes_pulls
        caller.queue.put_nowait(
            router_pb2.WatchTransfersRequest(start_pulls=[router_pb2.WatchedPullStart(seq=1, pull=PULL)])
        )
        (started,) = (await _next(stream)).started
        assert started.seq == 1 and started.result.error_class == "InvalidArgument"

    asyncio.run(main())
