"""The engine stream over the daemon's framed Unix socket, without gRPC (both front ends).

A daemon serves its engine stream (EngineService.EngineStream: commits, post-forward signals,
pulls started, completions) a second way beside gRPC: on ``<unix_socket>.stream``, the same
protobuf messages in length-prefixed frames (``DaemonFrame`` in proto/kvd/v1/engine.proto says
how). On the engine's hop a message there costs a fraction of a gRPC stream message's time
(docs/performance.md, "The engine stream without gRPC"), and a pull crosses that hop twice. The
socket sits beside the gRPC one, with the same owner, group and mode, so whoever may use one may
use the other and nobody else can.

The engine stream front ends (kvd_client._aio_engine_stream, and kvd_client._engine_stream
generated from it) use :class:`AsyncFramedCall` / :class:`FramedCall` in place of a gRPC call where
the daemon serves the socket (connecting falls back to gRPC where it does not: an older daemon).
Both are written here side by side, as kvd_client._background is: the one real difference between
the twins, asyncio streams or a blocking socket and a writer thread, lives here once.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from collections.abc import AsyncIterator, Iterator

from google.protobuf.message import DecodeError, Message

from kvd_client.v1 import common_pb2, engine_pb2

from . import errors
from .channel import MAX_MESSAGE_BYTES, is_unix_target, normalize_target

MAGIC = b"KVDSTRM1"
"""What an engine writes first on the framed socket: the protocol and its version."""
SUFFIX = ".stream"
"""The framed socket's path is the gRPC Unix socket's with this appended."""
MAX_FRAME_BYTES = MAX_MESSAGE_BYTES
"""Largest frame either way (gRPC's message limit on the same stream)."""
HEADER = struct.Struct(">I")


def stream_socket_path(target: str) -> str | None:
    """Where the daemon at ``target`` serves the framed engine stream: the path of its Unix
    socket with :data:`SUFFIX` appended; None for a target that is not a Unix socket path."""
    if not target or not is_unix_target(target):
        return None
    normalized = normalize_target(target)
    if not normalized.startswith("unix:"):
        return None  # an abstract socket has no path to sit beside
    path = normalized[len("unix:") :]
    if path.startswith("//"):
        path = path[2:]
    return path + SUFFIX if path else None


def encode(message: Message) -> bytes:
    """One frame: the message's length, then its bytes (ValueError past MAX_FRAME_BYTES)."""
    body = message.SerializeToString()
    if len(body) > MAX_FRAME_BYTES:
        raise ValueError(f"a frame of {len(body)} bytes is over the {MAX_FRAME_BYTES}-byte limit")
    return HEADER.pack(len(body)) + body


def frame_length(header: bytes) -> int:
    """The length a frame's header names; InvalidArgument past MAX_FRAME_BYTES."""
    (length,) = HEADER.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise errors.InvalidArgument(f"a frame of {length} bytes is over the {MAX_FRAME_BYTES}-byte limit")
    return length


def end_error(end: common_pb2.StreamEnd) -> errors.KvdError | None:
    """The error a stream's end frame names (its exact class), or None for a clean end."""
    if not end.code:
        return None
    try:
        code = errors.ErrorCode(end.code)
    except ValueError:
        code = errors.ErrorCode.UNKNOWN
    return errors.from_status(code, end.message, end.error_class)


def _message_of(body: bytes) -> engine_pb2.DaemonMessage | None:
    """A frame's message; None for a clean end; the exact error an end frame names, raised."""
    try:
        frame = engine_pb2.DaemonFrame.FromString(body)
    except DecodeError as exc:
        raise errors.Internal(f"the daemon sent a frame that is not a DaemonFrame: {exc}") from None
    if frame.WhichOneof("kind") == "message":
        return frame.message
    error = end_error(frame.end)
    if error is not None:
        raise error
    return None


def _died(path: str) -> errors.Unavailable:
    return errors.Unavailable(f"the daemon closed the engine stream on {path} without ending it (it stopped?)")


class AsyncFramedCall:
    """One framed engine stream on the running event loop: ``requests`` are written by a task as
    they come, the daemon's messages are read by iterating; ends as a grpc.aio call would."""

    def __init__(self, path: str, requests: AsyncIterator[engine_pb2.EngineMessage]) -> None:
        self.path = path
        self._requests = requests
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._writing: asyncio.Task[None] | None = None
        self._cancelled = False

    async def connect(self) -> None:
        """Connect and start writing; OSError where nothing serves the socket (use gRPC then)."""
        self._reader, self._writer = await asyncio.open_unix_connection(self.path, limit=1 << 20)
        self._writer.write(MAGIC)
        self._writing = asyncio.get_running_loop().create_task(self._write(), name=f"kvd-frames-writer-{self.path}")

    async def _write(self) -> None:
        writer = self._writer
        assert writer is not None
        with contextlib.suppress(ConnectionError, OSError):  # the read side reports how it ended
            async for message in self._requests:
                writer.write(encode(message))
                await writer.drain()
            writer.write_eof()  # the engine's half-close

    def __aiter__(self) -> AsyncIterator[engine_pb2.DaemonMessage]:
        return self._messages()

    async def _messages(self) -> AsyncIterator[engine_pb2.DaemonMessage]:
        reader = self._reader
        assert reader is not None
        while True:
            try:
                body = await reader.readexactly(frame_length(await reader.readexactly(HEADER.size)))
            except (asyncio.IncompleteReadError, ConnectionError, OSError):
                raise errors.Cancelled("engine stream cancelled") if self._cancelled else _died(self.path) from None
            message = _message_of(body)
            if message is None:
                return
            yield message

    def cancel(self) -> None:
        """Drop the stream (the daemon sees the connection close, as for a cancelled call)."""
        self._cancelled = True
        if self._writing is not None:
            self._writing.cancel()
        if self._writer is not None:
            self._writer.close()


class FramedCall:
    """One framed engine stream on a blocking socket: ``requests`` are written by a thread of its
    own as they come, the daemon's messages are read by iterating; ends as a grpc call would."""

    def __init__(self, path: str, requests: Iterator[engine_pb2.EngineMessage]) -> None:
        self.path = path
        self._requests = requests
        self._sock: socket.socket | None = None
        self._cancelled = False

    def connect(self) -> None:
        """Connect and start writing; OSError where nothing serves the socket (use gRPC then)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.path)
            sock.sendall(MAGIC)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        threading.Thread(target=self._write, name=f"kvd-frames-writer-{self.path}", daemon=True).start()

    def _write(self) -> None:
        sock = self._sock
        assert sock is not None
        with contextlib.suppress(ConnectionError, OSError):  # the read side reports how it ended
            for message in self._requests:
                sock.sendall(encode(message))
            sock.shutdown(socket.SHUT_WR)  # the engine's half-close

    def __iter__(self) -> Iterator[engine_pb2.DaemonMessage]:
        return self._messages()

    def _messages(self) -> Iterator[engine_pb2.DaemonMessage]:
        sock = self._sock
        assert sock is not None
        while True:
            try:
                body = self._read_exactly(sock, frame_length(self._read_exactly(sock, HEADER.size)))
            except (ConnectionError, OSError, EOFError):
                raise errors.Cancelled("engine stream cancelled") if self._cancelled else _died(self.path) from None
            message = _message_of(body)
            if message is None:
                return
            yield message

    @staticmethod
    def _read_exactly(sock: socket.socket, size: int) -> bytes:
        chunks = []
        while size:
            chunk = sock.recv(min(size, 1 << 20))
            if not chunk:
                raise EOFError
            chunks.append(chunk)
            size -= len(chunk)
        return b"".join(chunks)

    def cancel(self) -> None:
        """Drop the stream (the daemon sees the connection close, as for a cancelled call); the
        reading thread wakes with the socket shut down."""
        self._cancelled = True
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
