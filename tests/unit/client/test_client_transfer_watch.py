"""The transfer-watch multiplexer (one WatchTransfers stream per client) against a scripted stub.

The stub's calls are fakes the test drives message by message: what the client sent, what the
"daemon" answers and when the stream breaks, so that the interleavings (batching, a break after
or before the first message, a restarted daemon, an old daemon, timeouts, close) are exact.
Both front ends run the same scenarios: the asyncio one (AsyncTransferWatch) and the thread one
(TransferWatch).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest

from kvd_client import errors
from kvd_client._aio_transfer_watch import AsyncTransferWatch
from kvd_client._transfer_watch import TransferWatch
from kvd_client._watch_book import MAX_IDS_PER_MESSAGE, WatchBook, request_messages
from kvd_client.v1 import common_pb2, router_pb2

END = object()


class FakeRpcError(grpc.RpcError):
    """What grpc raises for a failed call: a code, details, and the daemon's exact class."""

    def __init__(self, code: grpc.StatusCode, details: str = "", class_name: str = "") -> None:
        super().__init__(details)
        self._code, self._details, self._class = code, details, class_name

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("kvd-error-class", self._class),) if self._class else ()


def hello(incarnation: str = "inc-1") -> router_pb2.WatchTransfersResponse:
    return router_pb2.WatchTransfersResponse(incarnation=incarnation)


def finished(*statuses: common_pb2.TransferStatus) -> router_pb2.WatchTransfersResponse:
    return router_pb2.WatchTransfersResponse(finished=statuses)


def done(transfer_id: str, nbytes: int = 0) -> common_pb2.TransferStatus:
    return common_pb2.TransferStatus(transfer_id=transfer_id, state=common_pb2.TRANSFER_STATE_DONE, bytes=nbytes)


def failed(transfer_id: str, code: str, class_name: str) -> common_pb2.TransferStatus:
    return common_pb2.TransferStatus(
        transfer_id=transfer_id,
        state=common_pb2.TRANSFER_STATE_FAILED,
        error_code=code,
        error_message=f"{transfer_id} failed",
        error_class=class_name,
    )


def refused(transfer_id: str, code: str, class_name: str) -> router_pb2.WatchTransfersResponse:
    return router_pb2.WatchTransfersResponse(
        refused=[
            router_pb2.TransferWatchRefusal(
                transfer_id=transfer_id, error_code=code, error_message="refused", error_class=class_name
            )
        ]
    )


# -- the shared rules ------------------------------------------------------------------------------


def test_request_messages_keep_each_ids_last_order() -> None:
    """An id watched then unwatched before the message went out is only unwatched, and one given
    up then waited on again is only watched (it stays watched on the daemon)."""
    (message,) = request_messages([("a", True), ("b", True), ("a", False), ("c", False), ("c", True)])
    assert list(message.transfer_ids) == ["b", "c"]
    assert list(message.unwatch_transfer_ids) == ["a"]
    assert request_messages([]) == []


def test_request_messages_respect_the_daemons_bound() -> None:
    ids = [(f"t{i}", True) for i in range(2 * MAX_IDS_PER_MESSAGE + 1)]
    messages = request_messages(ids)
    assert [len(m.transfer_ids) for m in messages] == [MAX_IDS_PER_MESSAGE, MAX_IDS_PER_MESSAGE, 1]


def test_a_status_that_is_not_final_fails_its_waiter_internal() -> None:
    """A daemon answering a state that is not final is broken: the waiter gets Internal."""
    import concurrent.futures

    book = WatchBook()
    waiter: concurrent.futures.Future[Any] = concurrent.futures.Future()
    book.add("t", waiter)
    book.settle(finished(common_pb2.TransferStatus(transfer_id="t", state=common_pb2.TRANSFER_STATE_READING)))
    assert isinstance(waiter.exception(), errors.Internal)


# -- the asyncio front end --------------------------------------------------------------------------


class FakeAioCall:
    """One WatchTransfers call: reads the client's request generator; answers what the test says."""

    def __init__(self, requests: AsyncIterator[router_pb2.WatchTransfersRequest]) -> None:
        self.requests: list[router_pb2.WatchTransfersRequest] = []
        self._responses: asyncio.Queue[Any] = asyncio.Queue()
        self.cancelled = False
        self._pump = asyncio.get_running_loop().create_task(self._read(requests))

    async def _read(self, requests: AsyncIterator[router_pb2.WatchTransfersRequest]) -> None:
        async for request in requests:
            self.requests.append(request)

    def respond(self, item: Any) -> None:
        self._responses.put_nowait(item)

    @property
    def sent(self) -> list[str]:
        return [tid for r in self.requests for tid in r.transfer_ids]

    @property
    def unwatched(self) -> list[str]:
        return [tid for r in self.requests for tid in r.unwatch_transfer_ids]

    def __aiter__(self) -> FakeAioCall:
        return self

    async def __anext__(self) -> router_pb2.WatchTransfersResponse:
        item = await self._responses.get()
        if item is END:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item  # type: ignore[no-any-return]

    def cancel(self) -> None:
        self.cancelled = True
        self._responses.put_nowait(asyncio.CancelledError())


