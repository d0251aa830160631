"""The one thread that drives a NIXL agent: calls run on it in order, heartbeats between them,
polls between calls.

NIXL's UCX worker must never be driven by two threads at once, and over shared memory UCX copies
a READ inside the call that posts it: so kvd.worker.nixl_agent runs every NIXL call on this
thread, and the control process's heartbeats wait apart from the calls, answered between any two
of them (and wherever the agent calls :meth:`OwnerThread.answer_heartbeats`, e.g. between the
READs of one batch), so a working thread is never mistaken for a hung one. A thread stuck inside
one NIXL call still answers nothing: that is what the heartbeat detects.

Between calls the thread polls (``poll``) and then sleeps for ``interval()`` seconds, or until a
call or :meth:`OwnerThread.wake` wakes it; the agent decides both (what to poll, how often).

**Its own inbox.** The thread may also read one socket itself (:meth:`OwnerThread.attach_inbox`:
the worker's READ orders, kvd.worker.service). It sleeps in ``select`` on that socket and an
eventfd that ``submit``/``wake`` write, so a READ order wakes this thread directly: no event
loop reads it first, and no second thread hands it over (what that saved: docs/performance.md).
Before each command it drains the inbox, so an order already sent is taken before a call that
was sent after it on the other channel (a list's release, say).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kvd_client.errors import Unavailable

logger = logging.getLogger(__name__)
T = TypeVar("T")


class OwnerThread:
    """Runs submitted calls, answers heartbeats and polls, all on one thread (named ``name``)."""

    def __init__(self, name: str, poll: Callable[[], None], interval: Callable[[], float | None]) -> None:
        self._name = name
        self._poll = poll  # between calls; an exception is logged and the thread goes on
        self._interval = interval  # seconds to sleep after a poll; None: until woken
        # (call, its future): each counts as activity (heartbeats, which do not, wait apart below)
        self._commands: collections.deque[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = (
            collections.deque()
        )
        # Heartbeats (``activity=False``) wait apart: answered between commands and wherever the
        # owner calls answer_heartbeats.
        self._heartbeats: collections.deque[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = (
            collections.deque()
        )
        # Written by submit/wake (any thread), read by this thread's select: its only sleep.
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._wake_lock = threading.Lock()  # the eventfd is closed under it: never a reused fd number
        self._wake_closed = False
        self._inbox: socket.socket | None = None
        self._read_inbox: Callable[[], bool] = lambda: False
        self.stopping = False
        self.thread: threading.Thread | None = None
        self.active_at = time.monotonic()  # the last call (the agent adds its reads and notifications)

    def attach_inbox(self, sock: socket.socket, read: Callable[[], bool]) -> None:
        """Have this thread read ``sock`` itself (before :meth:`start`): ``read`` runs on it
        whenever the socket may have data (and before each command), must not block, and
        returns False once the socket has ended. Then, or if it raises, the socket is no longer
        watched (its owner decides what that means: the worker ends, kvd.worker.service)."""
        self._inbox, self._read_inbox = sock, read

    def start(self) -> None:
        self.thread = threading.Thread(target=self.run, name=self._name, daemon=True)
        self.thread.start()

    def submit(self, fn: Callable[[], T], activity: bool = True) -> concurrent.futures.Future[T]:
        """Run ``fn`` on the owner thread (any thread may call this). ``activity=False``: a
        heartbeat, which must not count as activity (see kvd.worker.nixl_agent.DORMANT_AFTER_S)."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self.stopping or self.thread is None:
            future.set_exception(Unavailable("the NIXL data plane is stopped"))
            return future
        if activity:
            self._commands.append((fn, future))
        else:
            self._heartbeats.append((fn, future))
        if not self.on_thread():  # this thread runs it before it sleeps
            self.wake()
        return future

    async def call(self, fn: Callable[[], T], activity: bool = True) -> T:
        """Run ``fn`` on the owner thread and wait for it (the call itself is not cancelled)."""
        return await asyncio.shield(asyncio.wrap_future(self.submit(fn, activity)))

    def on_thread(self) -> bool:
        """Whether the caller is this thread (then a call may run at once, not queued)."""
        return threading.current_thread() is self.thread

    def wake(self) -> None:
        """End the thread's sleep now (it polls again, and asks ``interval`` anew)."""
        with self._wake_lock:
            if not self._wake_closed:
                os.eventfd_write(self._wake_fd, 1)

    def run(self) -> None:
        """The thread's loop (``start`` runs it; tests run it on a thread of their own)."""
        while True:
            # Popped one at a time, never iterated: other threads append while this one runs
            # (iterating the deque raised "deque mutated during iteration" and ended the thread:
            # its worker was then killed as hung).
            self.answer_heartbeats()
            while self._commands:
                if self._inbox is not None:
                    self._take_inbox()  # orders sent before this command go first
                fn, future = self._commands.popleft()
                self.active_at = time.monotonic()
                _run_into(fn, future)
                self.answer_heartbeats()
            if self.stopping and not self._commands and not self._heartbeats:
                with self._wake_lock:
                    self._wake_closed = True
                    os.close(self._wake_fd)
                return
            try:
                self._poll()
            except Exception:  # the owner thread must survive a NIXL hiccup: log and go on
                logger.exception("polling NIXL failed")
            self._sleep(self._interval())

    def _sleep(self, timeout: float | None) -> None:
        """Until ``timeout`` passes, a submit or wake, or the inbox has data (then it is read)."""
        if self._commands or self._heartbeats:  # submitted from this thread (no wake): run them now
            timeout = 0.0
        # select, not epoll: epoll_wait counts whole milliseconds, and the fast poll is 0.2 ms.
        # Both fds are among the process's first (made before NIXL and UCX open theirs).
        watched: list[Any] = [self._wake_fd] if self._inbox is None else [self._wake_fd, self._inbox]
        try:
            ready, _, _ = select.select(watched, [], [], None if timeout is None else max(0.0, timeout))
        except (OSError, ValueError):
            # The inbox's socket broke under us: its reader finds out and says so (the worker
            # ends), never a silent stop that would leave orders unread.
            logger.exception("waiting on the NIXL thread's inbox failed")
            if self._inbox is not None:
                self._take_inbox()
            time.sleep(0.001)  # never a spin, whatever keeps failing
            return
        if self._wake_fd in ready:
            os.eventfd_read(self._wake_fd)  # resets it (it is readable, so this cannot block)
        if self._inbox is not None and self._inbox in ready:
            self._take_inbox()

    def _take_inbox(self) -> None:
        try:
            still_open = self._read_inbox()
        except Exception:  # the thread must survive it; what is left unread would wake it for good
            logger.exception("reading the NIXL thread's inbox failed: it is no longer read")
            still_open = False
        if not still_open:
            self._inbox = None

    def answer_heartbeats(self) -> None:
        """Run the heartbeats waiting (owner thread only). Called between commands, and by the
        agent between the READs of one batch and the pieces of one READ: a batch of READs copied
        within their posts must not make a working thread miss the control process's heartbeat
        and be killed as hung."""
        while self._heartbeats:  # popped one at a time: other threads append meanwhile
            fn, future = self._heartbeats.popleft()
            _run_into(fn, future)

    async def stop(self) -> bool:
        """Stop the thread after the queued calls; False where it never started."""
        if self.thread is None:
            return False
        self.stopping = True
        self.wake()
        await asyncio.get_running_loop().run_in_executor(None, self.thread.join, 5.0)
        return True


def _run_into(fn: Callable[[], T], future: concurrent.futures.Future[T]) -> None:
    """Run a submitted call and settle its future with the result or the exception."""
    if future.set_running_or_notify_cancel():
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - the caller gets it through the future
            future.set_exception(exc)
