"""The engine stream over the daemon's framed Unix socket, without gRPC (kvd_client._frames says
why; proto/kvd/v1/engine.proto, ``DaemonFrame``, says how).

:class:`EngineFrames` serves ``<unix_socket>.stream``. Each connection is one engine stream, run
by the very servicer method that runs the gRPC one (:meth:`EngineServicer.EngineStream`, with its
edge: kvd.server.edge.rpc), so the two ways share every rule (hello first, supersession, pulls
on the stream, batches). What gRPC did around it is done here the same way: every frame parsed and
bounded as kvd.server.authz parses every gRPC request (kvd.server.request_bounds), the stream's
end sent as its status would be (a ``StreamEnd``: code, message, exact error class), the client's
version noted from its hello (kvd.server.client_versions). Who may connect is who may use the
gRPC socket: the file has the same owner, group and mode (kvd.server.startup), and a Unix-socket
caller holds the engine's roles there (kvd.server.authz).

Hostile or broken input ends that stream alone, INVALID_ARGUMENT, having changed nothing: a wrong
first 8 bytes, a frame over the size limit, bytes that are not an EngineMessage, a stream cut
inside a frame, and a connection that sends nothing within :data:`HELLO_TIMEOUT_S`.
Event-loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from typing import cast

import grpc

from kvd.core.metrics import Metrics
from kvd.server.client_versions import ClientVersionLog
from kvd.server.edge import as_kvd_error
from kvd.server.engine_servicer import EngineServicer
from kvd.server.framed import FramedListener, end_of
from kvd.server.request_bounds import check_request, parser_of
from kvd_client._frames import HEADER, MAGIC, encode, frame_length
from kvd_client.errors import ERROR_CLASS_METADATA_KEY, InvalidArgument, KvdError, Unavailable
from kvd_client.v1 import common_pb2, engine_pb2

logger = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 10.0
"""A connection must send its first 8 bytes and its hello within this (a stuck or idle opener is
dropped instead of holding a task and a descriptor for good)."""
READ_LIMIT = 1 << 20  # the stream reader's buffer; frames above it are read in pieces
METHOD = "/kvd.v1.EngineService/EngineStream"  # what the client's version note names
_parse = parser_of(engine_pb2.EngineMessage)


class _Ended(Exception):
    """The stream's status, raised by :meth:`FramedContext.abort` as grpc.aio's abort raises."""

    def __init__(self, code: int, message: str, error_class: str) -> None:
        super().__init__(message)
        self.end = common_pb2.StreamEnd(code=code, message=message, error_class=error_class)


class FramedContext:
    """What the edge (kvd.server.edge) and the engine servicer ask of a gRPC servicer context."""

    def __init__(self) -> None:
        self._error_class = ""

    def set_trailing_metadata(self, metadata: Iterable[tuple[str, str]]) -> None:
        for key, value in metadata:
            if key == ERROR_CLASS_METADATA_KEY:
                self._error_class = value

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise _Ended(code.value[0], details, self._error_class)


class EngineFrames:
    """The framed engine-stream listener of one daemon (module docstring)."""

    def __init__(self, path: str, servicer: EngineServicer, metrics: Metrics, versions: ClientVersionLog) -> None:
        self.path = path
        self._servicer = servicer
        self._metrics = metrics
        self._versions = versions
        self._listener = FramedListener(
            self._run,
            lambda end: encode(engine_pb2.DaemonFrame(end=end)),
            Unavailable("the daemon is shutting down: open the stream on its replacement"),
        )

    async def start(self) -> None:
        """Listen (the caller cleared a stale socket and sets the file's group and mode, as for
        the gRPC socket: kvd.server.startup)."""
        self._listener.server = await asyncio.start_unix_server(self._listener.serve, path=self.path, limit=READ_LIMIT)

    async def stop(self) -> None:
        """Stop listening and end every stream UNAVAILABLE (as the gRPC server's stop ends its calls)."""
        await self._listener.stop()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    @property
    def streams(self) -> int:
        """Connections open now."""
        return len(self._listener)

    async def _run(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> common_pb2.StreamEnd:
        """Run one stream to its end; the end to send (OK, or the status it failed with)."""
        context = FramedContext()
        try:
            try:
                magic = await asyncio.wait_for(reader.readexactly(len(MAGIC)), HELLO_TIMEOUT_S)
            except (TimeoutError, asyncio.IncompleteReadError):
                raise InvalidArgument(
                    f"not a kvd engine stream: it must begin with {MAGIC!r} within {HELLO_TIMEOUT_S:.0f} s"
                ) from None
            if magic != MAGIC:
                raise InvalidArgument(f"not a kvd engine stream: it must begin with {MAGIC!r}, got {magic!r}")
            stream = cast(
                AsyncGenerator[engine_pb2.DaemonMessage, None],
                self._servicer.EngineStream(self._requests(reader), context),  # type: ignore[arg-type]
            )
            async with contextlib.aclosing(stream):  # a broken write still runs the servicer's end
                async for message in stream:
                    writer.write(encode(engine_pb2.DaemonFrame(message=message)))
                    await writer.drain()
        except _Ended as ended:  # the servicer's edge mapped an error (counted there)
            return ended.end
        except KvdError as exc:  # refused before the servicer ran (its edge never saw it)
            return end_of(as_kvd_error(self._metrics, "EngineStream", exc))
        return common_pb2.StreamEnd()

    async def _requests(self, reader: asyncio.StreamReader) -> AsyncIterator[engine_pb2.EngineMessage]:
        """The engine's messages, each parsed and bounded as a gRPC request is; ends at the
        engine's half-close (the end of its bytes, between two frames)."""
        first = True
        while True:
            try:
                header = await self._read(reader, HEADER.size, first)
            except asyncio.IncompleteReadError as exc:
                if exc.partial:
                    raise InvalidArgument("the engine stream ended inside a frame's length") from None
                return
            length = frame_length(header)
            try:
                body = await self._read(reader, length, first)
            except asyncio.IncompleteReadError:
                raise InvalidArgument(f"the engine stream ended inside a frame of {length} bytes") from None
            message: engine_pb2.EngineMessage = check_request(_parse(body))  # type: ignore[assignment]
            if first:
                first = False
                if message.WhichOneof("kind") == "hello" and message.hello.user_agent:
                    self._versions.note((("user-agent", message.hello.user_agent),), METHOD)
            yield message

    @staticmethod
    async def _read(reader: asyncio.StreamReader, size: int, first: bool) -> bytes:
        if not first:
            return await reader.readexactly(size)
        try:
            return await asyncio.wait_for(reader.readexactly(size), HELLO_TIMEOUT_S)
        except TimeoutError:
            raise InvalidArgument(f"no hello within {HELLO_TIMEOUT_S:.0f} s of connecting") from None
