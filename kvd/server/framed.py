"""What the daemon's two framed listeners share (kvd.server.engine_frames, kvd.server.peer_frames):
a stream's end as its status, and the connection's close after it."""

from __future__ import annotations

import asyncio
import contextlib
import ssl

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
