"""kvd.server.watch_stream: the WatchTransfers stream's messages (first the incarnation, then the
answers, batched), its end when the caller half-closes, its errors, and its end at shutdown."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from kvd.core.transfers import Transfer, TransferState, TransferTable
from kvd.core.watches import TransferWatches
from kvd.server.watch_stream import serve_watch_stream
from kvd_client.errors import InvalidArgument, LeaseExpired, Unavailable
from kvd_client.v1 import common_pb2, router_pb2


def _new(table: TransferTable, request_id: str) -> Transfer:
    return table.new(
        request_id=request_id, engine_id="eng", tp_rank=0, peer_address="p:1", local_block_ids=(1,), deadline_s=30.0
    )


class Caller:
    """The caller's side: messages put here are the stream's requests; None half-closes."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[router_pb2.WatchTransfersRequest | None] = asyncio.Queue()

    def send(self, *ids: str, unwatch: tuple[str, ...] = ()) -> None:
        self.queue.put_nowait(router_pb2.WatchTransfersRequest(transfer_ids=ids, unwatch_transfer_ids=unwatch))

    def half_close(self) -> None:
        self.queue.put_nowait(None)

    async def requests(self) -> AsyncIterator[router_pb2.WatchTransfersRequest]:
        while (item := await self.queue.get()) is not None:
            yield item


async def _next(stream: AsyncIterator[router_pb2.WatchTransfersResponse]) -> router_pb2.WatchTransfersResponse:
    return await asyncio.wait_for(anext(stream), 2.0)


def test_incarnation_first_then_answers_then_ok_after_half_close() -> None:
    """The first message names the incarnation; an ended, a failing and an unknown id are each
    answered once (the two ready together in one message); after the caller half-closes the
    stream ends once the last watched id is answered."""

    async def main() -> None:
        table = TransferTable()
        hub = TransferWatches(table)
        done, failing, running = _new(table, "d"), _new(table, "f"), _new(table, "r")
        done.advance(TransferState.READING)
        done.advance(TransferState.DONE)
        caller = Caller()
        stream = serve_watch_stream(hub, "inc-1", caller.requests())
        first = await _next(stream)
        assert first.incarnation == "inc-1" and not first.finished and not first.refused
        caller.send(done.transfer_id, "nosuch", failing.transfer_id, running.transfer_id)
        answers = await _next(stream)
        assert [s.transfer_id for s in answers.finished] == [done.transfer_id]
        assert answers.finished[0].state == common_pb2.TRANSFER_STATE_DONE and not answers.incarnation
        (refusal,) = answers.refused
        assert (refusal.transfer_id, refusal.error_code, refusal.error_class) == (
            "nosuch",
            "NOT_FOUND",
            "UnknownTransfer",
        )
        failing.advance(TransferState.FAILED, LeaseExpired("the lease expired"))
        caller.half_close()
        answers = await _next(stream)
        (status,) = answers.finished
        assert status.state == common_pb2.TRANSFER_STATE_FAILED and status.error_class == "LeaseExpired"
        await asyncio.sleep(0.01)
        running.advance(TransferState.ABORTED)
        assert [s.transfer_id for s in (await _next(stream)).finished] == [running.transfer_id]
        with pytest.raises(StopAsyncIteration):
            await _next(stream)
        assert hub.streams == 0

    asyncio.run(main())


def test_answers_ready_together_go_out_in_one_message() -> None:
    """Transfers that end in one event-loop turn are answered in one message."""

    async def main() -> None:
        table = TransferTable()
        hub = TransferWatches(table)
        transfers = [_new(table, f"r{i}") for i in range(32)]
        caller = Caller()
        stream = serve_watch_stream(hub, "inc", caller.requests())
        await _next(stream)
        caller.send(*(t.transfer_id for t in transfers))
        await asyncio.sleep(0.01)
        for t in transfers:
            t.advance(TransferState.ABORTED)
        answers = await _next(stream)
        assert len(answers.finished) == 32

    asyncio.run(main())


def test_a_bad_message_ends_the_stream_with_its_error() -> None:
    """Too many ids in one message: the reader's InvalidArgument ends the stream."""

    async def main() -> None:
        hub = TransferWatches(TransferTable())
        caller = Caller()
        stream = serve_watch_stream(hub, "inc", caller.requests())
        await _next(stream)
        caller.send(*(["x"] * 5000))
        with pytest.raises(InvalidArgument, match="at most 4096"):
            await _next(stream)
        assert hub.streams == 0

    asyncio.run(main())


def test_shutdown_sends_what_ended_then_unavailable() -> None:
    """Closing the watches (the daemon shutting down after its pulls ended) flushes the answers
    queued, then ends the stream with the close's error."""

    async def main() -> None:
        table = TransferTable()
        hub = TransferWatches(table)
        t = _new(table, "r")
        caller = Caller()
        stream = serve_watch_stream(hub, "inc", caller.requests())
        await _next(stream)
        caller.send(t.transfer_id)
        await asyncio.sleep(0.01)
        t.advance(TransferState.ABORTED)
        hub.close(Unavailable("the daemon is shutting down"))
        assert [s.transfer_id for s in (await _next(stream)).finished] == [t.transfer_id]
        with pytest.raises(Unavailable, match="shutting down"):
            await _next(stream)

    asyncio.run(main())


def test_a_stream_closed_by_the_caller_releases_its_watch() -> None:
    """The RPC's end (the caller went away: the generator is closed) forgets what it watched."""

    async def main() -> None:
        table = TransferTable()
        hub = TransferWatches(table)
        t = _new(table, "r")
        caller = Caller()
        stream = serve_watch_stream(hub, "inc", caller.requests())
        await _next(stream)
        caller.send(t.transfer_id)
        await asyncio.sleep(0.01)
        assert hub.watched == 1
        await stream.aclose()
        assert hub.watched == 0 and hub.streams == 0

    asyncio.run(main())
