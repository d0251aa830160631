"""Pulls started by the edge: StartPull and StartPulls (router service), and an engine step's pulls
on its own engine stream (``EngineMessage.start_pulls``). One reading of a pull's request, one
answer per pull, the same checks whichever way the pulls came."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence

from kvd.core.daemon import Daemon, PullOrder
from kvd.core.metrics import Metrics
from kvd.core.registry import EngineRank
from kvd.core.transfers import Transfer
from kvd.server import convert
from kvd.server.edge import bounded
from kvd.server.request_bounds import clip
from kvd_client.errors import InvalidArgument, KvdError
from kvd_client.v1 import engine_pb2, router_pb2

READY = engine_pb2.DaemonMessage(ready=engine_pb2.StreamReady(takes_pulls=True))
"""The first message to an engine whose hello has ``starts_pulls``: it may start pulls here."""


async def let_started_pulls_run() -> None:
    """Yield to the event loop twice before answering pulls just started: those not started warm
    plan and queue their PreparePull (first turn), and the peer stream's writer sends it (second).
    (A warm pull's admission left within StartPulls already: kvd.core.start_posts.)

    The holder's admission is on each pull's critical path; the answer is not (an engine waits
    for the pull's end on its engine stream, a router for its status). Sending the answer first
    delayed every pull's admission by the answer's own cost: kvd bench, one pull in flight, the
    reader's "planned" phase 0.44-0.49 ms before, 0.15-0.25 ms after (docs/performance.md).
    """
    for _ in range(2):
        await asyncio.sleep(0)


def pull_order(request: router_pb2.StartPullRequest, rank: EngineRank | None = None) -> PullOrder:
    """The core's arguments of one pull (StartPull, an item of StartPulls or of a stream's pulls),
    for the engine rank the request names, or for ``rank`` (a stream's own: its items may leave it out)."""
    if not request.HasField("remote"):
        raise InvalidArgument("remote kv_transfer_params are required")
    return PullOrder(
        engine_id=request.engine_id if rank is None else rank.engine_id,
        tp_rank=request.tp_rank if rank is None else rank.tp_rank,
        request_id=request.request_id,
        local_block_ids=list(request.local_block_ids),
        remote=convert.params_from_pb(request.remote),
        deadline_s=request.deadline_ms / 1000.0,
        local_group_block_ids=convert.group_ids_from_pb(
            request.local_group_block_ids, request.local_group_block_counts, "start pull"
        ),
    )


def read_orders(
    requests: Iterable[router_pb2.StartPullRequest],
    read: Callable[[router_pb2.StartPullRequest], PullOrder] = pull_order,
) -> list[PullOrder | KvdError]:
    """Each request's order, or the error reading it failed with (that item's own result, so
    results keep the caller's indices)."""
    orders: list[PullOrder | KvdError] = []
    for request in requests:
        try:
            orders.append(read(request))
        except KvdError as exc:
            orders.append(exc)
    return orders


def result_to_pb(into: router_pb2.StartPullResult, result: Transfer | KvdError) -> None:
    """One pull's answer: its transfer id, or the exact error it failed with."""
    if isinstance(result, KvdError):
        into.error_code = result.code.name
        into.error_message = bounded(result.message)
        into.error_class = type(result).__name__
    else:
        into.transfer_id = result.transfer_id


def add_results(
    into: router_pb2.StartPullsResponse | engine_pb2.PullsStarted,
    results: Sequence[Transfer | KvdError],
    metrics: Metrics,
    method: str,
) -> None:
    """Each pull's answer, in order: its transfer id, or the exact error it failed with."""
    for result in results:
        if isinstance(result, KvdError):
            metrics.errors.labels(method, result.code.name).inc()
        result_to_pb(into.results.add(), result)


def _stream_order(rank: EngineRank, request: router_pb2.StartPullRequest) -> PullOrder:
    """One pull of a stream's StartPullsOnStream, for the stream's own rank."""
    if request.engine_id and (request.engine_id != rank.engine_id or request.tp_rank != rank.tp_rank):
        raise InvalidArgument(
            f"a pull on the engine stream of {rank.engine_id!r} rank {rank.tp_rank} names engine "
            f"{clip(request.engine_id)!r} rank {request.tp_rank}: leave engine_id empty, or start it with StartPull"
        )
    return pull_order(request, rank)


def start_pulls_on_stream(
    daemon: Daemon, rank: EngineRank, message: engine_pb2.StartPullsOnStream
) -> engine_pb2.DaemonMessage:
    """Start a stream's pulls, each on its own as StartPulls would; the PullsStarted answering them.

    Nothing here ends the stream: a message over the per-call bound, or a daemon not serving,
    fails each of its pulls (nothing starts), and a bad item fails only itself.
    """
    orders = read_orders(message.pulls, lambda item: _stream_order(rank, item))
    try:
        results: Sequence[Transfer | KvdError] = daemon.start_pulls(orders)
    except KvdError as exc:  # the whole message refused: every pull says why
        results = [exc] * len(orders)
    answer = engine_pb2.DaemonMessage()
    answer.pulls_started.seq = message.seq
    add_results(answer.pulls_started, results, daemon.metrics, "EngineStream")
    return answer
