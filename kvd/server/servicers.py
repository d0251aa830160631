"""Thin servicers: validate, call the core, translate. No logic lives here."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping

import grpc

from kvd import __version__
from kvd.core import scratch
from kvd.core.daemon import Daemon, PullOrder
from kvd.core.events import EngineEvent, FinishedRecving, FinishedSending, LoadFailed
from kvd.core.holdchecks import HoldCheckCommand, SchedulerChannel, SchedulerCommandItem
from kvd.core.leases import Lease
from kvd.core.peers import PrepareRequest
from kvd.core.registry import EngineRank
from kvd.server import convert
from kvd.server.edge import bounded, rpc
from kvd.server.peer_stream import PeerHandlers, serve_peer_stream
from kvd.server.watch_stream import serve_watch_stream
from kvd_client.errors import InvalidArgument, KvdError
from kvd_client.v1 import common_pb2, engine_pb2, engine_pb2_grpc, peer_pb2, peer_pb2_grpc, router_pb2, router_pb2_grpc

logger = logging.getLogger(__name__)

MAX_BATCH_EVENTS = 512
"""Most events in one batched stream message: a backlog (up to the rank's 65536 queued events, each
with its block ids) goes out in messages far below the channels' 64 MiB limit."""

SELFTEST_SEED_LIMIT = 1 << 63
"""The scratch pattern computes in signed 64-bit words: larger seeds would overflow."""


def _lease_to_pb(daemon: Daemon, lease: Lease) -> common_pb2.LeaseInfo:
    params = daemon.params_of(lease)
    return common_pb2.LeaseInfo(
        lease_id=lease.lease_id,
        engine_id=lease.engine_id,
        request_id=lease.request_id,
        block_ids=list(lease.block_ids),
        num_tokens=lease.num_tokens,
        expires_unix_ms=params.lease_expires_unix_ms,
        group_block_ids=list(params.group_block_ids),
        group_block_counts=list(params.group_block_counts),
    )


def _event_to_pb(event: EngineEvent) -> engine_pb2.DaemonMessage:
    if isinstance(event, FinishedSending):
        return engine_pb2.DaemonMessage(
            finished_sending=engine_pb2.FinishedSending(
                request_id=event.request_id, lease_id=event.lease_id, expired=event.expired
            )
        )
    if isinstance(event, FinishedRecving):
        return engine_pb2.DaemonMessage(
            finished_recving=engine_pb2.FinishedRecving(request_id=event.request_id, transfer_id=event.transfer_id)
        )
    assert isinstance(event, LoadFailed)
    return engine_pb2.DaemonMessage(
        load_failed=engine_pb2.LoadFailed(
            request_id=event.request_id,
            transfer_id=event.transfer_id,
            error_code=event.error_code,
            error_message=event.error_message,
            block_ids=list(event.block_ids),
            error_class=event.error_class,
        )
    )


def _messages(events: list[EngineEvent], batches: bool) -> list[engine_pb2.DaemonMessage]:
    """What the stream writes for the events queued when it runs: one message per event, or, to an
    engine that reads batches, one message carrying all of them (one write, one read, instead of
    one per event; at most MAX_BATCH_EVENTS in one). Nothing waits to fill a batch: it is whatever
    piled up while the writer was busy or asleep (e.g. the pulls that ended in one event-loop
    turn), so an idle stream still sends each event at once."""
    if not batches:
        return [_event_to_pb(event) for event in events]
    out: list[engine_pb2.DaemonMessage] = []
    for start in range(0, len(events), MAX_BATCH_EVENTS):
        chunk = events[start : start + MAX_BATCH_EVENTS]
        if len(chunk) == 1:
            out.append(_event_to_pb(chunk[0]))
        else:
            out.append(engine_pb2.DaemonMessage(batch=engine_pb2.DaemonMessageBatch(messages=map(_event_to_pb, chunk))))
    return out


