"""Daemon-to-daemon calls on one long-lived stream per peer (``PeerService/PeerStream``).

A pull costs its holder a PreparePull (and, sometimes, FinishRead or AbandonPull); readers
renew and release leases. As unary calls each is a new HTTP/2 stream with its headers, its
deadline and its trailers on both sides: most of the CPU a pull spent in gRPC. On one stream
per peer a call is a message, and calls that queue while a message is being written go out
together in the next one (replies likewise): batches form by themselves under load, and an
idle stream sends each call at once (no timer, no wait).

The semantics are the unary calls', call by call:

* **errors** come back as the same kvd classes (code, message and class in the reply, as a unary
  call's status and trailers carry them);
* **deadlines**: the caller gives up after ``timeout_s`` (``PeerUnavailable``, as a unary call
  past its deadline), and the holder stops working on the call then (``PeerCall.timeout_ms``);
* **cancellation**: a caller that stops waiting withdraws its call (``PeerCall.cancel``), and the
  holder cancels its work, as gRPC cancels a unary call's handler;
* **a broken stream** fails every call waiting on it with the stream's status (unreachable:
  ``PeerUnavailable``); the next call opens a new stream on the same channel;
* **authorization**: the stream needs role ``peer`` when it opens (kvd.server.authz), on the
  same (mTLS) channel as the unary calls; every message is bounds-checked as any request is.

**Owners and threads.** Everything runs on the daemon's event loop. :func:`serve_peer_stream`
(the holder's half) owns one task per call in flight and ends them with the stream.
:class:`PeerStreamCaller` (the reader's half) owns one gRPC stream call, its writer and reader
tasks, and the futures of the calls in flight on it; ``close()`` ends them all.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import itertools
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import grpc

from kvd.core.metrics import Metrics
from kvd.server.edge import as_kvd_error, bounded
from kvd_client.errors import (
    DeadlineExceeded,
    ErrorCode,
    InvalidArgument,
    KvdError,
    PeerUnavailable,
    ResourceExhausted,
    from_status,
)
from kvd_client.grpc_errors import error_class_name, rpc_error_code, rpc_error_details
from kvd_client.v1 import peer_pb2, peer_pb2_grpc

logger = logging.getLogger(__name__)

PeerHandler = Callable[[Any], Awaitable[Any]]
PeerHandlers = Mapping[str, PeerHandler]

# The unary method each kind of call stands for: errors are counted under the same operation.
OPERATIONS = {
    "prepare_pull": "PreparePull",
    "abandon_pull": "AbandonPull",
    "finish_read": "FinishRead",
    "renew_leases": "RenewLeases",
    "release_leases": "ReleaseLeases",
}
MAX_CALLS_IN_FLIGHT = 4096  # per stream; more is RESOURCE_EXHAUSTED, call by call
# The holder stops reading a stream's calls while this many replies' bytes wait for the caller
# to read them (HTTP/2 flow control then holds the caller back), and sends replies in messages
# of at most this many bytes, well under gRPC's 64 MiB message limit.
MAX_PENDING_REPLY_BYTES = 64 << 20
MAX_REPLIES_MESSAGE_BYTES = 16 << 20


# --- the holder's half ----------------------------------------------------------------------------


async def serve_peer_stream(
    requests: AsyncIterator[peer_pb2.PeerCalls], handlers: PeerHandlers, metrics: Metrics | None
) -> AsyncIterator[peer_pb2.PeerReplies]:
    """Run every call of the stream as its own task; yield their replies, batched.

    Ends once the caller half-closed and every call is answered, or with the error of a
    malformed message (the servicer's edge turns it into the stream's status). A stream the
    caller cancels (or whose connection drops) cancels the calls still running.
    """
    loop = asyncio.get_running_loop()
    ready: collections.deque[tuple[peer_pb2.PeerReply, int]] = collections.deque()  # replies, encoded sizes
    pending_bytes = 0
    wake = asyncio.Event()  # a reply is ready, a call ended, or the caller's side is done
    room = asyncio.Event()  # replies went out or calls ended: the reader may read more calls
    running: dict[int, asyncio.Task[None]] = {}

    def answer(reply: peer_pb2.PeerReply) -> None:
        nonlocal pending_bytes
        size = reply.ByteSize()
        ready.append((reply, size))
        pending_bytes += size
        wake.set()

    def forget(call_id: int, task: asyncio.Task[None]) -> None:
        # A done callback, not the call's own ``finally``: a call cancelled before it first ran
        # (its cancel in the same message) never enters its body.
        if running.get(call_id) is task:
            del running[call_id]
        wake.set()
        room.set()

    async def run(call: peer_pb2.PeerCall, kind: str) -> None:
        operation = OPERATIONS[kind]
        timeout_s = call.timeout_ms / 1000 if call.timeout_ms else None
        try:
            async with asyncio.timeout(timeout_s):
                response = await handlers[kind](getattr(call, kind))
            answer(peer_pb2.PeerReply(call_id=call.call_id, **{kind: response}))
        except asyncio.CancelledError:
            return  # withdrawn by the caller, or the stream ended: nobody waits for a reply
        except TimeoutError:
            # As a unary call past its deadline: no class, so the caller sees the peer unreachable.
            answer(
                _error_reply(call.call_id, DeadlineExceeded(f"{operation} did not finish in time"), with_class=False)
            )
        except Exception as exc:  # noqa: BLE001 - every failure goes back to its caller, typed
            answer(_error_reply(call.call_id, as_kvd_error(metrics, operation, exc)))

    def accept(call: peer_pb2.PeerCall) -> None:
        if call.cancel:
            task = running.pop(call.call_id, None)  # withdrawn: its id is free again at once
            if task is not None:
                task.cancel()  # its done callback wakes the stream, which may be over
            return
        kind = call.WhichOneof("call")
        if kind is None or kind not in handlers:
            answer(_error_reply(call.call_id, InvalidArgument(f"peer call {call.call_id} names no call kvd serves")))
        elif call.call_id in running:
            answer(_error_reply(call.call_id, InvalidArgument(f"peer call id {call.call_id} is already in flight")))
        elif len(running) >= MAX_CALLS_IN_FLIGHT:
            answer(
                _error_reply(
                    call.call_id,
                    ResourceExhausted(f"{MAX_CALLS_IN_FLIGHT} peer calls are already in flight on this stream"),
                )
            )
        else:
            task = loop.create_task(run(call, kind), name=f"kvd-peer-call-{kind}")
            running[call.call_id] = task
            task.add_done_callback(functools.partial(forget, call.call_id))

    def full() -> bool:
        return len(running) + len(ready) >= MAX_CALLS_IN_FLIGHT or pending_bytes >= MAX_PENDING_REPLY_BYTES

    async def read() -> None:
        try:
            async for message in requests:
                for call in message.calls:
                    accept(call)
                while full():  # a caller that does not read its replies is not read either
                    room.clear()
                    await room.wait()
        finally:
            wake.set()

    reader = loop.create_task(read(), name="kvd-peer-stream-reader")
    try:
        while True:
            await wake.wait()
            wake.clear()
            while ready:
                batch: list[peer_pb2.PeerReply] = []
                batch_bytes = 0
                while ready and (not batch or batch_bytes + ready[0][1] <= MAX_REPLIES_MESSAGE_BYTES):
                    reply, size = ready.popleft()
                    batch.append(reply)
                    batch_bytes += size
                yield peer_pb2.PeerReplies(replies=batch)
                pending_bytes -= batch_bytes
                room.set()
            if reader.done():
                if reader.exception() is not None:
                    reader.result()  # a malformed message ends the stream with its error
                if not running and not ready:
                    return
    finally:
        reader.cancel()
        for task in list(running.values()):
            task.cancel()


def _error_reply(call_id: int, error: KvdError, with_class: bool = True) -> peer_pb2.PeerReply:
    return peer_pb2.PeerReply(
        call_id=call_id,
        code=error.code.value,
        error_message=bounded(error.message),
        error_class=type(error).__name__ if with_class else "",
    )


# --- the reader's half ----------------------------------------------------------------------------


class PeerStreamCaller:
    """Calls to one peer daemon over its PeerStream; opened on first use, reopened after a break.
    Where the peer serves the stream on a framed port too (kvd.server.peer_frames), calls go
    there once it is connected, and back on gRPC's stream if that one breaks."""

    def __init__(self, address: str, stub: Callable[[], peer_pb2_grpc.PeerServiceStub]) -> None:
        self.address = address
        self._stub = stub
        self._ids = itertools.count(1)
        self._stream: _OpenStream | None = None
        self._framed: _OpenStream | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._closed = False

    def open(self) -> None:
        """Open the stream now (after a handshake), so the first pull does not wait for it."""
        self._current()

    @property
    def framed(self) -> bool:
        """Whether calls go on the peer's framed stream now."""
        return self._framed is not None and self._framed.broken is None

    def open_frames(self, connect: Callable[[], Awaitable[Any]]) -> None:
        """Connect the peer's framed stream in the background (a handshake named its port):
        calls go on it once connected, on gRPC's stream until then and wherever it cannot be."""
        if self._closed or self.framed or (self._connecting is not None and not self._connecting.done()):
            return
        self._connecting = asyncio.get_running_loop().create_task(
            self._connect_frames(connect), name=f"kvd-peer-frames-{self.address}"
        )

    async def _connect_frames(self, connect: Callable[[], Awaitable[Any]]) -> None:
        try:
            call = await connect()
        except (OSError, TimeoutError, ssl.SSLError, KvdError) as exc:
            logger.info("peer daemon %s: its framed stream is out of reach (%s): calls go over gRPC", self.address, exc)
            return
        if self._closed:
            call.cancel()
            return
        self._framed = _OpenStream(self.address, call)

    def _current(self) -> _OpenStream:
        if self._closed:
            raise PeerUnavailable(f"peer daemon {self.address}: this daemon dropped it")
        framed = self._framed
        if framed is not None and framed.broken is None:
            return framed
        stream = self._stream
        if stream is None or stream.broken is not None:
            stream = self._stream = _OpenStream(self.address, self._stub().PeerStream())
        return stream

    def submit(self, kind: str, request: Any, timeout_s: float) -> SubmittedCall:
        """Queue one call now, without awaiting anything: it leaves with the stream's next write
        (the writer task's, or :meth:`flush`'s). Its answer is :meth:`SubmittedCall.reply`'s."""
        stream = self._current()
        call_id = next(self._ids)
        future = stream.submit(
            peer_pb2.PeerCall(call_id=call_id, timeout_ms=max(1, int(timeout_s * 1000)), **{kind: request})
        )
        deadline = asyncio.get_running_loop().time() + timeout_s
        return SubmittedCall(stream, call_id, future, kind, request, timeout_s, deadline)

    async def call(self, kind: str, request: Any, timeout_s: float, what: str) -> Any:
        """Make one call and return its response (the message of its kind)."""
        return await self.submit(kind, request, timeout_s).reply(what)

    def flush(self) -> None:
        """Write the calls queued so far now, where the stream can take them without waiting
        (:meth:`_OpenStream.flush`); the rest leave with the writer task's next write."""
        for stream in (self._framed, self._stream):
            if stream is not None:
                stream.flush()

    async def close(self) -> None:
        self._closed = True
        if self._connecting is not None:
            self._connecting.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._connecting
        for stream in (self._stream, self._framed):
            if stream is not None:
                await stream.close()
        self._stream = self._framed = None