class FakeAioStub:
    def __init__(self) -> None:
        self.calls: list[FakeAioCall] = []

    def WatchTransfers(self, requests: AsyncIterator[router_pb2.WatchTransfersRequest]) -> FakeAioCall:
        self.calls.append(FakeAioCall(requests))
        return self.calls[-1]


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_aio_waits_share_one_stream_and_their_ids_go_out_together() -> None:
    """32 waits started together: one stream, one message with every id; each waiter gets its own
    answer, errors as the exact class the daemon named."""

    async def main() -> None:
        stub = FakeAioStub()
        watch = AsyncTransferWatch(stub)  # type: ignore[arg-type]
        waits = [asyncio.create_task(watch.wait(f"t{i}", 5)) for i in range(32)]
        await settle()
        (call,) = stub.calls
        assert len(call.requests) == 1 and sorted(call.sent) == sorted(f"t{i}" for i in range(32))
        call.respond(hello())
        call.respond(finished(*(done(f"t{i}", i) for i in range(31))))
        call.respond(finished(failed("t31", "UNAVAILABLE", "PeerUnavailable")))
        results = await asyncio.gather(*waits, return_exceptions=True)
        assert [r.bytes for r in results[:31]] == list(range(31))  # type: ignore[union-attr]
        assert type(results[31]) is errors.PeerUnavailable and "t31 failed" in str(results[31])
        assert len(stub.calls) == 1
        await watch.close()

    asyncio.run(main())


def test_aio_two_waiters_on_one_id_send_it_once_and_both_hear() -> None:
    async def main() -> None:
        stub = FakeAioStub()
        watch = AsyncTransferWatch(stub)  # type: ignore[arg-type]
        first = asyncio.create_task(watch.wait("t", 5))
        await settle()
        second = asyncio.create_task(watch.wait("t", 5))
        await settle()
        (call,) = stub.calls
        assert call.sent == ["t"]
        call.respond(hello())
        call.respond(refused("t", "NOT_FOUND", "UnknownTransfer"))
        for waiter in (first, second):
            with pytest.raises(errors.UnknownTransfer):
                await waiter
        await watch.close()

    asyncio.run(main())


def test_aio_a_wait_that_times_out_unwatches_its_id() -> None:
    async def main() -> None:
        stub = FakeAioStub()
        watch = AsyncTransferWatch(stub)  # type: ignore[arg-type]
        with pytest.raises(errors.DeadlineExceeded, match="t1 did not end within 0.05 s"):
            await watch.wait("t1", 0.05)
        await settle()
        (call,) = stub.calls
        assert call.sent == ["t1"] and call.unwatched == ["t1"]
        await watch.close()

    asyncio.run(main())


def test_aio_a_stream_that_breaks_after_its_first_message_is_opened_again() -> None:
    """The ids still waited on are sent again on a new stream, and answered there."""

    async def main() -> None:
        stub = FakeAioStub()
        watch = AsyncTransferWatch(stub)  # type: ignore[arg-type]
        waits = [asyncio.create_task(watch.wait(t, 5)) for t in ("a", "b")]
        await settle()
        first = stub.calls[0]
        first.respond(hello())
        first.respond(finished(done("a")))
        assert (await waits[0]).transfer_id == "a"
        first.respond(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "connection reset"))
        await settle()
        assert len(stub.calls) == 2
        second = stub.calls[1]
        assert second.sent == ["b"]
        second.respond(hello())
        second.respond(finished(done("b")))
        assert (await waits[1]).transfer_id == "b"
        # The daemon ending the stream OK while a wait is pending: opened again too.
        third_wait = asyncio.create_task(watch.wait("c", 5))
        await settle()
        second.respond(END)
        await settle()
        third = stub.calls[2]
        assert third.sent == ["c"]
        third.respond(hello())
        third.respond(finished(done("c")))
        assert (await third_wait).transfer_id == "c"
        await watch.close()

    asyncio.run(main())


