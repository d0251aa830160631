"""The core's PeerTransport over gRPC: how this daemon calls peer daemons.

Channels are cached per address. Statuses from the peer come back as the same kvd error
classes; a peer that cannot be reached is PeerUnavailable, naming it. An AbandonPull to a peer
this daemon has dropped (its channel forgotten) goes on a channel of its own, closed once no
AbandonPull to that peer is in flight: a reader asks a holder it cannot reach again and again
(kvd.core.pulls), and a cached channel left in gRPC's reconnect back-off would fail the first
handshake with that address once the peer is back. The AbandonPulls in flight together to one
dropped peer share that channel: a holder that restarts under load fails dozens of pulls at once,
and a channel each had opened dozens of TCP connections to it (the fleet saw 30-80).
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from kvd.core.peers import AskedAdmission, HandshakeInfo, PrepareRequest, PrepareResult
from kvd.server import convert
from kvd.server.peer_frames import FramedPeerCall, split_host
from kvd.server.peer_stream import OPERATIONS, PeerStreamCaller, StreamUnsupported, SubmittedCall
from kvd_client.channel import PEER_CHANNEL_OPTIONS
from kvd_client.errors import ErrorCode, KvdError, PeerUnavailable, from_status
from kvd_client.grpc_errors import error_class_name, rpc_error_code, rpc_error_details
from kvd_client.v1 import peer_pb2, peer_pb2_grpc

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _to_kvd(exc: grpc.RpcError, address: str, what: str) -> KvdError:
    """The kvd error of a failed peer call; a peer that cannot be reached is PeerUnavailable."""
    code, details, class_name = rpc_error_code(exc), rpc_error_details(exc), error_class_name(exc)
    if code in (ErrorCode.UNAVAILABLE, ErrorCode.DEADLINE_EXCEEDED) and not class_name:
        return PeerUnavailable(f"peer daemon {address} unreachable during {what}: {details or code.name}")
    return from_status(code, f"peer daemon {address}: {details}", class_name)


def _unary(kind: str, request: Any, timeout_s: float) -> Callable[[peer_pb2_grpc.PeerServiceStub], Awaitable[Any]]:
    def unary(stub: peer_pb2_grpc.PeerServiceStub) -> Awaitable[Any]:
        return getattr(stub, OPERATIONS[kind])(request, timeout=timeout_s)

    return unary


def _prepared(response: peer_pb2.PreparePullResponse) -> PrepareResult:
    return PrepareResult(tuple(response.registration_ids), response.notif_tag, response.verify_after_read)


class _StreamAdmission:
    """A PreparePull queued on a peer's stream (GrpcPeerTransport.ask_prepare_pull)."""

    def __init__(self, transport: GrpcPeerTransport, address: str, submitted: SubmittedCall) -> None:
        self._transport = transport
        self._address = address
        self._submitted = submitted

    async def answer(self) -> PrepareResult:
        return _prepared(await self._transport.answer(self._address, "prepare pull", self._submitted))

    def withdraw(self) -> None:
        self._submitted.withdraw()