class StreamUnsupported(Exception):
    """The peer does not serve PeerStream (an older kvd): the call was not run; make it unary."""

    def __init__(self, address: str) -> None:
        super().__init__(f"peer daemon {address} does not serve PeerStream")
        self.address = address


class StreamBroken(Exception):
    """The stream a call waited on ended before its reply: why, and the stream's status where it
    had one (its code, and the kvd class a holder names; none: the peer died, the connection
    dropped, the stream ended)."""

    def __init__(self, why: str, code: ErrorCode | None = None, class_name: str = "") -> None:
        super().__init__(why)
        self.why = why
        self.code = code
        self.class_name = class_name

    @classmethod
    def of_rpc(cls, error: grpc.aio.AioRpcError) -> StreamBroken:
        code = rpc_error_code(error)
        return cls(rpc_error_details(error) or code.name, code, error_class_name(error))

    def error_for(self, address: str, what: str) -> KvdError:
        """What the call gets: the unary mapping of the stream's status (unreachable when the
        status carries no kvd class)."""
        if self.code is None or not self.class_name:
            return PeerUnavailable(f"peer daemon {address} unreachable during {what}: {self.why}")
        return from_status(self.code, f"peer daemon {address}: {self.why}", self.class_name)


@dataclasses.dataclass(eq=False)
class SubmittedCall:
    """One call queued on a peer stream (:meth:`PeerStreamCaller.submit`), its reply not read yet."""

    stream: _OpenStream
    call_id: int
    future: asyncio.Future[peer_pb2.PeerReply]
    kind: str
    request: Any
    timeout_s: float
    deadline: float  # event-loop time

    async def reply(self, what: str) -> Any:
        """The submitted call's response (the message of its kind), or its error; past its
        deadline, or cancelled, the call is withdrawn."""
        address = self.stream.address
        try:
            async with asyncio.timeout_at(self.deadline):
                reply: peer_pb2.PeerReply = await self.future
        except TimeoutError:
            self.withdraw()
            raise PeerUnavailable(f"peer daemon {address} unreachable during {what}: DEADLINE_EXCEEDED") from None
        except asyncio.CancelledError:
            self.withdraw()
            raise
        except StreamBroken as exc:
            if exc.code is ErrorCode.UNIMPLEMENTED:
                raise StreamUnsupported(address) from None
            raise exc.error_for(address, what) from None
        if reply.code:
            code = ErrorCode(reply.code)
            if code in (ErrorCode.UNAVAILABLE, ErrorCode.DEADLINE_EXCEEDED) and not reply.error_class:
                # As a unary call's status without a kvd class (the holder gave up at the deadline).
                raise PeerUnavailable(f"peer daemon {address} unreachable during {what}: {reply.error_message}")
            raise from_status(code, f"peer daemon {address}: {reply.error_message}", reply.error_class)
        return getattr(reply, self.kind)

    def withdraw(self) -> None:
        """Nobody will read the reply: forget it, and have the holder cancel its work (a no-op
        once the reply is in: the stream forgot the call as it read the reply)."""
        self.stream.withdraw(self.call_id)
        if self.future.done() and not self.future.cancelled():
            self.future.exception()  # read, so an unread error is not reported as lost