def test_aio_a_stream_that_fails_before_its_first_message_fails_every_waiter() -> None:
    """Unreachable or shutting down: each waiter gets the stream's error (Unavailable), nothing
    retries; the next wait opens a new stream."""

    async def main() -> None:
        stub = FakeAioStub()
        watch = AsyncTransferWatch(stub)  # type: ignore[arg-type]
        waits = [asyncio.create_task(watch.wait(t, 5)) for t in ("a", "b")]
        await settle()
        stub.calls[0].respond(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "the daemon is shutting down", "Unavailable"))
        for waiter in waits:
            with pytest.raises(errors.Unavailable, match="shutting down"):
                await waiter
        await settle()
        assert len(stub.calls) == 1
        later = asyncio.create_task(watch.wait("c", 5))
        await settle()
        assert len(stub.calls) == 2 and stub.calls[1].sent == ["c"]
        stub.calls[1].respond(hello())
        stub.calls[1].respond(finished(done("c")))
        assert (await later).transfer_id == "c"
        await watch.close()

    asyncio.run(main())


def test_aio_a_restarted_daemon_fails_the_transfers_it_lost() -> None:
    """Re-opened onto another incarnation: the ids waited on before fail Unavailable (lost with
    the daemon), not UnknownTransfer; a wait started after the re-open is answered normally."""

    async def main() -> None:
        stub = FakeAioStub()
        watch = AsyncTransferWatch(stub)  # type: ignore[arg-type]
        old = asyncio.create_task(watch.wait("old", 5))
        await settle()
        stub.calls[0].respond(hello("inc-1"))
        stub.calls[0].respond(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "socket closed"))
        await settle()
        new = asyncio.create_task(watch.wait("new", 5))
        await settle()
        second = stub.calls[1]
        assert second.sent == ["old", "new"]
        second.respond(hello("inc-2"))
        second.respond(refused("old", "NOT_FOUND", "UnknownTransfer"))
        second.respond(finished(done("new")))
        with pytest.raises(errors.Unavailable, match="restarted"):
            await old
        assert (await new).transfer_id == "new"
        await watch.close()

    asyncio.run(main())


def test_aio_a_daemon_without_watch_transfers_is_remembered() -> None:
    async def main() -> None:
        stub = FakeAioStub()
        watch = AsyncTransferWatch(stub)  # type: ignore[arg-type]
        wait = asyncio.create_task(watch.wait("t", 5))
        await settle()
        stub.calls[0].respond(FakeRpcError(grpc.StatusCode.UNIMPLEMENTED, "Method not found!"))
        with pytest.raises(errors.KvdError) as info:
            await wait
        assert info.value.code is errors.ErrorCode.UNIMPLEMENTED and watch.supported is False
        await watch.close()

    asyncio.run(main())


def test_aio_close_cancels_the_stream_and_every_waiter() -> None:
    async def main() -> None:
        stub = FakeAioStub()
        watch = AsyncTransferWatch(stub)  # type: ignore[arg-type]
        wait = asyncio.create_task(watch.wait("t", None))
        await settle()
        stub.calls[0].respond(hello())
        await settle()
        await watch.close()
        with pytest.raises(errors.Cancelled):
            await wait
        assert stub.calls[0].cancelled and len(stub.calls) == 1
        with pytest.raises(errors.Cancelled):
            await watch.wait("u", 1)

    asyncio.run(main())


def test_aio_wait_many_reports_each_outcome_in_order() -> None:
    async def main() -> None:
        stub = FakeAioStub()
        watch = AsyncTransferWatch(stub)  # type: ignore[arg-type]
        many = asyncio.create_task(watch.wait_many(["a", "b", "c", "d"], 0.2))
        await settle()
        call = stub.calls[0]
        assert call.sent == ["a", "b", "c", "d"]
        call.respond(hello())
        call.respond(finished(done("c"), failed("a", "DEADLINE_EXCEEDED", "LeaseExpired")))
        call.respond(refused("d", "RESOURCE_EXHAUSTED", "ResourceExhausted"))
        a, b, c, d = await many
        assert isinstance(a, errors.LeaseExpired)
        assert isinstance(b, errors.DeadlineExceeded) and "b did not end" in b.message
        assert isinstance(c, common_pb2.TransferStatus) and c.transfer_id == "c"
        assert isinstance(d, errors.ResourceExhausted)
        await settle()
        assert call.unwatched == ["b"]
        await watch.close()

    asyncio.run(main())


# -- the thread front end ---------------------------------------------------------------------------


