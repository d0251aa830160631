"""kvd.server.peer_stream's flush: calls queued on a holder's framed stream leave in the call
that flushes them (how StartPulls sends a step's admissions before it returns), over a real TCP
connection; where the stream cannot take a write without an await, they leave with the writer
task, in order, as before."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from kvd.server.peer_frames import MAGIC, FramedPeerCall
from kvd.server.peer_stream import PeerStreamCaller, _OpenStream
from kvd_client.v1 import peer_pb2


def _run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 30))


def _prepare(lease_id: str) -> peer_pb2.PreparePullRequest:
    return peer_pb2.PreparePullRequest(lease_id=lease_id)


class _FrameSink:
    """A holder's framed port reduced to its bytes: a thread reads the magic, then frames, and
    signals each one (so a test can wait for it without running the event loop)."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.messages: list[peer_pb2.PeerCalls] = []
        self.arrived = threading.Semaphore(0)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        connection, _ = self._listener.accept()
        with connection:
            stream = connection.makefile("rb")
            assert stream.read(len(MAGIC)) == MAGIC
            while header := stream.read(4):
                (length,) = struct.unpack(">I", header)
                self.messages.append(peer_pb2.PeerCalls.FromString(stream.read(length)))
                self.arrived.release()

    def close(self) -> None:
        self._listener.close()


async def _framed_caller(sink: _FrameSink) -> PeerStreamCaller:
    caller = PeerStreamCaller("holder", lambda: None)  # type: ignore[arg-type,return-value]
    caller.open_frames(lambda: FramedPeerCall.connect("holder", "127.0.0.1", sink.port, None))
    async with asyncio.timeout(5):
        while not caller.framed:
            await asyncio.sleep(0.001)
    return caller


def test_calls_flushed_on_a_framed_stream_leave_without_an_event_loop_turn() -> None:
    """Two calls queued then flushed reach the holder as one message while this thread still
    holds the event loop; one queued without a flush waits for the writer task's turn."""

    async def scenario() -> None:
        sink = _FrameSink()
        caller = await _framed_caller(sink)
        try:
            first = caller.submit("prepare_pull", _prepare("a"), 5)
            second = caller.submit("prepare_pull", _prepare("b"), 5)
            caller.flush()
            assert sink.arrived.acquire(timeout=5), "a flushed call leaves in the flush itself"
            assert [[c.prepare_pull.lease_id for c in m.calls] for m in sink.messages] == [["a", "b"]]

            third = caller.submit("prepare_pull", _prepare("c"), 5)
            assert not sink.arrived.acquire(timeout=0.2), "without a flush, the writer task sends it"
            async with asyncio.timeout(5):
                while not sink.arrived.acquire(blocking=False):
                    await asyncio.sleep(0.001)
            assert [c.prepare_pull.lease_id for c in sink.messages[-1].calls] == ["c"]
            for submitted in (first, second, third):
                submitted.withdraw()
        finally:
            await caller.close()
            sink.close()

    _run(scenario)


class _Call:
    """A stream call that records its writes: ``write_now`` answers ``takes_now`` (None: a gRPC
    stream call, which has no ``write_now``)."""

    def __init__(self, takes_now: bool | None) -> None:
        self.writes: list[tuple[str, list[str]]] = []
        self.release = asyncio.Event()
        self.release.set()
        self._takes_now = takes_now
        if takes_now is not None:
            self.write_now = self._write_now

    def _write_now(self, calls: peer_pb2.PeerCalls) -> bool:
        if self._takes_now:
            self.writes.append(("now", [c.prepare_pull.lease_id for c in calls.calls]))
        return bool(self._takes_now)

    async def write(self, calls: peer_pb2.PeerCalls) -> None:
        self.writes.append(("task", [c.prepare_pull.lease_id for c in calls.calls]))
        await self.release.wait()  # a drain that waits for the peer

    async def read(self) -> Any:
        await asyncio.Event().wait()

    def cancel(self) -> None:
        pass


def _queue(stream: _OpenStream, *lease_ids: str) -> None:
    for call_id, lease_id in enumerate(lease_ids, start=len(stream._pending) + 1):
        stream.submit(peer_pb2.PeerCall(call_id=call_id, prepare_pull=_prepare(lease_id)))


async def _turns(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_a_stream_that_cannot_take_a_write_now_leaves_its_calls_to_the_writer_in_order() -> None:
    """gRPC's stream (no write without an await), a framed stream with bytes unsent, and a write
    in progress: flush writes nothing, and the writer task sends every call, in order, once."""

    async def scenario() -> None:
        for takes_now in (None, False):
            call = _Call(takes_now)
            stream = _OpenStream("holder", call)
            _queue(stream, "a", "b")
            stream.flush()
            assert call.writes == []
            await _turns()
            assert call.writes == [("task", ["a", "b"])]
            await stream.close()

        call = _Call(True)
        stream = _OpenStream("holder", call)
        call.release.clear()  # the writer's next write waits (a drain)
        _queue(stream, "a")
        await _turns()
        assert call.writes == [("task", ["a"])]
        _queue(stream, "b")
        stream.flush()  # the writer is inside a write: b waits its turn behind it
        assert call.writes == [("task", ["a"])]
        call.release.set()
        await _turns()
        assert call.writes == [("task", ["a"]), ("task", ["b"])]
        _queue(stream, "c", "d")
        stream.flush()  # idle again: written now, the writer finds nothing left
        await _turns()
        assert call.writes == [("task", ["a"]), ("task", ["b"]), ("now", ["c", "d"])]
        await stream.close()

    _run(scenario)