class _OpenStream:
    """One PeerStream call: a writer that sends what queued as one message, a reader that
    resolves each call's future by its id."""

    def __init__(self, address: str, call: Any) -> None:
        self.address = address
        self.broken: StreamBroken | None = None
        self._call = call
        self._outbox: list[peer_pb2.PeerCall] = []
        self._pending: dict[int, asyncio.Future[peer_pb2.PeerReply]] = {}
        self._wake = asyncio.Event()
        self._writing = False  # the writer task is inside a write (flush leaves the outbox to it)
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._write(), name=f"kvd-peer-stream-writer-{address}"),
            loop.create_task(self._read(), name=f"kvd-peer-stream-reader-{address}"),
        ]

    def submit(self, call: peer_pb2.PeerCall) -> asyncio.Future[peer_pb2.PeerReply]:
        future: asyncio.Future[peer_pb2.PeerReply] = asyncio.get_running_loop().create_future()
        if self.broken is not None:
            future.set_exception(self.broken)
            return future
        self._pending[call.call_id] = future
        self._outbox.append(call)
        self._wake.set()
        return future

    def withdraw(self, call_id: int) -> None:
        """The caller stopped waiting: forget its future and have the holder cancel its work."""
        if self._pending.pop(call_id, None) is not None and self.broken is None:
            self._outbox.append(peer_pb2.PeerCall(call_id=call_id, cancel=True))
            self._wake.set()

    async def _write(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                if self._outbox:
                    batch = list(self._outbox)
                    self._outbox.clear()
                    self._writing = True
                    await self._call.write(peer_pb2.PeerCalls(calls=batch))
                    self._writing = False
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as exc:
            self._break(StreamBroken.of_rpc(exc))
        except Exception as exc:  # noqa: BLE001 - a write on a finished call: the reader reports its status
            self._break(StreamBroken(f"the stream ended ({type(exc).__name__})"))

    def flush(self) -> None:
        """Write what is queued now, in this call, where the stream takes a write without an
        await: the framed stream (kvd.server.peer_frames) with nothing of its own unsent and the
        writer task not inside a write. A call queued in StartPulls then leaves in StartPulls, not
        two event-loop turns later. Otherwise (gRPC's stream, a write in progress, bytes unsent)
        the writer task sends it, in order, as before."""
        if not self._outbox or self.broken is not None or self._writing:
            return
        write_now = getattr(self._call, "write_now", None)
        if write_now is None:
            return
        batch = list(self._outbox)
        try:
            written = write_now(peer_pb2.PeerCalls(calls=batch))
        except Exception as exc:  # noqa: BLE001 - as the writer task's write: the stream breaks
            self._break(StreamBroken(f"the stream ended ({type(exc).__name__})"))
            return
        if written:
            del self._outbox[: len(batch)]

    async def _read(self) -> None:
        try:
            while True:
                message = await self._call.read()
                if message is grpc.aio.EOF:
                    self._break(StreamBroken("the peer ended the stream"))
                    return
                for reply in message.replies:
                    future = self._pending.pop(reply.call_id, None)
                    if future is not None and not future.done():
                        future.set_result(reply)
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as exc:
            self._break(StreamBroken.of_rpc(exc))
        except StreamBroken as exc:  # a framed stream's end or break (kvd.server.peer_frames)
            self._break(exc)
        except Exception as exc:
            logger.exception("peer stream to %s failed", self.address)
            self._break(StreamBroken(f"the stream failed ({type(exc).__name__})"))

    def _break(self, broken: StreamBroken) -> None:
        if self.broken is not None:
            return
        self.broken = broken
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(self.broken)
        self._outbox.clear()
        self._call.cancel()
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        logger.debug("peer stream to %s ended: %s", self.address, self.broken.why)

    async def close(self) -> None:
        self._break(StreamBroken("this daemon dropped the peer"))
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
