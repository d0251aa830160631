"""The router service: pulls started, watched and cancelled, leases looked up, renewed and
released, the daemon's status and its selftest hold. Thin: validate, call the core, translate."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence

import grpc

from kvd import __version__
from kvd.core import scratch
from kvd.core.daemon import Daemon, PullOrder
from kvd.core.transfers import Transfer
from kvd.server import convert
from kvd.server.edge import rpc
from kvd.server.lease_info import lease_to_pb
from kvd.server.pull_starts import add_results, let_started_pulls_run, pull_order, read_orders
from kvd.server.watch_stream import serve_watch_stream
from kvd_client.errors import InvalidArgument, KvdError
from kvd_client.v1 import common_pb2, router_pb2, router_pb2_grpc

logger = logging.getLogger(__name__)

SELFTEST_SEED_LIMIT = 1 << 63
"""The scratch pattern computes in signed 64-bit words: larger seeds would overflow."""


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    def __init__(
        self,
        daemon: Daemon,
        last_contact: Mapping[str, float] | None = None,
        framed: Callable[[str], bool] = lambda _address: False,
    ) -> None:
        self.daemon = daemon
        self.metrics = daemon.metrics
        self.last_contact = last_contact if last_contact is not None else {}  # peer address -> monotonic time
        self.framed = framed  # peer address -> whether calls to it go on its framed port
        self.metrics_address = ""  # set by the app once /metrics listens

    @rpc
    async def StartPull(
        self, request: router_pb2.StartPullRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.StartPullResponse:
        transfer = self.daemon.start_order(pull_order(request))
        await let_started_pulls_run()
        return router_pb2.StartPullResponse(transfer_id=transfer.transfer_id)

    @rpc
    async def StartPulls(
        self, request: router_pb2.StartPullsRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.StartPullsResponse:
        results = self.daemon.start_pulls(read_orders(request.pulls))  # results[i] answers pulls[i]
        await let_started_pulls_run()
        response = router_pb2.StartPullsResponse()
        add_results(response, results, self.metrics, "StartPulls")
        return response

    @rpc
    async def GetTransfer(
        self, request: router_pb2.GetTransferRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.TransferStatus:
        return convert.transfer_to_pb(self.daemon.transfers.get(request.transfer_id))

    @rpc
    async def WatchTransfer(
        self, request: router_pb2.GetTransferRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[common_pb2.TransferStatus]:
        transfer = self.daemon.transfers.get(request.transfer_id)
        async for current in transfer.changes():
            yield convert.transfer_to_pb(current)

    @rpc
    async def WatchTransfers(
        self, requests: AsyncIterator[router_pb2.WatchTransfersRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.WatchTransfersResponse]:
        # Not require_serving: a stream opened in the shutdown's grace still gets the outcomes of
        # the pulls it watches (the watches refuse new streams once the daemon closed them, and
        # a pull the stream asks to start is refused UNAVAILABLE by the start itself).
        async for response in serve_watch_stream(
            self.daemon.watches, self.daemon.incarnation, requests, self._start_watched_pulls
        ):
            yield response

    def _start_watched_pulls(self, orders: Sequence[PullOrder | KvdError]) -> list[Transfer | KvdError]:
        """A WatchTransfers stream's pulls, started as StartPulls would, their refusals counted."""
        try:
            results = self.daemon.start_pulls(orders)
        except KvdError as exc:
            self.metrics.errors.labels("WatchTransfers", exc.code.name).inc(len(orders))
            raise
        for result in results:
            if isinstance(result, KvdError):
                self.metrics.errors.labels("WatchTransfers", result.code.name).inc()
        return results

    @rpc
    async def CancelTransfer(
        self, request: router_pb2.CancelTransferRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.TransferStatus:
        transfer = self.daemon.cancel_transfer(request.transfer_id)
        if transfer.task is not None and not transfer.task.done():
            await asyncio.wait({transfer.task}, timeout=5.0)
        return convert.transfer_to_pb(transfer)

    @rpc
    async def LookupHeld(
        self, request: router_pb2.LookupHeldRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.LookupHeldResponse:
        held = self.daemon.lookup_held(request.engine_id, request.request_id)
        return router_pb2.LookupHeldResponse(held=[convert.params_to_pb(p) for p in held])

    @rpc
    async def RenewLease(
        self, request: router_pb2.RenewLeaseRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.LeaseInfo:
        lease = self.daemon.renew_lease(request.lease_id, request.ttl_ms / 1000.0)
        return lease_to_pb(self.daemon, lease)

    @rpc
    async def ReleaseLease(
        self, request: router_pb2.ReleaseLeaseRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ReleaseLeaseResponse:
        self.daemon.release_lease(request.lease_id)
        return router_pb2.ReleaseLeaseResponse()

    @rpc
    async def GetStatus(
        self, request: router_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.GetStatusResponse:
        s = self.daemon.status()
        now = time.monotonic()
        return router_pb2.GetStatusResponse(
            version=__version__,
            incarnation=s.incarnation,
            agent_name=s.agent_name,
            peer_address=s.peer_address,
            engines=[
                router_pb2.EngineSummary(
                    engine_id=r.engine_id,
                    tp_rank=r.tp_rank,
                    tp_size=r.spec.tp_size,
                    registered_bytes=r.registered_bytes,
                    stream_connected=r.stream_connected,
                    layout=convert.layout_to_pb(r.spec),
                    held_bytes=s.held_bytes.get((r.engine_id, r.tp_rank), (0, 0, 0))[0],
                    soft_held_bytes=s.held_bytes.get((r.engine_id, r.tp_rank), (0, 0, 0))[1],
                    draining_bytes=s.held_bytes.get((r.engine_id, r.tp_rank), (0, 0, 0))[2],
                )
                for r in s.engines
            ],
            peers=[
                router_pb2.PeerSummary(
                    address=p.address,
                    incarnation=p.incarnation,
                    agent_name=p.agent_name,
                    last_contact_s_ago=now - max(p.handshaken_at, self.last_contact.get(p.address, 0.0)),
                    framed_stream=self.framed(p.address),
                )
                for p in s.peers
            ],
            transfers_in_flight=s.transfers_in_flight,
            leases_held=s.leases_held,
            serving=s.serving,
            uptime_s=s.uptime_s,
            leases_draining=s.leases_draining,
            metrics_address=self.metrics_address,
            admitted_reads=s.admitted_reads,
            quarantined_bytes=s.quarantined_bytes,
            remote_agents=s.remote_agents,
            holds_ended=s.holds_ended,
            dataplane_pid=s.dataplane_pid,
            dataplane_restarts=s.dataplane_restarts,
            dataplane_last_restart=s.dataplane_last_restart,
            finishing_calls=s.finishing_calls,
        )

    @rpc
    async def SelftestHold(
        self, request: router_pb2.SelftestHoldRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.SelftestHoldResponse:
        # Validate before anything is touched: a bad request must not replace the scratch engine.
        if not 0 <= request.seed < SELFTEST_SEED_LIMIT:
            raise InvalidArgument(f"selftest seed must be in 0..2^63-1, got {request.seed}")
        if not 0 < request.size_bytes <= scratch.MAX_SCRATCH_BYTES:
            raise InvalidArgument(
                f"selftest size must be in 1..{scratch.MAX_SCRATCH_BYTES} bytes, got {request.size_bytes}"
            )
        spec, params = await self.daemon.selftest_hold(request.size_bytes, request.seed)
        return router_pb2.SelftestHoldResponse(
            kv_transfer_params=convert.params_to_pb(params), layout=convert.layout_to_pb(spec)
        )
