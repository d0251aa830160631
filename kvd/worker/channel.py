"""The worker's sending end of the data-plane channel: whole frames from any thread, never blocking.

Most replies are sent from the worker's event loop, but the replies to ``reads`` and ``ping``,
settled READs and notifications are sent by the NIXL thread itself, as they happen: going
through the event loop cost each of them a thread hand-off (a wake-up of the loop, a callback,
a task resumed), ~60-80 µs of every round trip to the NIXL thread (``DataPlane.ping`` p50 on
this 2-core VM: 174-213 µs through the loop, 95-143 µs sent directly).

**One order.** Every frame is written whole under one lock, so frames never interleave and go
out in the order their senders took the lock. A READ's reply is sent by the NIXL thread before
it polls that READ, so its ``SETTLED`` always follows it.

**Never blocking.** A frame is written with a non-blocking ``sendmsg``. What the socket does not
take at once waits in a queue, later frames queue behind it (order holds), and the event loop
drains it when the socket is writable (``add_writer``). So the NIXL thread never waits for a slow
or stopped control process: it must keep polling, peers read this worker's memory through it.

**Owner, thread, lifetime.** The writer owns a duplicate of the channel's socket, made on the
event loop when the worker starts serving and closed by :meth:`close` on the event loop, under
the lock: a thread sending after that finds the writer closed, never a reused fd number. A
control process that is gone breaks the socket: frames are dropped from then on (the reading
side sees the end of the channel, and the worker exits).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import threading
from typing import Any

from kvd.dataplane_protocol import frame

logger = logging.getLogger(__name__)

IOV_PER_SEND = 512  # iovecs per sendmsg (Linux takes at most 1,024; a frame may have 2,050 parts)


class ChannelWriter:
    """Frames to the control process, from any thread; see the module docstring."""

    def __init__(self, sock: socket.socket | Any, loop: asyncio.AbstractEventLoop) -> None:
        self._sock = socket.socket(fileno=socket.dup(sock.fileno()))
        self._sock.setblocking(False)  # the channel's socket is non-blocking already (asyncio's)
        self._fd = self._sock.fileno()
        self._loop = loop
        self._lock = threading.Lock()
        self._queue: collections.deque[memoryview] = collections.deque()  # what the socket did not take yet
        self._draining = False  # the loop watches the socket for writability (queue not empty)
        self._broken = False  # the control process is gone: drop every frame
        self._closed = False

    @property
    def queued_bytes(self) -> int:
        with self._lock:
            return sum(view.nbytes for view in self._queue)

    def send(self, message: tuple[Any, ...]) -> None:
        """Send one message (any thread; never waits). Raises only if it cannot be framed, and
        then nothing of it is sent."""
        views = [memoryview(part).cast("B") for part in frame(message)]
        with self._lock:
            if self._closed or self._broken:
                return
            if not self._queue:
                views = self._write(views)
                if not views:
                    return
            self._queue.extend(views)
            if not self._draining and not self._broken:
                self._draining = True
                self._loop.call_soon_threadsafe(self._watch)

    def close(self) -> None:
        """Stop sending and close the duplicate socket (event loop; queued frames are dropped)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.clear()
            if self._draining:
                self._loop.remove_writer(self._fd)
                self._draining = False
            self._sock.close()

    # --- internals (lock held) ------------------------------------------------------------------

    def _write(self, views: list[memoryview]) -> list[memoryview]:
        """Write as much of ``views`` as the socket takes now; return the rest."""
        while views:
            try:
                sent = self._sock.sendmsg(views[:IOV_PER_SEND])
            except (BlockingIOError, InterruptedError):
                return views
            except OSError as exc:  # the control process is gone (EPIPE, ECONNRESET)
                if not self._broken:
                    logger.debug("the data-plane channel is broken: %s", exc)
                self._broken = True
                return []
            done = 0
            while done < len(views) and sent >= views[done].nbytes:
                sent -= views[done].nbytes
                done += 1
            views = views[done:]
            if sent:
                views[0] = views[0][sent:]
        return views

    # --- the event loop ---------------------------------------------------------------------------

    def _watch(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._loop.add_writer(self._fd, self._drain)

    def _drain(self) -> None:
        with self._lock:
            if self._closed:
                return
            left = self._write(list(self._queue)) if not self._broken else []
            self._queue.clear()
            if left:
                self._queue.extend(left)
                return
            self._draining = False
            self._loop.remove_writer(self._fd)