class FakeSyncCall:
    """The blocking twin of FakeAioCall: a thread reads the client's request iterator."""

    def __init__(self, requests: Iterator[router_pb2.WatchTransfersRequest]) -> None:
        self.requests: list[router_pb2.WatchTransfersRequest] = []
        self._responses: queue.Queue[Any] = queue.Queue()
        self.cancelled = False
        threading.Thread(target=self._read, args=(requests,), daemon=True).start()

    def _read(self, requests: Iterator[router_pb2.WatchTransfersRequest]) -> None:
        for request in requests:
            self.requests.append(request)

    def respond(self, item: Any) -> None:
        self._responses.put(item)

    @property
    def sent(self) -> list[str]:
        return [tid for r in list(self.requests) for tid in r.transfer_ids]

    @property
    def unwatched(self) -> list[str]:
        return [tid for r in list(self.requests) for tid in r.unwatch_transfer_ids]

    def __iter__(self) -> FakeSyncCall:
        return self

    def __next__(self) -> router_pb2.WatchTransfersResponse:
        item = self._responses.get()
        if item is END:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item  # type: ignore[no-any-return]

    def cancel(self) -> None:
        self.cancelled = True
        self._responses.put(FakeRpcError(grpc.StatusCode.CANCELLED, "Locally cancelled by application!"))


class FakeSyncStub:
    def __init__(self) -> None:
        self.calls: list[FakeSyncCall] = []
        self.opened = threading.Condition()

    def WatchTransfers(self, requests: Iterator[router_pb2.WatchTransfersRequest]) -> FakeSyncCall:
        with self.opened:
            self.calls.append(FakeSyncCall(requests))
            self.opened.notify_all()
            return self.calls[-1]

    def call(self, index: int) -> FakeSyncCall:
        with self.opened:
            assert self.opened.wait_for(lambda: len(self.calls) > index, 5.0)
            return self.calls[index]


def until(predicate: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.002)


def in_thread(fn: Any, *args: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_sync_waits_from_many_threads_share_one_stream() -> None:
    stub = FakeSyncStub()
    watch = TransferWatch(stub)  # type: ignore[arg-type]
    waits = [in_thread(watch.wait, f"t{i}", 5.0) for i in range(8)]
    call = stub.call(0)
    until(lambda: len(call.sent) == 8)
    call.respond(hello())
    call.respond(finished(*(done(f"t{i}", i) for i in range(7)), failed("t7", "NOT_FOUND", "HeldKvEvicted")))
    for thread, _ in waits:
        thread.join(5)
    assert [out[0].bytes for _, out in waits[:7]] == list(range(7))
    assert type(waits[7][1][0]) is errors.HeldKvEvicted
    assert len(stub.calls) == 1
    watch.close()


def test_sync_a_stream_that_breaks_after_its_first_message_is_opened_again() -> None:
    stub = FakeSyncStub()
    watch = TransferWatch(stub)  # type: ignore[arg-type]
    thread, out = in_thread(watch.wait, "b", 5.0)
    first = stub.call(0)
    until(lambda: first.sent == ["b"])
    first.respond(hello())
    first.respond(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "connection reset"))
    second = stub.call(1)
    until(lambda: second.sent == ["b"])
    second.respond(hello())
    second.respond(finished(done("b")))
    thread.join(5)
    assert out[0].transfer_id == "b"
    watch.close()


def test_sync_a_stream_that_fails_before_its_first_message_fails_every_waiter() -> None:
    stub = FakeSyncStub()
    watch = TransferWatch(stub)  # type: ignore[arg-type]
    waits = [in_thread(watch.wait, t, 5.0) for t in ("a", "b")]
    call = stub.call(0)
    until(lambda: len(call.sent) == 2)
    call.respond(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "connection refused"))
    for thread, out in waits:
        thread.join(5)
        assert isinstance(out[0], errors.Unavailable)
    assert len(stub.calls) == 1
    watch.close()


def test_sync_a_wait_that_times_out_unwatches_its_id_and_close_cancels() -> None:
    stub = FakeSyncStub()
    watch = TransferWatch(stub)  # type: ignore[arg-type]
    with pytest.raises(errors.DeadlineExceeded):
        watch.wait("t1", 0.05)
    call = stub.call(0)
    until(lambda: call.unwatched == ["t1"])
    call.respond(hello())
    thread, out = in_thread(watch.wait, "t2", None)
    until(lambda: "t2" in call.sent)
    watch.close()
    thread.join(5)
    assert isinstance(out[0], errors.Cancelled) and call.cancelled
    results = watch.wait_many([], 1.0)
    assert results == []
    with pytest.raises(errors.Cancelled):
        watch.wait("t3", 1.0)
