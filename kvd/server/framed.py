"""What the daemon's two framed listeners share (kvd.server.engine_frames, kvd.server.peer_frames):
the server and its connections (:class:`FramedListener`), a stream's end as its status, and the
connection's close after it."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

from kvd.server.edge import bounded
from kvd_client.errors import KvdError
from kvd_client.v1 import common_pb2

LINGER_S = 0.5
"""How long a connection is kept after its end frame for the caller to read it and close: closed
with the caller's bytes still unread, the kernel would reset it and the end frame could be lost."""


def end_of(error: KvdError) -> common_pb2.StreamEnd:
    """A stream's end frame for ``error``: its code, message (bounded as a gRPC status is) and class."""
    return common_pb2.StreamEnd(code=error.code.value, message=bounded(error.message), error_class=type(error).__name__)


async def finish(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, last: bytes | None, linger: bool) -> None:
    """Send ``last`` (the end frame), then close: after the caller closed its side or
    :data:`LINGER_S` passed, reading and dropping what it still sends (``linger``: not at shutdown)."""
    with contextlib.suppress(ConnectionError, OSError, RuntimeError, ssl.SSLError):
        if last is not None:
            writer.write(last)
        if linger:
            if writer.can_write_eof():
                writer.write_eof()
            async with asyncio.timeout(LINGER_S):
                while await reader.read(1 << 16):
                    pass
    with contextlib.suppress(TimeoutError, ConnectionError, OSError, RuntimeError, ssl.SSLError):
        writer.close()


Run = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[common_pb2.StreamEnd]]


class FramedListener:
    """One framed listener's server and connections: each connection runs ``run`` in a task of its
    own and gets the end ``run`` returns as its last frame (``end_frame`` encodes it); a caller that
    went away gets nothing; :meth:`stop` ends every connection with ``at_shutdown``, as a gRPC
    server's stop ends its calls UNAVAILABLE. Event-loop only."""

    def __init__(self, run: Run, end_frame: Callable[[common_pb2.StreamEnd], bytes], at_shutdown: KvdError) -> None:
        self._run = run
        self._end_frame = end_frame
        self._at_shutdown = at_shutdown
        self.server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._connections)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The server's callback for one connection (pass it to asyncio's start_server)."""
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        end: common_pb2.StreamEnd | None = None
        shutting_down = False
        try:
            end = await self._run(reader, writer)
        except asyncio.CancelledError:  # stop(): the connection's own task, ended here on purpose
            shutting_down = True
            end = end_of(self._at_shutdown)
        except (ConnectionError, OSError, ssl.SSLError):
            pass  # the caller went away: nobody to tell
        finally:
            self._connections.discard(task)
            await finish(reader, writer, self._end_frame(end) if end is not None else None, linger=not shutting_down)

    async def stop(self) -> None:
        """Stop listening and end every connection (with ``at_shutdown``)."""
        if self.server is not None:
            self.server.close()
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.gather(*self._connections, return_exceptions=True)
        if self.server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 5.0)
            self.server = None
