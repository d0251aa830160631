"""kvd.server.peer_client: an AbandonPull to a dropped peer leaves no channel behind.

A reader asks a holder it cannot reach for AbandonPull again and again (kvd.core.pulls), also
after it dropped the peer. On the cached channel, each failed try left that channel in gRPC's
reconnect back-off, and the first handshake with the holder once it was back (a restart on the
same address) failed "Connection refused" (tests/chaos/test_peer_death.py). A dropped peer's
AbandonPull goes on a channel of its own, closed after the call. A real grpc.aio server on
loopback plays the holder.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import grpc
import pytest

from kvd.server.peer_client import GrpcPeerTransport
from kvd.server.peer_stream import serve_peer_stream
from kvd_client.errors import PeerUnavailable
from kvd_client.v1 import peer_pb2, peer_pb2_grpc


class Holder(peer_pb2_grpc.PeerServiceServicer):
    def __init__(self) -> None:
        self.abandons: list[str] = []  # unary AbandonPulls
        self.streamed: list[str] = []  # AbandonPulls on the peer's stream

    async def AbandonPull(
        self, request: peer_pb2.AbandonPullRequest, context: grpc.aio.ServicerContext
    ) -> peer_pb2.AbandonPullResponse:
        self.abandons.append(request.lease_id)
        return peer_pb2.AbandonPullResponse()

    async def PeerStream(
        self, requests: AsyncIterator[peer_pb2.PeerCalls], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[peer_pb2.PeerReplies]:
        async def renew(request: peer_pb2.RenewLeasesRequest) -> peer_pb2.RenewLeasesResponse:
            return peer_pb2.RenewLeasesResponse()

        async def abandon(request: peer_pb2.AbandonPullRequest) -> peer_pb2.AbandonPullResponse:
            self.streamed.append(request.lease_id)
            return peer_pb2.AbandonPullResponse()

        handlers = {"renew_leases": renew, "abandon_pull": abandon}
        async for replies in serve_peer_stream(requests, handlers, None):
            yield replies


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_abandon_to_a_dropped_peer_leaves_no_channel_and_the_peer_is_reached_at_once_when_back() -> None:
    async def scenario() -> None:
        address = f"127.0.0.1:{_free_port()}"
        transport = GrpcPeerTransport(lambda: "reader:1", lambda: "inc-r")
        server: grpc.aio.Server | None = None
        try:
            for _ in range(3):  # the holder is down: each try fails as unreachable, and leaves nothing
                with pytest.raises(PeerUnavailable, match="unreachable during abandon pull"):
                    await transport.abandon_pull(address, "lease-1", 0, "t1", "deadline", 2.0)
                assert address not in transport._channels and address not in transport._streams

            holder = Holder()
            server = grpc.aio.server()
            peer_pb2_grpc.add_PeerServiceServicer_to_server(holder, server)
            server.add_insecure_port(address)
            await server.start()
            # Back on the same address: reached at once (no channel waits out a reconnect back-off).
            assert await transport.renew_leases(address, ["lease-2"], 2.0) == []
            await transport.abandon_pull(address, "lease-1", 0, "t1", "deadline", 2.0)  # now on the peer's stream
            await transport.forget(address)
            await transport.abandon_pull(address, "lease-3", 0, "t3", "deadline", 2.0)  # dropped: its own channel
            assert holder.streamed == ["lease-1"] and holder.abandons == ["lease-3"]
            assert address not in transport._channels
        finally:
            await transport.close()
            if server is not None:
                await server.stop(None)

    asyncio.run(asyncio.wait_for(scenario(), 30))


class SlowHolder(peer_pb2_grpc.PeerServiceServicer):
    """Answers no AbandonPull until the test opens ``gate``; records each call's connection."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.connections: list[str] = []  # the caller's address:port of each AbandonPull

    async def AbandonPull(
        self, request: peer_pb2.AbandonPullRequest, context: grpc.aio.ServicerContext
    ) -> peer_pb2.AbandonPullResponse:
        self.connections.append(context.peer())
        await self.gate.wait()
        return peer_pb2.AbandonPullResponse()


def test_abandons_in_flight_together_to_a_dropped_peer_share_one_connection_closed_after_the_last() -> None:
    """A holder that restarts under load fails many pulls at once: their AbandonPulls must not
    open a TCP connection each (the fleet counted 30-80 to one restarted peer)."""

    async def scenario() -> None:
        address = f"127.0.0.1:{_free_port()}"
        holder = SlowHolder()
        server = grpc.aio.server()
        peer_pb2_grpc.add_PeerServiceServicer_to_server(holder, server)
        server.add_insecure_port(address)
        await server.start()
        transport = GrpcPeerTransport(lambda: "reader:1", lambda: "inc-r")
        try:
            calls = [
                asyncio.ensure_future(transport.abandon_pull(address, f"lease-{i}", 0, f"t{i}", "peer died", 10.0))
                for i in range(16)
            ]
            while len(holder.connections) < len(calls):
                await asyncio.sleep(0.01)
            assert len(set(holder.connections)) == 1, holder.connections
            assert list(transport._abandon_channels) == [address] and transport._abandon_channels[address][1] == 16
            holder.gate.set()
            await asyncio.gather(*calls)
            assert transport._abandon_channels == {} and address not in transport._channels
        finally:
            await transport.close()
            await server.stop(None)

    asyncio.run(asyncio.wait_for(scenario(), 30))
