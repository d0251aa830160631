"""The peer service: what another kvd daemon asks of this one as a holder (its NIXL metadata, the
admission of a read, its end, lease renewals and releases), unary or on one long-lived stream.
Thin: validate, call the core, translate."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc

from kvd.core.daemon import Daemon
from kvd.core.peers import PrepareRequest
from kvd.server import convert
from kvd.server.edge import rpc
from kvd.server.peer_stream import PeerHandlers, serve_peer_stream
from kvd_client.v1 import peer_pb2, peer_pb2_grpc

logger = logging.getLogger(__name__)


class PeerServicer(peer_pb2_grpc.PeerServiceServicer):
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.metrics = daemon.metrics
        self.peer_stream_port = 0  # where the peer stream is served without gRPC (kvd.server.peer_frames)

    @rpc
    async def Handshake(
        self, request: peer_pb2.HandshakeRequest, context: grpc.aio.ServicerContext
    ) -> peer_pb2.HandshakeResponse:
        self.daemon.require_serving()
        response = convert.handshake_to_pb(self.daemon.handshake_info())
        response.peer_stream_port = self.peer_stream_port
        return response

    @rpc
    async def PreparePull(
        self, request: peer_pb2.PreparePullRequest, context: grpc.aio.ServicerContext
    ) -> peer_pb2.PreparePullResponse:
        return await self._prepare_pull(request)

    @rpc
    async def AbandonPull(
        self, request: peer_pb2.AbandonPullRequest, context: grpc.aio.ServicerContext
    ) -> peer_pb2.AbandonPullResponse:
        return await self._abandon_pull(request)

    @rpc
    async def FinishRead(
        self, request: peer_pb2.FinishReadRequest, context: grpc.aio.ServicerContext
    ) -> peer_pb2.FinishReadResponse:
        return await self._finish_read(request)

    @rpc
    async def RenewLeases(
        self, request: peer_pb2.RenewLeasesRequest, context: grpc.aio.ServicerContext
    ) -> peer_pb2.RenewLeasesResponse:
        return await self._renew_leases(request)

    @rpc
    async def ReleaseLeases(
        self, request: peer_pb2.ReleaseLeasesRequest, context: grpc.aio.ServicerContext
    ) -> peer_pb2.ReleaseLeasesResponse:
        return await self._release_leases(request)

    @rpc
    async def PeerStream(
        self, requests: AsyncIterator[peer_pb2.PeerCalls], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[peer_pb2.PeerReplies]:
        async for replies in serve_peer_stream(requests, self._handlers, self.metrics):
            yield replies

    # --- the calls, whether unary or on the stream ----------------------------------------------

    @property
    def handlers(self) -> PeerHandlers:
        """The calls of the peer stream, by kind (the gRPC stream's and the framed one's)."""
        return self._handlers

    @property
    def _handlers(self) -> PeerHandlers:
        return {
            "prepare_pull": self._prepare_pull,
            "abandon_pull": self._abandon_pull,
            "finish_read": self._finish_read,
            "renew_leases": self._renew_leases,
            "release_leases": self._release_leases,
        }

    async def _prepare_pull(self, request: peer_pb2.PreparePullRequest) -> peer_pb2.PreparePullResponse:
        result = await self.daemon.prepare_pull(
            PrepareRequest(
                lease_id=request.lease_id,
                engine_id=request.engine_id,
                block_ids=tuple(request.block_ids),
                num_tokens=request.num_tokens,
                reader_tp_rank=request.reader_tp_rank,
                reader_tp_size=request.reader_tp_size,
                remote_tp_ranks=tuple(request.remote_tp_ranks),
                reader_transfer_id=request.reader_transfer_id,
                read_timeout_s=request.read_timeout_ms / 1000,
                group_block_ids=convert.group_ids_from_pb(
                    request.group_block_ids, request.group_block_counts, "prepare pull"
                ),
                read_id=request.read_id,
                registration_ids=tuple(request.registration_ids),
            ),
            reader_address=request.reader_address,
            reader_incarnation=request.reader_incarnation,
        )
        return peer_pb2.PreparePullResponse(
            registration_ids=list(result.registration_ids),
            notif_tag=result.notif_tag,
            verify_after_read=result.verify_after_read,
        )

    async def _abandon_pull(self, request: peer_pb2.AbandonPullRequest) -> peer_pb2.AbandonPullResponse:
        self.daemon.abandon_pull(
            request.lease_id,
            request.reader_tp_rank,
            request.reason,
            reader_incarnation=request.reader_incarnation,
            reader_transfer_id=request.reader_transfer_id,
        )
        return peer_pb2.AbandonPullResponse()

    async def _finish_read(self, request: peer_pb2.FinishReadRequest) -> peer_pb2.FinishReadResponse:
        await self.daemon.finish_read(
            request.lease_id,
            request.reader_tp_rank,
            reader_incarnation=request.reader_incarnation,
            reader_transfer_id=request.reader_transfer_id,
            nbytes=request.nbytes,
        )
        return peer_pb2.FinishReadResponse()

    async def _renew_leases(self, request: peer_pb2.RenewLeasesRequest) -> peer_pb2.RenewLeasesResponse:
        return peer_pb2.RenewLeasesResponse(unknown_lease_ids=self.daemon.renew_leases(list(request.lease_ids)))

    async def _release_leases(self, request: peer_pb2.ReleaseLeasesRequest) -> peer_pb2.ReleaseLeasesResponse:
        self.daemon.release_leases(list(request.lease_ids), request.reason or "released by the reader's daemon")
        return peer_pb2.ReleaseLeasesResponse()