class GrpcPeerTransport:
    """PeerTransport over grpc.aio (TLS when credentials are given)."""

    def __init__(
        self,
        own_address: Callable[[], str],
        own_incarnation: Callable[[], str],
        credentials: grpc.ChannelCredentials | None = None,
        calls_on_stream: bool = True,
        frames_tls: ssl.SSLContext | None = None,
        use_frames: bool = False,
    ) -> None:
        self._own_address = own_address
        self._own_incarnation = own_incarnation
        self._credentials = credentials
        self._calls_on_stream = calls_on_stream
        # The peer stream on a holder's framed port where its handshake names one (kvd.server.peer_frames).
        self._use_frames = use_frames and calls_on_stream
        self._frames_tls = frames_tls
        self._channels: dict[str, grpc.aio.Channel] = {}
        # One PeerStream per peer (kvd.server.peer_stream), when calls_on_stream.
        self._streams: dict[str, PeerStreamCaller] = {}
        self._unary_only: set[str] = set()  # peers that answered the stream UNIMPLEMENTED
        self._to_flush: set[str] = set()  # peers with calls asked (ask_prepare_pull) since the last flush
        # One stub per channel: building one per call showed in the pull path's profile.
        self._stubs: dict[str, peer_pb2_grpc.PeerServiceStub] = {}
        # Dropped peer -> (its AbandonPull channel, the calls using it): see the module docstring.
        self._abandon_channels: dict[str, tuple[grpc.aio.Channel, int]] = {}
        self.last_contact: dict[str, float] = {}
        """Peer address -> monotonic time of its last answered call (for `kvd status`)."""

    def _new_channel(self, address: str) -> grpc.aio.Channel:
        if self._credentials is not None:
            return grpc.aio.secure_channel(address, self._credentials, options=PEER_CHANNEL_OPTIONS)
        return grpc.aio.insecure_channel(address, options=PEER_CHANNEL_OPTIONS)

    def _stub(self, address: str) -> peer_pb2_grpc.PeerServiceStub:
        stub = self._stubs.get(address)
        if stub is not None:
            return stub
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = self._new_channel(address)
        stub = self._stubs[address] = peer_pb2_grpc.PeerServiceStub(channel)
        return stub

    async def _call(self, address: str, what: str, call: Callable[[peer_pb2_grpc.PeerServiceStub], Awaitable[T]]) -> T:
        try:
            result = await call(self._stub(address))
        except grpc.aio.AioRpcError as exc:
            raise _to_kvd(exc, address, what) from exc
        self.last_contact[address] = time.monotonic()
        return result

    async def _peer_call(
        self,
        address: str,
        what: str,
        kind: str,
        request: Any,
        timeout_s: float,
    ) -> Any:
        """One call to a peer: a message on its stream, or the unary RPC of the same name
        (``calls_on_stream`` false, or a peer without the stream)."""
        if not self._calls_on_stream or address in self._unary_only:
            return await self._call(address, what, _unary(kind, request, timeout_s))
        return await self.answer(address, what, self._stream(address).submit(kind, request, timeout_s))

    async def answer(self, address: str, what: str, submitted: SubmittedCall) -> Any:
        """The response of a call submitted on the peer's stream (its unary RPC where the peer
        turns out to serve no stream)."""
        try:
            response = await submitted.reply(what)
        except StreamUnsupported:
            # An older holder (no PeerStream): it ran nothing; unary calls to it from now on
            # (until it is dropped: a restarted, upgraded holder gets the stream again).
            logger.info("peer daemon %s does not serve PeerStream: calling it with unary RPCs", address)
            self._unary_only.add(address)
            return await self._call(address, what, _unary(submitted.kind, submitted.request, submitted.timeout_s))
        self.last_contact[address] = time.monotonic()
        return response

    def framed(self, address: str) -> bool:
        """Whether calls to the peer at ``address`` go on its framed port now (kvd.server.peer_frames)."""
        stream = self._streams.get(address)
        return stream is not None and stream.framed

    def _stream(self, address: str) -> PeerStreamCaller:
        stream = self._streams.get(address)
        if stream is None:
            stream = self._streams[address] = PeerStreamCaller(address, lambda: self._stub(address))
        return stream

    async def handshake(self, address: str, timeout_s: float) -> HandshakeInfo:
        request = peer_pb2.HandshakeRequest(
            caller_incarnation=self._own_incarnation(), caller_address=self._own_address()
        )
        if self._calls_on_stream and address not in self._streams and address not in self._unary_only:
            # Opened now, beside the handshake on the new channel, off the first pull's path (a
            # later break reopens it on its next call; a dropped peer's stream is closed with it).
            self._stream(address).open()
        response = await self._call(address, "handshake", lambda stub: stub.Handshake(request, timeout=timeout_s))
        port = response.peer_stream_port
        if self._use_frames and port and address not in self._unary_only:
            try:
                host, tls = split_host(address), self._frames_tls
            except KvdError:
                return convert.handshake_from_pb(response)  # an address with no host: gRPC only
            self._stream(address).open_frames(lambda: FramedPeerCall.connect(address, host, port, tls))
        return convert.handshake_from_pb(response)

    def _prepare_message(self, request: PrepareRequest) -> peer_pb2.PreparePullRequest:
        return peer_pb2.PreparePullRequest(
            lease_id=request.lease_id,
            engine_id=request.engine_id,
            block_ids=list(request.block_ids),
            num_tokens=request.num_tokens,
            reader_incarnation=self._own_incarnation(),
            reader_tp_rank=request.reader_tp_rank,
            reader_tp_size=request.reader_tp_size,
            remote_tp_ranks=list(request.remote_tp_ranks),
            reader_address=self._own_address(),
            reader_transfer_id=request.reader_transfer_id,
            read_timeout_ms=max(1, int(request.read_timeout_s * 1000)),
            group_block_ids=[b for ids in request.group_block_ids for b in ids],
            group_block_counts=[len(ids) for ids in request.group_block_ids],
            read_id=request.read_id,
            registration_ids=list(request.registration_ids),
        )

    async def prepare_pull(self, address: str, request: PrepareRequest, timeout_s: float) -> PrepareResult:
        message = self._prepare_message(request)
        return _prepared(await self._peer_call(address, "prepare pull", "prepare_pull", message, timeout_s))

    def ask_prepare_pull(self, address: str, request: PrepareRequest, timeout_s: float) -> AskedAdmission | None:
        """Queue the PreparePull on the peer's stream now (it leaves at :meth:`flush`); None
        where it cannot be queued without an await (unary calls, a stream this daemon dropped):
        the caller then awaits :meth:`prepare_pull`, which says why."""
        if not self._calls_on_stream or address in self._unary_only:
            return None
        try:
            submitted = self._stream(address).submit("prepare_pull", self._prepare_message(request), timeout_s)
        except KvdError:
            return None
        self._to_flush.add(address)
        return _StreamAdmission(self, address, submitted)

    def flush(self) -> None:
        """Write the calls asked since the last flush to their peers now, where their streams
        take a write without an await (kvd.server.peer_stream: PeerStreamCaller.flush)."""
        for address in self._to_flush:
            stream = self._streams.get(address)
            if stream is not None:
                stream.flush()
        self._to_flush.clear()

    async def abandon_pull(
        self, address: str, lease_id: str, reader_tp_rank: int, reader_transfer_id: str, reason: str, timeout_s: float
    ) -> None:
        request = peer_pb2.AbandonPullRequest(
            lease_id=lease_id,
            reader_tp_rank=reader_tp_rank,
            reason=reason[:500],
            reader_incarnation=self._own_incarnation(),
            reader_transfer_id=reader_transfer_id,
        )
        if address not in self._channels:  # a dropped peer: a channel of its own (module docstring)
            channel, users = self._abandon_channels.get(address) or (self._new_channel(address), 0)
            self._abandon_channels[address] = (channel, users + 1)
            try:
                await peer_pb2_grpc.PeerServiceStub(channel).AbandonPull(request, timeout=timeout_s)
            except grpc.aio.AioRpcError as exc:
                raise _to_kvd(exc, address, "abandon pull") from exc
            finally:
                await self._abandon_call_over(address, channel)
            self.last_contact[address] = time.monotonic()
            return
        await self._peer_call(
            address,
            "abandon pull",
            "abandon_pull",
            request,
            timeout_s,
        )

    async def finish_read(
        self,
        address: str,
        lease_id: str,
        reader_tp_rank: int,
        reader_transfer_id: str,
        timeout_s: float,
        nbytes: int = 0,
    ) -> None:
        request = peer_pb2.FinishReadRequest(
            lease_id=lease_id,
            reader_tp_rank=reader_tp_rank,
            reader_incarnation=self._own_incarnation(),
            reader_transfer_id=reader_transfer_id,
            nbytes=nbytes,
        )
        await self._peer_call(
            address,
            "finish read",
            "finish_read",
            request,
            timeout_s,
        )

    async def renew_leases(self, address: str, lease_ids: list[str], timeout_s: float) -> list[str]:
        request = peer_pb2.RenewLeasesRequest(lease_ids=lease_ids)
        response = await self._peer_call(
            address,
            "renew leases",
            "renew_leases",
            request,
            timeout_s,
        )
        return list(response.unknown_lease_ids)

    async def release_leases(self, address: str, lease_ids: list[str], reason: str, timeout_s: float) -> None:
        request = peer_pb2.ReleaseLeasesRequest(lease_ids=lease_ids, reason=reason[:500])
        await self._peer_call(
            address,
            "release leases",
            "release_leases",
            request,
            timeout_s,
        )

    async def _abandon_call_over(self, address: str, channel: grpc.aio.Channel) -> None:
        """The last AbandonPull in flight on a dropped peer's channel closes it."""
        shared, users = self._abandon_channels.get(address, (None, 0))
        if shared is not channel:  # closed by close() meanwhile
            return
        if users > 1:
            self._abandon_channels[address] = (channel, users - 1)
            return
        del self._abandon_channels[address]
        await channel.close()

    async def forget(self, address: str) -> None:
        """Close the stream and channel to a dropped peer (a later call opens new ones).

        Everything is taken out of the tables before anything is awaited: a call made while the
        old stream closes opens a new stream on a new channel, never one on the channel being
        closed (its writes would wait for good: the PreparePull that did hung to its deadline)."""
        stream = self._streams.pop(address, None)
        self._unary_only.discard(address)
        self._stubs.pop(address, None)
        channel = self._channels.pop(address, None)
        if stream is not None:
            await stream.close()
        if channel is not None:
            await channel.close()

    async def close(self) -> None:
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            await stream.close()
        self._stubs.clear()
        channels, self._channels = list(self._channels.values()), {}
        channels += [channel for channel, _ in self._abandon_channels.values()]
        self._abandon_channels.clear()
        for channel in channels:
            await channel.close()
