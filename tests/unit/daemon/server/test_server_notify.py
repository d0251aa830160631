"""kvd.server.notify against a real AF_UNIX datagram socket, the way systemd listens."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvd.server.notify import Notifier, watchdog


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "notify")
    sock.bind(path)
    sock.settimeout(5.0)
    yield sock, path
    sock.close()


def _fields(datagram: bytes) -> dict[str, str]:
    return dict(line.split("=", 1) for line in datagram.decode().split("\n"))


def test_ready_status_stopping_are_key_value_datagrams(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    notifier = Notifier(path)
    assert notifier.ready("serving on 127.0.0.1:1")
    assert _fields(sock.recv(4096)) == {"READY": "1", "STATUS": "serving on 127.0.0.1:1", "MAINPID": str(os.getpid())}
    assert notifier.status("2 engines")
    assert _fields(sock.recv(4096)) == {"STATUS": "2 engines"}
    assert notifier.stopping("stopping")
    assert _fields(sock.recv(4096)) == {"STOPPING": "1", "STATUS": "stopping"}
    notifier.close()


def test_abstract_namespace_socket() -> None:
    """NOTIFY_SOCKET=@name is the abstract namespace (a leading NUL), as systemd may hand it out."""
    name = f"kvd-test-notify-{os.getpid()}-{time.monotonic_ns()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(5.0)
    try:
        assert Notifier("@" + name).status("hello")
        assert _fields(sock.recv(4096)) == {"STATUS": "hello"}
    finally:
        sock.close()


def test_no_socket_means_no_op_and_a_missing_socket_never_raises(tmp_path: Path) -> None:
    assert not Notifier("").ready("x")
    gone = Notifier(str(tmp_path / "nobody-listens"))
    assert not gone.ready("x") and not gone.send(watchdog=1)  # warned once, never raised


def test_watchdog_pings_stop_while_the_event_loop_is_wedged(listener: tuple[socket.socket, str]) -> None:
    """WATCHDOG=1 comes from a task on the event loop: while the loop is blocked nothing is sent,
    so systemd (WatchdogSec=) restarts a wedged daemon; the pings resume when the loop runs again.
    The receiver is a thread of its own (like systemd, outside the loop), stamping arrivals: a
    pinging thread would keep arriving during the wedge."""
    sock, path = listener
    received: list[float] = []
    done = threading.Event()

    def receive() -> None:
        sock.settimeout(0.05)
        while not done.is_set():
            try:
                if _fields(sock.recv(4096)) == {"WATCHDOG": "1"}:
                    received.append(time.monotonic())
            except TimeoutError:
                continue

    receiver = threading.Thread(target=receive, daemon=True)
    receiver.start()
    wedge = [0.0, 0.0]

    async def run() -> None:
        pinger = asyncio.get_running_loop().create_task(watchdog(Notifier(path), 0.2))  # a ping every 0.1 s
        await asyncio.sleep(0.5)
        wedge[0] = time.monotonic()
        time.sleep(1.5)  # wedge the loop: a blocking call on the event loop thread
        wedge[1] = time.monotonic()
        await asyncio.sleep(0.5)
        pinger.cancel()

    asyncio.run(run())
    time.sleep(0.2)
    done.set()
    receiver.join(5.0)
    start, end = wedge
    assert [t for t in received if t < start], "no pings before the wedge"
    assert [t for t in received if t > end], "no pings after the wedge"
    assert not [t for t in received if start + 0.05 < t < end - 0.05], "a ping arrived while the loop was wedged"
