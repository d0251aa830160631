"""The engine service (Unix socket only): an engine rank registers its KV cache, holds blocks for
readers, and keeps two streams open: its events (pulls finished, leases over) and its scheduler's
hold checks. Thin: validate, call the core, translate."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from kvd.core.daemon import Daemon
from kvd.core.events import EngineEvent, FinishedRecving, FinishedSending, LoadFailed
from kvd.core.holdchecks import HoldCheckCommand, SchedulerChannel, SchedulerCommandItem
from kvd.core.registry import EngineRank
from kvd.server import convert
from kvd.server.edge import rpc
from kvd.server.lease_info import lease_to_pb
from kvd.server.pull_starts import READY, let_started_pulls_run, start_pulls_on_stream
from kvd_client.errors import InvalidArgument
from kvd_client.v1 import engine_pb2, engine_pb2_grpc

logger = logging.getLogger(__name__)

MAX_BATCH_EVENTS = 512
"""Most events in one batched stream message: a backlog (up to the rank's 65536 queued events, each
with its block ids) goes out in messages far below the channels' 64 MiB limit."""


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


def _messages(
    answers: list[engine_pb2.DaemonMessage], events: list[EngineEvent], batches: bool
) -> list[engine_pb2.DaemonMessage]:
    """What the stream writes when it runs: this stream's own answers (its ready, its pulls'
    PullsStarted), then the rank's events queued, one message each, or, to an engine that reads
    batches, one message carrying all of them (one write, one read, instead of one per event; at
    most MAX_BATCH_EVENTS in one). Nothing waits to fill a batch: it is whatever piled up while
    the writer was busy or asleep (e.g. the pulls that ended in one event-loop turn), so an idle
    stream still sends each event at once.

    Answers go first: a PullsStarted is queued in the same turn as its pulls start, so any event
    of those pulls is queued after it and leaves after it."""
    messages = [*answers, *map(_event_to_pb, events)] if answers else [_event_to_pb(event) for event in events]
    answers.clear()
    if not batches:
        return messages
    out: list[engine_pb2.DaemonMessage] = []
    for start in range(0, len(messages), MAX_BATCH_EVENTS):
        chunk = messages[start : start + MAX_BATCH_EVENTS]
        if len(chunk) == 1:
            out.append(chunk[0])
        else:
            out.append(engine_pb2.DaemonMessage(batch=engine_pb2.DaemonMessageBatch(messages=chunk)))
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
        # Answered once nothing of the daemon writes or reads the rank's memory (bounded).
        await self.daemon.unregister_engine(request.engine_id, request.tp_rank, until_let_go=True)
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
            lease=lease_to_pb(self.daemon, lease), kv_transfer_params=convert.params_to_pb(params)
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
        # by the engine's unregistration, by an answer queued and (below) by the end of the
        # engine's side, so the writer waits on the event alone (no future and asyncio.wait per
        # wake-up).
        wakeup: asyncio.Event = rank.wakeup
        # This stream's answers, never a successor's: a PullsStarted names the seq of this
        # stream's engine, which a later stream's engine may number again.
        answers: list[engine_pb2.DaemonMessage] = []
        reader = asyncio.get_running_loop().create_task(self._read_engine(rank, request_iterator, answers, wakeup))
        reader.add_done_callback(lambda _reader: wakeup.set())
        try:
            if first.hello.starts_pulls:
                yield READY  # alone, before the events the rank kept while no stream was open
            while not reader.done() and rank.stream_generation == generation:
                for message in _messages(answers, rank.drain(), batches):
                    yield message
                wakeup.clear()
                # A successor's attach may have woken us while we wrote: what it set is cleared
                # now, so look at the generation again before sleeping (else we would not end).
                if rank.pending or answers or reader.done() or rank.stream_generation != generation:
                    continue
                await wakeup.wait()
            if rank.stream_generation == generation:  # a superseded stream leaves events to its successor
                for message in _messages(answers, rank.drain(), batches):
                    yield message
            if reader.done() and reader.exception() is not None:
                raise reader.exception()  # type: ignore[misc]
        finally:
            reader.cancel()
            self.daemon.detach_stream(rank, generation)

    async def _read_engine(
        self,
        rank: EngineRank,
        request_iterator: AsyncIterator[engine_pb2.EngineMessage],
        answers: list[engine_pb2.DaemonMessage],
        wakeup: asyncio.Event,
    ) -> None:
        async for message in request_iterator:
            kind = message.WhichOneof("kind")
            if kind == "commit":
                self.daemon.commit(rank, message.commit.request_id, message.commit.committed_tokens)
            elif kind == "post_forward":
                pf = message.post_forward
                self.daemon.post_forward(rank, pf.step, list(pf.finished_request_ids))
            elif kind == "start_pulls":
                # The answer is queued at once (so it leaves before any event of its pulls), the
                # writer woken only once the pulls' admissions are on their way (their critical
                # path; the answer is not on it).
                answers.append(start_pulls_on_stream(self.daemon, rank, message.start_pulls))
                await let_started_pulls_run()
                wakeup.set()
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
