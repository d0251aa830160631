"""One blocking client's ``WatchTransfers`` stream: every transfer wait of the client rides it.

The thread twin of :mod:`kvd_client._aio_transfer_watch`, with the same rules
(:mod:`kvd_client._watch_book`): a background thread reads the stream, grpc's request thread
sends what the waiting threads queued (every id queued while a message is being written goes out
in the next one), and a lock guards the book, since any thread may wait. The stream opens at the
first wait and lives as long as the client.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from collections.abc import Iterator, Sequence
from typing import Any

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
_Future = concurrent.futures.Future[common_pb2.TransferStatus]

CLOSE_TIMEOUT_S = 5.0
"""How long close() waits for the stream's thread after cancelling the RPC."""


class TransferWatch:
    """The WatchTransfers stream one :class:`~kvd_client.sync.KvdClient` waits on (thread-safe)."""

    def __init__(self, stub: router_pb2_grpc.RouterServiceStub, target: str = "") -> None:
        self._stub = stub
        self._target = target
        self._lock = threading.Lock()
        self._book = WatchBook()
        self._outbox: queue.SimpleQueue[_Order | object] | None = None
        self._call: Any = None
        self._thread: threading.Thread | None = None
        self._closing = False

    @property
    def supported(self) -> bool:
        """False once the daemon answered UNIMPLEMENTED (one older than 0.2.0): wait on WatchTransfer."""
        return self._book.supported

    def wait(self, transfer_id: str, timeout: float | None) -> common_pb2.TransferStatus:
        """The transfer's DONE status, or the exact error it failed with; DeadlineExceeded after
        ``timeout`` seconds (None: no limit)."""
        waiter: _Future = concurrent.futures.Future()
        self._register(transfer_id, waiter)
        try:
            return waiter.result(timeout)
        except TimeoutError:
            raise waited_too_long(transfer_id, timeout or 0.0) from None
        finally:
            self._forget(transfer_id, waiter)

    def pull(self, request: router_pb2.StartPullRequest, timeout: float | None) -> common_pb2.TransferStatus | None:
        """Start ``request`` on the stream and wait for its end: its DONE status, or the exact error
        it failed with (its start's refusal included); DeadlineExceeded after ``timeout`` seconds
        (the pull goes on). None when the stream does not start pulls now (it is not open yet, or
        the daemon predates it): start it with StartPull and wait on it."""
        waiter: _Future = concurrent.futures.Future()
        start = self._register_start(request, waiter)
        if start is None:
            return None
        try:
            return waiter.result(timeout)
        except TimeoutError:
            raise pull_took_too_long(start, timeout or 0.0) from None
        finally:
            with self._lock:
                answered = self._book.discard_start(start)
            if answered:
                self._forget(start.transfer_id, waiter)

    def wait_many(
        self, transfer_ids: Sequence[str], timeout: float | None
    ) -> list[common_pb2.TransferStatus | errors.KvdError]:
        """Per id, in order, its DONE status or its error (returned, not raised); an id still
        running after ``timeout`` seconds gets DeadlineExceeded."""
        waiters: list[_Future] = []
        try:
            for transfer_id in transfer_ids:
                waiters.append(concurrent.futures.Future())
                self._register(transfer_id, waiters[-1])
            if waiters:
                concurrent.futures.wait(waiters, timeout=timeout)
            return outcomes(transfer_ids, waiters, timeout)
        finally:
            for transfer_id, waiter in zip(transfer_ids, waiters, strict=False):
                self._forget(transfer_id, waiter)

    def close(self) -> None:
        """End the stream; whoever still waits gets Cancelled. Idempotent."""
        with self._lock:
            self._closing = True
            call, thread = self._call, self._thread
            if self._outbox is not None:
                self._outbox.put(CLOSE)
        if call is not None:
            call.cancel()
        if thread is not None and thread is not threading.current_thread():
            thread.join(CLOSE_TIMEOUT_S)
        with self._lock:
            self._book.fail_all(errors.Cancelled("the client was closed while waiting on the transfer"))

    # -- the stream ---------------------------------------------------------------------------

    def _register(self, transfer_id: str, waiter: _Future) -> None:
        with self._lock:
            if self._closing:
                raise errors.Cancelled("the client is closed")
            if not self._book.add(transfer_id, waiter):
                return
            if self._thread is None:
                self._open()  # sends every id waited on, this one with them
            else:
                assert self._outbox is not None
                self._outbox.put((transfer_id, True))

    def _register_start(self, request: router_pb2.StartPullRequest, waiter: _Future) -> PullStart | None:
        with self._lock:
            if self._closing:
                raise errors.Cancelled("the client is closed")
            if self._thread is None:
                self._open()  # for the next pull: this one goes by StartPull
                return None
            start = self._book.add_start(request, waiter)
            if start is not None:
                assert self._outbox is not None
                self._outbox.put(router_pb2.WatchedPullStart(seq=start.seq, pull=request))
            return start

    def _forget(self, transfer_id: str, waiter: _Future) -> None:
        with self._lock:
            if self._book.discard(transfer_id, waiter) and self._thread is not None and self._outbox is not None:
                self._outbox.put((transfer_id, False))

    def _open(self) -> None:
        """Open a stream (under the lock)."""
        outbox: queue.SimpleQueue[_Order | object] = queue.SimpleQueue()
        for transfer_id in self._book.stream_opened():
            outbox.put((transfer_id, True))
        self._outbox = outbox
        call = self._stub.WatchTransfers(self._requests(outbox))
        self._call = call
        self._thread = threading.Thread(
            target=self._receive, args=(call, outbox), name=f"kvd-transfer-watch-{self._target}", daemon=True
        )
        self._thread.start()

    @staticmethod
    def _requests(outbox: queue.SimpleQueue[_Order | object]) -> Iterator[router_pb2.WatchTransfersRequest]:
        """What grpc's request thread sends: every order queued since the last message."""
        while True:
            item = outbox.get()
            orders: list[_Order] = []
            while item is not CLOSE:
                orders.append(item)  # type: ignore[arg-type]
                try:
                    item = outbox.get_nowait()
                except queue.Empty:
                    break
            yield from request_messages(orders)
            if item is CLOSE:
                return

    def _receive(self, call: Any, outbox: queue.SimpleQueue[_Order | object]) -> None:
        """Thread body: settle each response until the stream ends, then decide what comes next."""
        error: errors.KvdError
        try:
            for response in call:
                with self._lock:
                    self._book.settle(response)
            error = ended_by_daemon()
        except Exception as exc:  # noqa: BLE001 - an RpcError, or what killed the thread: stream_failure logs it
            error = stream_failure(exc, self._target)
        with self._lock:
            outbox.put(CLOSE)  # frees grpc's request thread if it waits in get()
            self._thread = self._call = self._outbox = None
            if self._closing:
                return
            if self._book.stream_ended(error):
                logger.info("transfer watch stream to %s ended (%s); opening another", self._target, error)
                self._open()
            else:
                logger.debug("transfer watch stream to %s ended: %s", self._target, error)