class EngineServicer(engine_pb2_grpc.EngineServiceServicer):
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.metrics = daemon.metrics

    @rpc
    async def RegisterKvCache(
        self, request: engine_pb2.RegisterKvCacheRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.RegisterKvCacheResponse:
        if not request.HasField("layout"):
            raise InvalidArgument("layout is required")
        spec = convert.layout_from_pb(request.layout)
        regions = [convert.region_from_pb(region, i) for i, region in enumerate(request.regions)]
        placements = [convert.placement_from_pb(p) for p in request.layers]
        groups = [convert.group_from_pb(g, i) for i, g in enumerate(request.groups, start=1)]
        rank = await self.daemon.register_engine(
            request.engine_id, spec, regions, placements, request.require_commits, request.engine_pid, groups
        )
        return engine_pb2.RegisterKvCacheResponse(
            daemon_incarnation=self.daemon.incarnation,
            agent_name=self.daemon.agent_name,
            registration_id=rank.registration_id,
        )

    @rpc
    async def UnregisterKvCache(
        self, request: engine_pb2.UnregisterKvCacheRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.UnregisterKvCacheResponse:
        await self.daemon.unregister_engine(request.engine_id, request.tp_rank)
        return engine_pb2.UnregisterKvCacheResponse()

    @rpc
    async def HoldBlocks(
        self, request: engine_pb2.HoldBlocksRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.HoldBlocksResponse:
        lease, params = self.daemon.hold(
            request.engine_id,
            request.request_id,
            list(request.block_ids),
            request.num_tokens,
            request.ttl_ms / 1000.0,
            convert.group_ids_from_pb(request.group_block_ids, request.group_block_counts, "hold"),
            soft=request.soft,
        )
        return engine_pb2.HoldBlocksResponse(
            lease=_lease_to_pb(self.daemon, lease), kv_transfer_params=convert.params_to_pb(params)
        )

    @rpc
    async def EngineStream(
        self, request_iterator: AsyncIterator[engine_pb2.EngineMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.DaemonMessage]:
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("kind") != "hello":
            raise InvalidArgument("the first message of an engine stream must be hello(engine_id, tp_rank)")
        rank, generation = self.daemon.attach_stream(first.hello.engine_id, first.hello.tp_rank)
        batches = first.hello.accepts_batches
        # This stream's own event: set by every event posted, by a stream superseding this one,
        # by the engine's unregistration and (below) by the end of the engine's side, so the
        # writer waits on the event alone (no future and asyncio.wait per wake-up).
        wakeup: asyncio.Event = rank.wakeup
        reader = asyncio.get_running_loop().create_task(self._read_engine(rank, request_iterator))
        reader.add_done_callback(lambda _reader: wakeup.set())
        try:
            while not reader.done() and rank.stream_generation == generation:
                for message in _messages(rank.drain(), batches):
                    yield message
                wakeup.clear()
                if rank.pending or reader.done():
                    continue
                await wakeup.wait()
            if rank.stream_generation == generation:  # a superseded stream leaves events to its successor
                for message in _messages(rank.drain(), batches):
                    yield message
            if reader.done() and reader.exception() is not None:
                raise reader.exception()  # type: ignore[misc]
        finally:
            reader.cancel()
            self.daemon.detach_stream(rank, generation)

    async def _read_engine(self, rank: EngineRank, request_iterator: AsyncIterator[engine_pb2.EngineMessage]) -> None:
        async for message in request_iterator:
            kind = message.WhichOneof("kind")
            if kind == "commit":
                self.daemon.commit(rank, message.commit.request_id, message.commit.committed_tokens)
            elif kind == "post_forward":
                pf = message.post_forward
                self.daemon.post_forward(rank, pf.step, list(pf.finished_request_ids))
            else:
                raise InvalidArgument(f"unexpected {kind!r} message on an open engine stream")

    @rpc
    async def SchedulerStream(
        self, request_iterator: AsyncIterator[engine_pb2.SchedulerMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.SchedulerCommand]:
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("kind") != "hello" or not first.hello.engine_id:
            raise InvalidArgument("the first message of a scheduler stream must be hello(engine_id)")
        channel = self.daemon.scheduler_attached(first.hello.engine_id)
        reader = asyncio.get_running_loop().create_task(self._read_scheduler(channel, request_iterator))
        try:
            while not channel.closed:
                getter = asyncio.ensure_future(channel.outbox.get())
                await asyncio.wait({getter, reader}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    break
                item = getter.result()
                if item is None:
                    break
                yield _command_to_pb(item)
            if reader.done() and not reader.cancelled() and reader.exception() is not None:
                raise reader.exception()  # type: ignore[misc]
        finally:
            reader.cancel()
            self.daemon.scheduler_detached(channel)

    async def _read_scheduler(
        self, channel: SchedulerChannel, request_iterator: AsyncIterator[engine_pb2.SchedulerMessage]
    ) -> None:
        async for message in request_iterator:
            kind = message.WhichOneof("kind")
            if kind == "check_result":
                result = message.check_result
                self.daemon.holdchecks.answer(channel, result.seq, result.ok, result.reason)
            elif kind == "renew":
                self.daemon.remote_leases([(x.daemon_address, x.lease_id) for x in message.renew.leases], release=False)
            elif kind == "release":
                release = message.release
                self.daemon.remote_leases(
                    [(x.daemon_address, x.lease_id) for x in release.leases], release=True, reason=release.reason
                )
            else:
                raise InvalidArgument(f"unexpected {kind!r} message on an open scheduler stream")


async def _let_started_pulls_run() -> None:
    """Yield to the event loop twice before answering StartPull(s): the pulls just started plan
    and queue their PreparePull (first turn), and the peer stream's writer sends it (second).

    The holder's admission is on each pull's critical path; this answer is not (an engine waits
    for the pull's end on its engine stream, a router for its status). Sending the answer first
    delayed every pull's admission by the answer's own cost: kvd bench, one pull in flight, the
    reader's "planned" phase 0.44-0.49 ms before, 0.15-0.25 ms after (docs/performance.md).
    """
    for _ in range(2):
        await asyncio.sleep(0)


def _command_to_pb(item: SchedulerCommandItem) -> engine_pb2.SchedulerCommand:
    if isinstance(item, HoldCheckCommand):
        return engine_pb2.SchedulerCommand(
            check=engine_pb2.HoldCheck(
                seq=item.seq,
                request_id=item.request_id,
                lease_id=item.lease_id,
                pin_id=item.pin_id,
                action=int(item.action),  # type: ignore[arg-type]
            )
        )
    return engine_pb2.SchedulerCommand(
        hold_ended=engine_pb2.HoldEnded(request_id=item.request_id, lease_id=item.lease_id, reason=item.reason)
    )


class PeerServicer(peer_pb2_grpc.PeerServiceServicer):
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.metrics = daemon.metrics

    @rpc
    async def Handshake(
        self, request: peer_pb2.HandshakeRequest, context: grpc.aio.ServicerContext
    ) -> peer_pb2.HandshakeResponse:
        self.daemon.require_serving()
        return convert.handshake_to_pb(self.daemon.handshake_info())

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
        )
        return peer_pb2.FinishReadResponse()

    async def _renew_leases(self, request: peer_pb2.RenewLeasesRequest) -> peer_pb2.RenewLeasesResponse:
        return peer_pb2.RenewLeasesResponse(unknown_lease_ids=self.daemon.renew_leases(list(request.lease_ids)))

    async def _release_leases(self, request: peer_pb2.ReleaseLeasesRequest) -> peer_pb2.ReleaseLeasesResponse:
        self.daemon.release_leases(list(request.lease_ids), request.reason or "released by the reader's daemon")
        return peer_pb2.ReleaseLeasesResponse()


def _pull_order(request: router_pb2.StartPullRequest) -> PullOrder:
    """The core's arguments of one pull (StartPull, or an item of StartPulls)."""
    if not request.HasField("remote"):
        raise InvalidArgument("remote kv_transfer_params are required")
    return PullOrder(
        engine_id=request.engine_id,
        tp_rank=request.tp_rank,
        request_id=request.request_id,
        local_block_ids=list(request.local_block_ids),
        remote=convert.params_from_pb(request.remote),
        deadline_s=request.deadline_ms / 1000.0,
        local_group_block_ids=convert.group_ids_from_pb(
            request.local_group_block_ids, request.local_group_block_counts, "start pull"
        ),
    )


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    def __init__(self, daemon: Daemon, last_contact: Mapping[str, float] | None = None) -> None:
        self.daemon = daemon
        self.metrics = daemon.metrics
        self.last_contact = last_contact if last_contact is not None else {}  # peer address -> monotonic time
        self.metrics_address = ""  # set by the app once /metrics listens

    @rpc
    async def StartPull(
        self, request: router_pb2.StartPullRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.StartPullResponse:
        transfer = self.daemon.start_order(_pull_order(request))
        await _let_started_pulls_run()
        return router_pb2.StartPullResponse(transfer_id=transfer.transfer_id)

    @rpc
    async def StartPulls(
        self, request: router_pb2.StartPullsRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.StartPullsResponse:
        orders: list[PullOrder | KvdError] = []
        for item in request.pulls:
            try:
                orders.append(_pull_order(item))
            except KvdError as exc:  # that item's result (results[i] answers pulls[i])
                orders.append(exc)
        results = self.daemon.start_pulls(orders)
        await _let_started_pulls_run()
        response = router_pb2.StartPullsResponse()
        for result in results:
            if isinstance(result, KvdError):
                self.metrics.errors.labels("StartPulls", result.code.name).inc()
                response.results.add(
                    error_code=result.code.name,
                    error_message=bounded(result.message),
                    error_class=type(result).__name__,
                )
            else:
                response.results.add(transfer_id=result.transfer_id)
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
        self.daemon.require_serving()
        async for response in serve_watch_stream(self.daemon.watches, self.daemon.incarnation, requests):
            yield response

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
        return _lease_to_pb(self.daemon, lease)

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
