"""kvd.server.peer_stream: peer calls as messages on one stream, over a real grpc.aio server on
loopback, with handlers standing in for the daemon (the daemon's side is the integration tests')."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest

from kvd.core.peers import PrepareRequest
from kvd.server.peer_stream import PeerStreamCaller, serve_peer_stream
from kvd_client.errors import Internal, InvalidArgument, LeaseExpired, PeerUnavailable, UnknownLease
from kvd_client.v1 import peer_pb2, peer_pb2_grpc

Handler = Callable[[Any], Awaitable[Any]]


class Holder(peer_pb2_grpc.PeerServiceServicer):
    """A PeerService whose stream runs the test's handlers and counts the messages it got."""

    def __init__(self, handlers: dict[str, Handler]) -> None:
        self.handlers = handlers
        self.messages: list[int] = []  # calls per received message

    async def PeerStream(
        self, requests: AsyncIterator[peer_pb2.PeerCalls], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[peer_pb2.PeerReplies]:
        async def counted() -> AsyncIterator[peer_pb2.PeerCalls]:
            async for message in requests:
                self.messages.append(len(message.calls))
                yield message

        async for replies in serve_peer_stream(counted(), self.handlers, None):
            yield replies


async def _serve(holder: Holder, port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    peer_pb2_grpc.add_PeerServiceServicer_to_server(holder, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


def _run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 30))


def _prepare(lease_id: str) -> peer_pb2.PreparePullRequest:
    return peer_pb2.PreparePullRequest(lease_id=lease_id)


async def _ok(request: peer_pb2.PreparePullRequest) -> peer_pb2.PreparePullResponse:
    return peer_pb2.PreparePullResponse(notif_tag=f"tag-{request.lease_id}")


def test_concurrent_calls_each_get_their_own_reply_and_queue_into_shared_messages() -> None:
    async def scenario() -> None:
        gate = asyncio.Event()

        async def slow_first(request: peer_pb2.PreparePullRequest) -> peer_pb2.PreparePullResponse:
            if request.lease_id == "0":
                await gate.wait()
            return await _ok(request)

        holder = Holder({"prepare_pull": slow_first})
        server, port = await _serve(holder)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        caller = PeerStreamCaller("holder", lambda: peer_pb2_grpc.PeerServiceStub(channel))
        try:
            first = asyncio.ensure_future(caller.call("prepare_pull", _prepare("0"), 10, "prepare pull"))
            await asyncio.sleep(0.05)
            rest = [caller.call("prepare_pull", _prepare(str(i)), 10, "prepare pull") for i in range(1, 40)]
            replies = await asyncio.gather(*rest)
            assert [r.notif_tag for r in replies] == [f"tag-{i}" for i in range(1, 40)]
            assert not first.done()  # answered out of order: the slow one does not hold the others
            gate.set()
            assert (await first).notif_tag == "tag-0"
            assert sum(holder.messages) == 40 and len(holder.messages) < 40  # calls shared messages
        finally:
            await caller.close()
            await channel.close()
            await server.stop(None)

    _run(scenario)


def test_errors_come_back_as_their_own_class_and_a_bug_as_internal() -> None:
    async def scenario() -> None:
        async def failing(request: peer_pb2.PreparePullRequest) -> peer_pb2.PreparePullResponse:
            if request.lease_id == "expired":
                raise LeaseExpired("lease 'expired' on request 'r' expired")
            if request.lease_id == "unknown":
                raise UnknownLease("no lease 'unknown' is held here")
            raise RuntimeError("a bug")

        server, port = await _serve(Holder({"prepare_pull": failing}))
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        caller = PeerStreamCaller("holder:1", lambda: peer_pb2_grpc.PeerServiceStub(channel))
        try:
            with pytest.raises(LeaseExpired, match="peer daemon holder:1: lease 'expired'"):
                await caller.call("prepare_pull", _prepare("expired"), 10, "prepare pull")
            with pytest.raises(UnknownLease):
                await caller.call("prepare_pull", _prepare("unknown"), 10, "prepare pull")
            with pytest.raises(Internal, match="internal error in PreparePull"):
                await caller.call("prepare_pull", _prepare("bug"), 10, "prepare pull")
            # The stream survives its calls' errors.
            with pytest.raises(InvalidArgument, match="names no call"):
                await caller.call("finish_read", peer_pb2.FinishReadRequest(), 10, "finish read")
        finally:
            await caller.close()
            await channel.close()
            await server.stop(None)

    _run(scenario)


def test_a_call_past_its_timeout_is_unreachable_and_its_work_is_cancelled_at_the_holder() -> None:
    async def scenario() -> None:
        started, cancelled = asyncio.Event(), asyncio.Event()

        async def hang(request: peer_pb2.PreparePullRequest) -> peer_pb2.PreparePullResponse:
            started.set()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.set()
                raise
            raise AssertionError("not reached")

        server, port = await _serve(Holder({"prepare_pull": hang}))
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        caller = PeerStreamCaller("holder", lambda: peer_pb2_grpc.PeerServiceStub(channel))
        try:
            with pytest.raises(PeerUnavailable, match="unreachable during prepare pull: DEADLINE_EXCEEDED"):
                await caller.call("prepare_pull", _prepare("a"), 0.3, "prepare pull")
            await asyncio.wait_for(cancelled.wait(), 5)

            # A caller that stops waiting withdraws its call: the holder's work is cancelled too.
            started.clear()
            cancelled.clear()
            waiting = asyncio.ensure_future(caller.call("prepare_pull", _prepare("b"), 30, "prepare pull"))
            await asyncio.wait_for(started.wait(), 5)
            waiting.cancel()
            await asyncio.wait_for(cancelled.wait(), 5)
        finally:
            await caller.close()
            await channel.close()
            await server.stop(None)

    _run(scenario)


def test_a_holder_that_goes_away_fails_the_calls_waiting_and_a_later_call_opens_a_new_stream() -> None:
    async def scenario() -> None:
        started = asyncio.Event()

        async def hang(request: peer_pb2.PreparePullRequest) -> peer_pb2.PreparePullResponse:
            if request.lease_id == "hang":
                started.set()
                await asyncio.sleep(60)
            return await _ok(request)

        server, port = await _serve(Holder({"prepare_pull": hang}))
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        caller = PeerStreamCaller("holder", lambda: peer_pb2_grpc.PeerServiceStub(channel))
        try:
            waiting = asyncio.ensure_future(caller.call("prepare_pull", _prepare("hang"), 30, "prepare pull"))
            await asyncio.wait_for(started.wait(), 5)
            await server.stop(None)
            with pytest.raises(PeerUnavailable, match="unreachable during prepare pull"):
                await waiting
            server, _ = await _serve(Holder({"prepare_pull": _ok}), port)
            reply = await caller.call("prepare_pull", _prepare("again"), 10, "prepare pull")
            assert reply.notif_tag == "tag-again"
        finally:
            await caller.close()
            await channel.close()
            await server.stop(None)

    _run(scenario)


def test_a_duplicate_call_id_in_flight_is_refused_and_the_holder_answers_the_first() -> None:
    async def scenario() -> None:
        gate = asyncio.Event()

        async def gated(request: peer_pb2.PreparePullRequest) -> peer_pb2.PreparePullResponse:
            await gate.wait()
            return await _ok(request)

        call = peer_pb2.PeerCall(call_id=7, timeout_ms=5000, prepare_pull=_prepare("x"))

        async def requests() -> AsyncIterator[peer_pb2.PeerCalls]:
            yield peer_pb2.PeerCalls(calls=[call, call])
            await asyncio.sleep(0.05)
            gate.set()

        replies = [
            r async for message in serve_peer_stream(requests(), {"prepare_pull": gated}, None) for r in message.replies
        ]
        assert [(r.call_id, r.code, r.error_class) for r in replies] == [(7, 3, "InvalidArgument"), (7, 0, "")]
        assert replies[1].prepare_pull.notif_tag == "tag-x"

    _run(scenario)


def test_a_holder_without_the_stream_is_called_with_unary_rpcs() -> None:
    """An older holder answers PeerStream UNIMPLEMENTED before running anything: the transport
    makes the call (and later ones) unary, and its errors still come back as their classes."""
    from kvd.server.peer_client import GrpcPeerTransport

    class OldHolder(peer_pb2_grpc.PeerServiceServicer):
        def __init__(self) -> None:
            self.unary = 0

        async def PreparePull(
            self, request: peer_pb2.PreparePullRequest, context: grpc.aio.ServicerContext
        ) -> peer_pb2.PreparePullResponse:
            self.unary += 1
            return await _ok(request)

    async def scenario() -> None:
        holder = OldHolder()
        server = grpc.aio.server()
        peer_pb2_grpc.add_PeerServiceServicer_to_server(holder, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        transport = GrpcPeerTransport(lambda: "reader:1", lambda: "inc")
        address = f"127.0.0.1:{port}"
        try:
            for lease in ("a", "b"):
                request = PrepareRequest(
                    lease_id=lease,
                    engine_id="e",
                    block_ids=(1,),
                    num_tokens=16,
                    reader_tp_rank=0,
                    reader_tp_size=1,
                    remote_tp_ranks=(0,),
                    reader_transfer_id="t",
                    read_timeout_s=5,
                )
                result = await transport.prepare_pull(address, request, 5)
                assert result.notif_tag == f"tag-{lease}"
            assert holder.unary == 2
        finally:
            await transport.close()
            await server.stop(None)

    _run(scenario)


def test_the_holder_gives_up_a_call_at_its_timeout_and_answers_as_a_unary_deadline() -> None:
    async def scenario() -> None:
        async def hang(request: peer_pb2.PreparePullRequest) -> peer_pb2.PreparePullResponse:
            await asyncio.sleep(60)
            raise AssertionError("not reached")

        async def requests() -> AsyncIterator[peer_pb2.PeerCalls]:
            yield peer_pb2.PeerCalls(calls=[peer_pb2.PeerCall(call_id=3, timeout_ms=50, prepare_pull=_prepare("x"))])

        replies = [r async for m in serve_peer_stream(requests(), {"prepare_pull": hang}, None) for r in m.replies]
        # DEADLINE_EXCEEDED with no kvd class: the caller maps it to PeerUnavailable, as unary.
        assert [(r.call_id, r.code, r.error_class) for r in replies] == [(3, 4, "")]

    _run(scenario)


# --- the holder's half on its own: calls fed as messages, replies read (or not) by the test -----


def _calls(*calls: peer_pb2.PeerCall) -> peer_pb2.PeerCalls:
    return peer_pb2.PeerCalls(calls=list(calls))


def _prepare_call(call_id: int, lease_id: str = "L") -> peer_pb2.PeerCall:
    return peer_pb2.PeerCall(call_id=call_id, prepare_pull=_prepare(lease_id))


async def _feed(
    messages: list[peer_pb2.PeerCalls], pulled: list[int] | None = None
) -> AsyncIterator[peer_pb2.PeerCalls]:
    for message in messages:
        await asyncio.sleep(0)  # as grpc's reads: the calls taken so far get to run
        if pulled is not None:
            pulled.append(len(message.calls))
        yield message


def test_a_call_cancelled_in_its_own_message_leaves_no_trace_and_the_stream_ends() -> None:
    """A call and its cancel in one message: the call never runs, its id is free again at once, and
    the stream still ends once the caller half-closes (the id used to stay "in flight" forever)."""

    async def scenario() -> None:
        ran: list[str] = []

        async def counted(request: peer_pb2.PreparePullRequest) -> peer_pb2.PreparePullResponse:
            ran.append(request.lease_id)
            return await _ok(request)

        cancel = peer_pb2.PeerCall(call_id=1, cancel=True)
        messages = [_calls(_prepare_call(1, "gone"), cancel), _calls(_prepare_call(1, "again"))]
        replies = [
            r async for m in serve_peer_stream(_feed(messages), {"prepare_pull": counted}, None) for r in m.replies
        ]
        assert [(r.call_id, r.prepare_pull.notif_tag, r.code) for r in replies] == [(1, "tag-again", 0)]
        assert ran == ["again"]

        many = [_calls(_prepare_call(i), peer_pb2.PeerCall(call_id=i, cancel=True)) for i in range(5000)]
        stream = serve_peer_stream(_feed([*many, _calls(_prepare_call(9999, "last"))]), {"prepare_pull": _ok}, None)
        replies = [r async for m in stream for r in m.replies]
        assert [(r.call_id, r.code) for r in replies] == [(9999, 0)]  # not RESOURCE_EXHAUSTED

    _run(scenario)


def test_replies_go_out_in_messages_under_the_size_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replies that queued together are split into messages of at most MAX_REPLIES_MESSAGE_BYTES
    (one message of all of them could pass grpc's message limit and kill the stream)."""
    from kvd.server import peer_stream

    monkeypatch.setattr(peer_stream, "MAX_REPLIES_MESSAGE_BYTES", 1000)

    async def scenario() -> None:
        gate = asyncio.Event()

        async def big(request: peer_pb2.PreparePullRequest) -> peer_pb2.PreparePullResponse:
            await gate.wait()
            return peer_pb2.PreparePullResponse(notif_tag="x" * 300)

        async def feed() -> AsyncIterator[peer_pb2.PeerCalls]:
            yield _calls(*(_prepare_call(i) for i in range(10)))
            await asyncio.sleep(0.05)  # every call is running
            gate.set()
            await asyncio.sleep(0.05)  # every reply is ready before the next is taken

        sizes = [(len(m.replies), m.ByteSize()) async for m in serve_peer_stream(feed(), {"prepare_pull": big}, None)]
        assert sum(n for n, _ in sizes) == 10
        assert all(size <= 1000 for _, size in sizes) and max(n for n, _ in sizes) == 3

    _run(scenario)


def test_a_caller_that_does_not_read_its_replies_is_not_read_either(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once MAX_PENDING_REPLY_BYTES of replies wait for the caller, the holder takes no more calls
    (HTTP/2 flow control then holds the caller back) instead of queueing replies without bound."""
    from kvd.server import peer_stream

    monkeypatch.setattr(peer_stream, "MAX_PENDING_REPLY_BYTES", 2000)

    async def big(request: peer_pb2.PreparePullRequest) -> peer_pb2.PreparePullResponse:
        return peer_pb2.PreparePullResponse(notif_tag="x" * 500)

    async def scenario() -> None:
        pulled: list[int] = []
        messages = [_calls(_prepare_call(i)) for i in range(100)]
        stream = serve_peer_stream(_feed(messages, pulled), {"prepare_pull": big}, None)
        first = await stream.__anext__()  # then the caller stops reading
        await asyncio.sleep(0.3)
        assert len(first.replies) >= 1 and len(pulled) <= 8  # ~4 replies of ~510 bytes fill 2000
        rest = [r async for m in stream for r in m.replies]  # reading again lets the rest in
        assert len(first.replies) + len(rest) == 100 and len(pulled) == 100

    _run(scenario)
