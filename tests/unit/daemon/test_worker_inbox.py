"""The NIXL thread's own inbox (kvd.worker.nixl_thread.OwnerThread.attach_inbox).

The worker's READ orders arrive on a socket that the NIXL thread reads itself, woken by the
socket (no event loop, no hand-off). What must hold: an order is read on that thread, with no
submit or wake, even while the thread sleeps with nothing to poll; an order sent before a command
is taken before that command runs (a list's release must never overtake a READ that names it);
an inbox that ends, or whose reader fails, is no longer watched and costs the thread nothing (no
spin, no death); and a
wake after the thread ended is harmless.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from kvd.worker.nixl_thread import OwnerThread

WAIT_S = 5.0


class Inbox:
    """A socketpair whose reading end the owner thread watches; records what it read, on which thread."""

    def __init__(self, read_fails: bool = False) -> None:
        self.ours, self.theirs = socket.socketpair()
        self.theirs.setblocking(False)
        self.read_fails = read_fails
        self.got = bytearray()
        self.threads: set[str] = set()
        self.calls = 0
        self.arrived = threading.Event()

    def read(self) -> bool:
        self.calls += 1
        self.threads.add(threading.current_thread().name)
        if self.read_fails:
            raise RuntimeError("a bad order")
        while True:
            try:
                data = self.theirs.recv(4096)
            except BlockingIOError:
                return True
            if not data:
                return False
            self.got += data
            self.arrived.set()

    def close(self) -> None:
        self.ours.close()
        self.theirs.close()


@pytest.fixture
def started() -> Iterator[Callable[[Inbox], OwnerThread]]:
    threads: list[OwnerThread] = []

    def start(inbox: Inbox) -> OwnerThread:
        owner = OwnerThread("kvd-nixl-test", lambda: None, lambda: None)  # nothing to poll: sleeps until woken
        owner.attach_inbox(inbox.theirs, inbox.read)
        owner.start()
        threads.append(owner)
        return owner

    yield start
    for owner in threads:
        owner.stopping = True
        owner.wake()
        assert owner.thread is not None
        owner.thread.join(WAIT_S)
        assert not owner.thread.is_alive()


def test_an_order_wakes_the_sleeping_thread_and_is_read_on_it_with_no_wake(
    started: Callable[[Inbox], OwnerThread],
) -> None:
    inbox = Inbox()
    started(inbox)
    time.sleep(0.05)  # asleep in select, with no timeout (nothing to poll)
    inbox.ours.sendall(b"order-1")
    assert inbox.arrived.wait(WAIT_S)
    assert bytes(inbox.got) == b"order-1"
    assert inbox.threads == {"kvd-nixl-test"}
    inbox.close()


def test_an_order_sent_before_a_command_is_taken_before_the_command_runs(
    started: Callable[[Inbox], OwnerThread],
) -> None:
    """The thread is held inside a command; an order is sent, then a second command is
    submitted. When the first lets go, the second must find the order taken already: the
    thread drains its inbox before every command, not only when select says so."""
    inbox = Inbox()
    owner = started(inbox)
    holding, go = threading.Event(), threading.Event()

    def hold() -> None:
        holding.set()
        assert go.wait(WAIT_S)

    first = owner.submit(hold)
    assert holding.wait(WAIT_S)
    inbox.ours.sendall(b"read-names-table-7")
    second = owner.submit(lambda: bytes(inbox.got))  # the release of table 7, say
    go.set()
    first.result(WAIT_S)
    assert second.result(WAIT_S) == b"read-names-table-7"
    inbox.close()


def test_an_inbox_that_ends_is_no_longer_watched_and_the_thread_goes_on(
    started: Callable[[Inbox], OwnerThread],
) -> None:
    inbox = Inbox()
    owner = started(inbox)
    inbox.ours.close()  # the control process closed its end
    deadline = time.monotonic() + WAIT_S
    while owner._inbox is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert owner._inbox is None
    calls = inbox.calls
    time.sleep(0.1)
    assert inbox.calls == calls  # an ended socket is readable for good: it must not be read again
    assert owner.submit(lambda: "still serving").result(WAIT_S) == "still serving"
    inbox.theirs.close()


def test_a_reader_that_fails_is_logged_and_the_thread_survives(
    started: Callable[[Inbox], OwnerThread], caplog: pytest.LogCaptureFixture
) -> None:
    inbox = Inbox(read_fails=True)
    owner = started(inbox)
    inbox.ours.sendall(b"x")
    assert owner.submit(lambda: "alive").result(WAIT_S) == "alive"
    assert inbox.calls == 1
    time.sleep(0.1)
    assert inbox.calls == 1  # the byte it left unread keeps the socket readable: no longer watched, no spin
    assert owner._inbox is None
    assert "reading the NIXL thread's inbox failed" in caplog.text
    inbox.close()


def test_a_wake_after_the_thread_ended_does_nothing(started: Callable[[Inbox], OwnerThread]) -> None:
    inbox = Inbox()
    owner = started(inbox)
    owner.stopping = True
    owner.wake()
    assert owner.thread is not None
    owner.thread.join(WAIT_S)
    assert not owner.thread.is_alive()
    owner.wake()  # its event fd is closed: never written (nor a reused fd number)
    assert owner.submit(lambda: None).exception(WAIT_S) is not None  # stopped: refused, not queued
    inbox.close()


def test_an_inbox_closed_under_the_sleeping_thread_is_reported_by_its_reader_never_dropped_silently(
    started: Callable[[Inbox], OwnerThread], caplog: pytest.LogCaptureFixture
) -> None:
    """A socket closed under the waiting thread: the reader is asked (and finds it broken, so
    its owner can end the worker) rather than the inbox quietly going unread."""
    inbox = Inbox()
    owner = started(inbox)
    time.sleep(0.05)
    inbox.theirs.close()
    owner.wake()
    deadline = time.monotonic() + WAIT_S
    while owner._inbox is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert owner._inbox is None
    assert inbox.calls >= 1  # its reader was asked, and failed
    assert "NIXL thread's inbox failed" in caplog.text  # waiting on it, or reading it: either way, said
    assert owner.submit(lambda: "still serving").result(WAIT_S) == "still serving"
    inbox.ours.close()
