"""One asyncio client's ``WatchTransfers`` stream: every transfer wait of the client rides it.

The rules (what a response settles, when a stream is re-opened, how ids are batched) are
:mod:`kvd_client._watch_book`'s, shared with the thread front end
(:mod:`kvd_client._transfer_watch`). Here: a task reads the stream, and the request side is an
async generator fed from a queue, so that every id queued while a message is being written goes
out in the next one. The stream opens at the first wait and lives as long as the client (an
idle stream costs the daemon nothing). Use it from the event loop that created the client.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence

import grpc

from kvd_client.v1 import common_pb2, router_pb2, router_pb2_grpc

from . import errors
from ._watch_book import (
    CLOSE,
    Order,
    PullStart,
    WatchBook,
    ended_by_daemon,
    outcomes,
    pull_took_too_long,
    request_messages,
    stream_failure,
    waited_too_long,
)

logger = logging.getLogger(__name__)

_Order = Order


class AsyncTransferWatch:
    """The WatchTransfers stream one :class:`~kvd_client.aio.AsyncKvdClient` waits on."""

    def __init__(self, stub: router_pb2_grpc.RouterServiceStub, target: str = "") -> None:
        self._stub = stub
        self._target = target
        self._book = WatchBook()
        self._outbox: asyncio.Queue[_Order | object] | None = None
        self._call: grpc.aio.StreamStreamCall | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    @property
    def supported(self) -> bool:
        """False once the daemon answered UNIMPLEMENTED (one older than 0.2.0): wait on WatchTransfer."""
        return self._book.supported

    async def wait(self, transfer_id: str, timeout: float | None) -> common_pb2.TransferStatus:
        """The transfer's DONE status, or the exact error it failed with; DeadlineExceeded after
        ``timeout`` seconds (None: no limit)."""
        waiter: asyncio.Future[common_pb2.TransferStatus] = asyncio.get_running_loop().create_future()
        self._register(transfer_id, waiter)
        try:
            return await asyncio.wait_for(waiter, timeout)
        except TimeoutError:
            raise waited_too_long(transfer_id, timeout or 0.0) from None
        finally:
            self._forget(transfer_id, waiter)

    async def pull(
        self, request: router_pb2.StartPullRequest, timeout: float | None
    ) -> common_pb2.TransferStatus | None:
        """Start ``request`` on the stream and wait for its end: its DONE status, or the exact error
        it failed with (its start's refusal included); DeadlineExceeded after ``timeout`` seconds
        (the pull goes on). None when the stream does not start pulls now (it is not open yet, or
        the daemon predates it): start it with StartPull and wait on it."""
        waiter: asyncio.Future[common_pb2.TransferStatus] = asyncio.get_running_loop().create_future()
        start = self._register_start(request, waiter)
        if start is None:
            return None
        try:
            return await asyncio.wait_for(waiter, timeout)
        except TimeoutError:
            raise pull_took_too_long(start, timeout or 0.0) from None
        finally:
            if self._book.discard_start(start):
                self._forget(start.transfer_id, waiter)

    async def wait_many(
        self, transfer_ids: Sequence[str], timeout: float | None
    ) -> list[common_pb2.TransferStatus | errors.KvdError]:
        """Per id, in order, its DONE status or its error (returned, not raised); an id still
        running after ``timeout`` seconds gets DeadlineExceeded."""
        loop = asyncio.get_running_loop()
        waiters: list[asyncio.Future[common_pb2.TransferStatus]] = []
        try:
            for transfer_id in transfer_ids:
                waiters.append(loop.create_future())
                self._register(transfer_id, waiters[-1])
            if waiters:
                await asyncio.wait(waiters, timeout=timeout)
            return outcomes(transfer_ids, waiters, timeout)
        finally:
            for transfer_id, waiter in zip(transfer_ids, waiters, strict=False):
                waiter.cancel()
                self._forget(transfer_id, waiter)

    async def close(self) -> None:
        """End the stream; whoever still waits gets Cancelled. Idempotent."""
        self._closing = True
        call, task = self._call, self._task
        if self._outbox is not None:
            self._outbox.put_nowait(CLOSE)
        if call is not None:
            call.cancel()
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)
        self._book.fail_all(errors.Cancelled("the client was closed while waiting on the transfer"))

    # -- the stream ---------------------------------------------------------------------------

    def _register(self, transfer_id: str, waiter: asyncio.Future[common_pb2.TransferStatus]) -> None:
        if self._closing:
            raise errors.Cancelled("the client is closed")
        if not self._book.add(transfer_id, waiter):
            return
        if self._task is None:
            self._open()  # sends every id waited on, this one with them
        else:
            assert self._outbox is not None
            self._outbox.put_nowait((transfer_id, True))

    def _register_start(
        self, request: router_pb2.StartPullRequest, waiter: asyncio.Future[common_pb2.TransferStatus]
    ) -> PullStart | None:
        if self._closing:
            raise errors.Cancelled("the client is closed")
        if self._task is None:
            self._open()  # for the next pull: this one goes by StartPull
            return None
        start = self._book.add_start(request, waiter)
        if start is not None:
            assert self._outbox is not None
            self._outbox.put_nowait(router_pb2.WatchedPullStart(seq=start.seq, pull=request))
        return start

    def _forget(self, transfer_id: str, waiter: asyncio.Future[common_pb2.TransferStatus]) -> None:
        if self._book.discard(transfer_id, waiter) and self._task is not None and self._outbox is not None:
            self._outbox.put_nowait((transfer_id, False))

    def _open(self) -> None:
        outbox: asyncio.Queue[_Order | object] = asyncio.Queue()
        for transfer_id in self._book.stream_opened():
            outbox.put_nowait((transfer_id, True))
        self._outbox = outbox
        call = self._stub.WatchTransfers(self._requests(outbox))
        self._call = call
        self._task = asyncio.get_running_loop().create_task(
            self._receive(call, outbox), name=f"kvd-transfer-watch-{self._target}"
        )

    async def _requests(
        self, outbox: asyncio.Queue[_Order | object]
    ) -> AsyncIterator[router_pb2.WatchTransfersRequest]:
        """What grpc sends: every order queued since the last message, in as few messages as fit."""
        while True:
            item = await outbox.get()
            orders: list[_Order] = []
            while item is not CLOSE:
                orders.append(item)  # type: ignore[arg-type]
                if outbox.empty():
                    break
                item = outbox.get_nowait()
            for message in request_messages(orders):
                yield message
            if item is CLOSE:
                return

    async def _receive(self, call: grpc.aio.StreamStreamCall, outbox: asyncio.Queue[_Order | object]) -> None:
        """Task body: settle each response until the stream ends, then decide what comes next."""
        error: errors.KvdError
        try:
            async for response in call:
                self._book.settle(response)
            error = ended_by_daemon()
        except asyncio.CancelledError:
            if not self._closing:  # the loop is going away: no stream to open, nobody to wait
                self._task = self._call = self._outbox = None
                self._book.fail_all(errors.Cancelled("the transfer watch stream was cancelled"))
                raise
            error = errors.Cancelled("the client was closed")
        except Exception as exc:  # noqa: BLE001 - an RpcError, or what killed the task: stream_failure logs it
            error = stream_failure(exc, self._target)
        self._ended(error, outbox)

    def _ended(self, error: errors.KvdError, outbox: asyncio.Queue[_Order | object]) -> None:
        outbox.put_nowait(CLOSE)  # ends the request generator if grpc still reads it
        self._task = self._call = self._outbox = None
        if self._closing:
            return
        if self._book.stream_ended(error):
            logger.info("transfer watch stream to %s ended (%s); opening another", self._target, error)
            self._open()
        else:
            logger.debug("transfer watch stream to %s ended: %s", self._target, error)
