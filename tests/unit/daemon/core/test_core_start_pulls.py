"""StartPulls: a batch of pulls, each checked and started on its own (the core and its servicer).

Two real :class:`kvd.core.daemon.Daemon` objects over the fake data planes of lifetime_fakes.py
(as in test_core_lifetimes.py): the valid pulls of a batch start and finish, each bad one fails
alone with the error StartPull would have raised for it, and a batch over the bound starts nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest
from kvtest import small_spec
from lifetime_fakes import SAFETY_TIMEOUT_S, Fabric, Node

import kvd.core.pulls as pulls_module
from kvd.core.events import FinishedRecving
from kvd.core.pulls import PullOrder
from kvd.core.transfers import Transfer, TransferState
from kvd.server import convert
from kvd.server.servicers import RouterServicer
from kvd_client import errors
from kvd_client.v1 import common_pb2, router_pb2

HOLDER, READER = "holder.test:1", "reader.test:1"
HOLD_BLOCKS, NUM_TOKENS = [0, 1, 2], 40  # 2 full blocks + 8 tokens: 3 blocks of 16, 2 READs


def run(fabric: Fabric, scenario: Callable[[], Awaitable[None]]) -> None:
    async def main() -> None:
        try:
            await scenario()
            assert fabric.violations == []
        finally:
            await fabric.close()

    asyncio.run(main())


async def pair(fabric: Fabric) -> tuple[Node, Node]:
    holder = await fabric.start_node(HOLDER)
    reader = await fabric.start_node(READER)
    await fabric.register(holder, "eng-h", small_spec(8))
    await fabric.register(reader, "eng-r", small_spec(8))
    return holder, reader


async def finish_all(reader: Node, transfers: list[Transfer]) -> None:
    """Let every READ of ``transfers`` end well, then wait for the pulls to end."""
    async with asyncio.timeout(SAFETY_TIMEOUT_S):
        while not all(t.state.final for t in transfers):
            for xfer in reader.dataplane.live():
                reader.dataplane.finish(xfer)
            await asyncio.sleep(0.001)


class FakeContext:
    """The part of grpc.aio.ServicerContext the server edge uses when a call fails."""

    def __init__(self) -> None:
        self.trailing: Any = None
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    def set_trailing_metadata(self, metadata: Any) -> None:
        self.trailing = metadata

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborted = (code, details)
        raise grpc.aio.AbortError()


def test_each_pull_of_a_batch_starts_or_fails_on_its_own(fabric: Fabric) -> None:
    """Valid orders start and finish (their rank hears FinishedRecving); each bad one is its own
    precise error and starts nothing; an order the edge could not read is passed through as is."""

    async def scenario() -> None:
        holder, reader = await pair(fabric)
        params = {r: holder.daemon.hold("eng-h", r, HOLD_BLOCKS, NUM_TOKENS)[1] for r in ("a", "b", "c")}
        unreadable = errors.InvalidArgument("remote kv_transfer_params are required")
        results = reader.daemon.start_pulls(
            [
                PullOrder("eng-r", 0, "a", [3, 4, 5], params["a"]),
                unreadable,
                PullOrder("nosuch", 0, "b", [3, 4, 5], params["b"]),
                PullOrder("eng-r", 0, "b", [6, 7], params["b"]),
                PullOrder("eng-r", 0, "b", [6, 7, 0], params["b"], deadline_s=-1.0),
                PullOrder("eng-r", 0, "c", [6, 7, 0], params["c"]),
            ]
        )
        assert [type(r).__name__ for r in results] == [
            "Transfer",
            "InvalidArgument",
            "UnknownEngine",
            "InvalidArgument",
            "InvalidArgument",
            "Transfer",
        ]
        assert results[1] is unreadable
        assert "need 3 local blocks" in str(results[3]) and "deadline must be >= 0" in str(results[4])
        started = [r for r in results if isinstance(r, Transfer)]
        assert sorted(t.request_id for t in reader.daemon.transfers.in_flight()) == ["a", "c"]
        await finish_all(reader, started)
        assert [t.state for t in started] == [TransferState.DONE, TransferState.DONE]
        rank = reader.daemon.registry.get("eng-r", 0)
        recved = [e for e in rank.pending if isinstance(e, FinishedRecving)]
        assert sorted(e.request_id for e in recved) == ["a", "c"]
        # b's lease was never read: its holder still holds it for another reader.
        assert "b" in [lease.request_id for lease in holder.daemon.leases.all()]

    run(fabric, scenario)


def test_a_batch_over_the_bound_starts_nothing(fabric: Fabric, monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        holder, reader = await pair(fabric)
        monkeypatch.setattr(pulls_module, "MAX_PULLS_PER_CALL", 2)
        _, params = holder.daemon.hold("eng-h", "a", HOLD_BLOCKS, NUM_TOKENS)
        order = PullOrder("eng-r", 0, "a", [3, 4, 5], params)
        with pytest.raises(
            errors.InvalidArgument,
            match="at most 2 pulls start together \\(one StartPulls, or one stream message\\), got 3",
        ):
            reader.daemon.start_pulls([order, order, order])
        assert reader.daemon.transfers.in_flight() == []
        assert reader.daemon.start_pulls([]) == []

    run(fabric, scenario)


def test_the_servicer_answers_each_item_with_its_transfer_or_its_error(fabric: Fabric) -> None:
    """StartPulls over the servicer: results in the request's order, errors by code, message and
    exact class; a too-large batch fails the call INVALID_ARGUMENT naming the bound."""

    async def scenario() -> None:
        holder, reader = await pair(fabric)
        servicer = RouterServicer(reader.daemon)
        remote = {r: convert.params_to_pb(holder.daemon.hold("eng-h", r, HOLD_BLOCKS, NUM_TOKENS)[1]) for r in "ab"}
        request = router_pb2.StartPullsRequest(
            pulls=[
                router_pb2.StartPullRequest(
                    engine_id="eng-r", request_id="a", local_block_ids=[3, 4, 5], remote=remote["a"]
                ),
                router_pb2.StartPullRequest(engine_id="eng-r", request_id="x", local_block_ids=[3, 4, 5]),
                router_pb2.StartPullRequest(
                    engine_id="eng-r", request_id="y", local_block_ids=[3, 4, 5], remote=remote["b"], tp_rank=3
                ),
                router_pb2.StartPullRequest(
                    engine_id="eng-r",
                    request_id="z",
                    local_block_ids=[6, 7, 0],
                    remote=remote["b"],
                    local_group_block_counts=[2],
                ),
                router_pb2.StartPullRequest(
                    engine_id="eng-r", request_id="b", local_block_ids=[6, 7, 0], remote=remote["b"]
                ),
            ]
        )
        response = await servicer.StartPulls(request, FakeContext())
        got = [(r.transfer_id != "", r.error_code, r.error_class) for r in response.results]
        assert got == [
            (True, "", ""),
            (False, "INVALID_ARGUMENT", "InvalidArgument"),
            (False, "NOT_FOUND", "UnknownEngine"),
            (False, "INVALID_ARGUMENT", "InvalidArgument"),
            (True, "", ""),
        ]
        assert "remote kv_transfer_params are required" in response.results[1].error_message
        ids = [response.results[0].transfer_id, response.results[4].transfer_id]
        assert sorted(t.transfer_id for t in reader.daemon.transfers.in_flight()) == sorted(ids)
        await finish_all(reader, [reader.daemon.transfers.get(i) for i in ids])
        assert reader.metric("kvd_errors_total", operation="StartPulls", code="INVALID_ARGUMENT") == 2

        context = FakeContext()
        too_many = router_pb2.StartPullsRequest(
            pulls=[router_pb2.StartPullRequest()] * (pulls_module.MAX_PULLS_PER_CALL + 1)
        )
        with pytest.raises(grpc.aio.AbortError):
            await servicer.StartPulls(too_many, context)
        assert context.aborted is not None and context.aborted[0] is grpc.StatusCode.INVALID_ARGUMENT
        assert f"at most {pulls_module.MAX_PULLS_PER_CALL} pulls" in context.aborted[1]
        assert ("kvd-error-class", "InvalidArgument") in context.trailing

    run(fabric, scenario)


def test_start_pull_answers_after_its_pulls_asked_the_holder_for_admission(fabric: Fabric) -> None:
    """The holder's admission is on a pull's critical path, the StartPull(s) answer is not: by the
    time the servicer answers, each pull it started has planned and sent its PreparePull (the
    handshake cached by an earlier pull)."""

    async def scenario() -> None:
        holder, reader = await pair(fabric)
        servicer = RouterServicer(reader.daemon)

        def pull(request_id: str, first_block: int) -> router_pb2.StartPullRequest:
            remote = convert.params_to_pb(holder.daemon.hold("eng-h", request_id, HOLD_BLOCKS, NUM_TOKENS)[1])
            blocks = [first_block, first_block + 1, first_block + 2]
            return router_pb2.StartPullRequest(
                engine_id="eng-r", request_id=request_id, local_block_ids=blocks, remote=remote
            )

        warm = await servicer.StartPull(pull("warm", 0), FakeContext())  # handshakes: awaits the holder
        await finish_all(reader, [reader.daemon.transfers.get(warm.transfer_id)])

        def admission_asked(transfer_id: str) -> bool:
            asked = transfer_id in [p["reader_transfer_id"] for p in reader.transport.prepares]
            return asked and "planned" in reader.daemon.transfers.get(transfer_id).phases

        one = await servicer.StartPull(pull("one", 3), FakeContext())
        assert admission_asked(one.transfer_id)
        batch = await servicer.StartPulls(
            router_pb2.StartPullsRequest(pulls=[pull("two", 0), pull("three", 5)]), FakeContext()
        )
        ids = [r.transfer_id for r in batch.results]
        assert all(ids) and all(admission_asked(i) for i in ids)
        await finish_all(reader, [reader.daemon.transfers.get(i) for i in [one.transfer_id, *ids]])

    run(fabric, scenario)


def test_a_pull_order_is_what_start_pull_takes() -> None:
    """StartPull and StartPulls read a request the same way (one conversion)."""
    remote = common_pb2.KvTransferParams(daemon_address="h:1", lease_id="l", engine_id="e", num_tokens=4)
    from kvd.server.servicers import _pull_order

    order = _pull_order(
        router_pb2.StartPullRequest(engine_id="e", tp_rank=1, request_id="r", remote=remote, deadline_ms=1500)
    )
    assert (order.engine_id, order.tp_rank, order.request_id, order.deadline_s) == ("e", 1, "r", 1.5)
    with pytest.raises(errors.InvalidArgument, match="remote kv_transfer_params are required"):
        _pull_order(router_pb2.StartPullRequest(engine_id="e"))


def test_the_engine_stream_sends_what_is_queued_as_one_message_to_an_engine_that_reads_batches() -> None:
    from kvd.core.events import FinishedSending, LoadFailed
    from kvd.server import servicers

    events = [
        FinishedRecving("a", "t1"),
        LoadFailed("b", "t2", "NOT_FOUND", "gone", (3, 4), "UnknownLease"),
        FinishedSending("c", "l1", expired=True),
    ]
    (one,) = servicers._messages([], events, batches=True)
    inner = one.batch.messages
    assert [m.WhichOneof("kind") for m in inner] == ["finished_recving", "load_failed", "finished_sending"]
    assert inner[1].load_failed.error_class == "UnknownLease" and list(inner[1].load_failed.block_ids) == [3, 4]
    assert [m.WhichOneof("kind") for m in servicers._messages([], events, batches=False)] == [
        "finished_recving",
        "load_failed",
        "finished_sending",
    ]
    (single,) = servicers._messages([], events[:1], batches=True)  # alone: no batch around it
    assert single.WhichOneof("kind") == "finished_recving"
    many = [FinishedRecving(f"r{i}", "t") for i in range(servicers.MAX_BATCH_EVENTS + 1)]
    sizes = [len(m.batch.messages) or 1 for m in servicers._messages([], many, batches=True)]
    assert sizes == [servicers.MAX_BATCH_EVENTS, 1]
