"""kvd.server.pull_starts: an engine step's pulls started on its own engine stream
(``EngineMessage.start_pulls``), and what the stream writes (kvd.server.engine_servicer._messages).

Fakes for the Daemon (only ``start_pulls`` and ``metrics.errors.labels(...).inc()`` are used) and
for the stream's EngineRank (its engine_id and tp_rank): each item is checked for the stream's own
rank and fails alone, a whole message refused fails every item, the answer echoes the seq and
keeps each error's exact class.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import types
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import pytest

from kvd.core.engines import Engines
from kvd.core.events import EngineEvent, FinishedRecving, FinishedSending, LoadFailed
from kvd.core.pulls import PullOrder
from kvd.core.registry import EngineRank
from kvd.server import engine_servicer
from kvd.server.engine_servicer import MAX_BATCH_EVENTS, _messages
from kvd.server.pull_starts import READY, start_pulls_on_stream
from kvd_client import errors, pull_results
from kvd_client.v1 import common_pb2, engine_pb2, router_pb2


@dataclasses.dataclass
class FakeTransfer:
    transfer_id: str


class FakeCounter:
    def __init__(self, counts: collections.Counter[tuple[str, ...]], labels: tuple[str, ...]) -> None:
        self.counts, self.key = counts, labels

    def inc(self) -> None:
        self.counts[self.key] += 1


class FakeErrors:
    def __init__(self) -> None:
        self.counts: collections.Counter[tuple[str, ...]] = collections.Counter()

    def labels(self, *labels: str) -> FakeCounter:
        return FakeCounter(self.counts, labels)


class FakeMetrics:
    def __init__(self) -> None:
        self.errors = FakeErrors()


class FakeDaemon:
    """Daemon.start_pulls: records each call's orders; answers each order that is not already an
    error with ``results`` (by request_id) or a transfer named after it; or raises ``refuse``."""

    def __init__(self, refuse: errors.KvdError | None = None, results: dict[str, Any] | None = None) -> None:
        self.metrics = FakeMetrics()
        self.calls: list[list[PullOrder | errors.KvdError]] = []
        self.refuse = refuse
        self.results = results or {}

    def start_pulls(self, orders: Sequence[PullOrder | errors.KvdError]) -> list[Any]:
        self.calls.append(list(orders))
        if self.refuse is not None:
            raise self.refuse
        out: list[Any] = []
        for order in orders:
            if isinstance(order, errors.KvdError):
                out.append(order)
            else:
                out.append(self.results.get(order.request_id, FakeTransfer(f"xfer-{order.request_id}")))
        return out


@dataclasses.dataclass
class FakeRank:
    engine_id: str
    tp_rank: int


RANK = FakeRank("reader", 1)
REMOTE = common_pb2.KvTransferParams(
    daemon_address="holder.test:1",
    daemon_incarnation="inc-1",
    engine_id="holder",
    tp_size=2,
    lease_id="lease-1",
    block_ids=[0, 1, 2],
    num_tokens=40,
    request_id="up-1",
)


def pull(request_id: str, **fields: Any) -> router_pb2.StartPullRequest:
    fields.setdefault("remote", REMOTE)
    return router_pb2.StartPullRequest(request_id=request_id, local_block_ids=[5, 6, 7], **fields)


def message(seq: int, pulls: Sequence[router_pb2.StartPullRequest]) -> engine_pb2.StartPullsOnStream:
    return engine_pb2.StartPullsOnStream(seq=seq, pulls=pulls)


def started(answer: engine_pb2.DaemonMessage) -> engine_pb2.PullsStarted:
    assert answer.WhichOneof("kind") == "pulls_started", answer
    return answer.pulls_started


def test_an_empty_engine_id_takes_the_streams_rank_and_its_order_is_the_requests() -> None:
    daemon = FakeDaemon()
    request = pull("r0", tp_rank=7, deadline_ms=2500)  # engine_id empty: the stream's rank, tp_rank too
    answer = started(start_pulls_on_stream(daemon, RANK, message(3, [request])))  # type: ignore[arg-type]

    assert answer.seq == 3
    assert [r.transfer_id for r in answer.results] == ["xfer-r0"]
    assert not answer.results[0].error_code
    ((order,),) = daemon.calls
    assert isinstance(order, PullOrder)
    assert (order.engine_id, order.tp_rank) == ("reader", 1)
    assert order.request_id == "r0"
    assert list(order.local_block_ids) == [5, 6, 7]
    assert order.deadline_s == pytest.approx(2.5)
    assert order.remote.lease_id == "lease-1" and order.remote.daemon_address == "holder.test:1"
    assert tuple(order.remote.block_ids) == (0, 1, 2) and order.remote.num_tokens == 40
    assert daemon.metrics.errors.counts == {}


def test_the_streams_own_engine_and_rank_named_is_accepted() -> None:
    daemon = FakeDaemon()
    answer = started(start_pulls_on_stream(daemon, RANK, message(1, [pull("r0", engine_id="reader", tp_rank=1)])))  # type: ignore[arg-type]
    assert [r.transfer_id for r in answer.results] == ["xfer-r0"]
    ((order,),) = daemon.calls
    assert isinstance(order, PullOrder) and (order.engine_id, order.tp_rank) == ("reader", 1)


def test_items_naming_another_engine_or_rank_or_without_remote_fail_alone() -> None:
    daemon = FakeDaemon()
    pulls = [
        pull("good-0"),
        pull("other-engine", engine_id="holder", tp_rank=1),
        pull("good-1", engine_id="reader", tp_rank=1),
        pull("other-rank", engine_id="reader", tp_rank=0),
        router_pb2.StartPullRequest(request_id="no-remote", local_block_ids=[1]),
        pull("good-2"),
    ]
    answer = started(start_pulls_on_stream(daemon, RANK, message(9, pulls)))  # type: ignore[arg-type]

    assert answer.seq == 9
    assert len(answer.results) == len(pulls)
    results = pull_results(answer, len(pulls))
    assert results[0] == "xfer-good-0" and results[2] == "xfer-good-1" and results[5] == "xfer-good-2"
    for index in (1, 3, 4):
        assert type(results[index]) is errors.InvalidArgument, (index, results[index])
        assert answer.results[index].error_code == "INVALID_ARGUMENT"
        assert answer.results[index].error_class == "InvalidArgument"
        assert not answer.results[index].transfer_id
    other_engine, other_rank, no_remote = results[1], results[3], results[4]
    assert isinstance(other_engine, errors.KvdError) and isinstance(other_rank, errors.KvdError)
    assert "'holder' rank 1" in other_engine.message and "'reader' rank 1" in other_engine.message
    assert "'reader' rank 0" in other_rank.message
    assert isinstance(no_remote, errors.KvdError) and "remote kv_transfer_params are required" in no_remote.message

    # One call to the core, indices kept: the bad items reach it as their own errors.
    (orders,) = daemon.calls
    assert len(orders) == len(pulls)
    assert [isinstance(o, errors.InvalidArgument) for o in orders] == [False, True, False, True, True, False]
    assert all((o.engine_id, o.tp_rank) == ("reader", 1) for o in orders if isinstance(o, PullOrder))
    assert daemon.metrics.errors.counts == {("EngineStream", "INVALID_ARGUMENT"): 3}


def test_a_long_foreign_engine_id_is_clipped_in_the_error() -> None:
    daemon = FakeDaemon()
    long_id = "x" * 100_000
    answer = started(start_pulls_on_stream(daemon, RANK, message(1, [pull("r", engine_id=long_id)])))  # type: ignore[arg-type]
    (result,) = answer.results
    assert result.error_code == "INVALID_ARGUMENT"
    assert len(result.error_message) < 10_000


@pytest.mark.parametrize(
    "refusal",
    [
        errors.Unavailable("the daemon is draining"),
        errors.InvalidArgument("StartPulls takes at most 1024 pulls per call, got 1025: split the batch"),
    ],
)
def test_a_whole_message_refused_fails_every_item_with_the_refusal(refusal: errors.KvdError) -> None:
    daemon = FakeDaemon(refuse=refusal)
    pulls = [pull("r0"), pull("bad", engine_id="holder"), pull("r2")]
    answer = started(start_pulls_on_stream(daemon, RANK, message(42, pulls)))  # type: ignore[arg-type]

    assert answer.seq == 42
    assert len(answer.results) == 3
    name = type(refusal).__name__
    for result in answer.results:
        assert not result.transfer_id
        assert result.error_code == refusal.code.name
        assert result.error_class == name
        assert result.error_message == refusal.message
    assert all(type(r) is type(refusal) for r in pull_results(answer, 3))
    assert daemon.metrics.errors.counts == {("EngineStream", refusal.code.name): 3}


def test_the_daemons_bound_on_pulls_per_message_fails_every_item_and_starts_nothing() -> None:
    """The real bound (kvd.core.pulls.Puller.start_pulls) as the stream sees it."""
    from kvd.core.pulls import MAX_PULLS_PER_CALL, Puller

    class Bound(FakeDaemon):
        def start_pulls(self, orders: Sequence[PullOrder | errors.KvdError]) -> list[Any]:
            self.calls.append(list(orders))
            # Puller.start_pulls checks its bound before anything else; self is not a Puller.
            return Puller.start_pulls(self, orders)  # type: ignore[arg-type]

        def _require_serving(self) -> None:
            pass

        class _dataplane:  # stands in for Puller._dataplane: the step's READs are flushed
            @staticmethod
            def flush_reads() -> None:
                pass

        class _transport:  # stands in for Puller._transport: the step's admissions are flushed
            @staticmethod
            def flush() -> None:
                pass

        def start_order(self, order: PullOrder) -> Any:
            return FakeTransfer(f"xfer-{order.request_id}")

    daemon = Bound()
    over = [pull(f"r{i}") for i in range(MAX_PULLS_PER_CALL + 1)]
    answer = started(start_pulls_on_stream(daemon, RANK, message(5, over)))  # type: ignore[arg-type]
    assert answer.seq == 5 and len(answer.results) == MAX_PULLS_PER_CALL + 1
    assert {(r.error_code, r.error_class) for r in answer.results} == {("INVALID_ARGUMENT", "InvalidArgument")}
    assert all("at most 1024 pulls" in r.error_message for r in answer.results)
    assert not any(r.transfer_id for r in answer.results)

    at_bound = [pull(f"r{i}") for i in range(MAX_PULLS_PER_CALL)]
    answer = started(start_pulls_on_stream(daemon, RANK, message(6, at_bound)))  # type: ignore[arg-type]
    assert [r.transfer_id for r in answer.results] == [f"xfer-r{i}" for i in range(MAX_PULLS_PER_CALL)]


def test_each_errors_exact_class_is_kept() -> None:
    failures: dict[str, errors.KvdError] = {
        "unknown-lease": errors.UnknownLease("no lease 'x' is held here"),
        "expired": errors.LeaseExpired("lease 'x' expired"),
        "peer": errors.PeerUnavailable("holder.test:1 is down"),
        "evicted": errors.HeldKvEvicted("held KV evicted"),
        "stale": errors.StaleRegistration("the holder registered again"),
        "unknown-engine": errors.UnknownEngine("no engine 'reader' rank 1"),
    }
    daemon = FakeDaemon(results=dict(failures))
    pulls = [pull(rid) for rid in failures] + [pull("fine")]
    answer = started(start_pulls_on_stream(daemon, RANK, message(77, pulls)))  # type: ignore[arg-type]

    assert answer.seq == 77
    names = [r.error_class for r in answer.results]
    assert names == [type(e).__name__ for e in failures.values()] + [""]
    results = pull_results(answer, len(pulls))
    for rid, result in zip(failures, results, strict=False):
        assert type(result) is type(failures[rid]), rid
        assert isinstance(result, errors.KvdError) and result.message == failures[rid].message
    assert results[-1] == "xfer-fine"
    expected = collections.Counter(("EngineStream", e.code.name) for e in failures.values())
    assert daemon.metrics.errors.counts == expected


@pytest.mark.parametrize("seq", [0, 1, 2**32 + 1, 2**64 - 1])
def test_the_answer_echoes_the_seq_even_for_no_pulls(seq: int) -> None:
    daemon = FakeDaemon()
    answer = started(start_pulls_on_stream(daemon, RANK, message(seq, [])))  # type: ignore[arg-type]
    assert answer.seq == seq and len(answer.results) == 0
    assert daemon.calls == [[]]
    assert pull_results(answer, 0) == []


def test_ready_says_the_daemon_takes_pulls() -> None:
    assert READY.WhichOneof("kind") == "ready" and READY.ready.takes_pulls


# --- kvd.server.engine_servicer._messages --------------------------------------------------------


def answer_of(seq: int) -> engine_pb2.DaemonMessage:
    return engine_pb2.DaemonMessage(pulls_started=engine_pb2.PullsStarted(seq=seq))


EVENTS: list[EngineEvent] = [
    FinishedRecving(request_id="r0", transfer_id="t0"),
    LoadFailed(
        request_id="r1",
        transfer_id="t1",
        error_code="UNAVAILABLE",
        error_message="peer gone",
        block_ids=(4, 5),
        error_class="PeerUnavailable",
    ),
    FinishedSending(request_id="r2", lease_id="l2", expired=True),
]


def kinds(messages: Sequence[engine_pb2.DaemonMessage]) -> list[str]:
    return [str(m.WhichOneof("kind")) for m in messages]


def test_answers_come_before_events_one_message_each_without_batches() -> None:
    answers = [READY, answer_of(1), answer_of(2)]
    out = _messages(answers, list(EVENTS), batches=False)
    assert answers == []
    assert kinds(out) == [
        "ready",
        "pulls_started",
        "pulls_started",
        "finished_recving",
        "load_failed",
        "finished_sending",
    ]
    assert [m.pulls_started.seq for m in out[1:3]] == [1, 2]
    assert out[3].finished_recving.transfer_id == "t0"
    assert out[4].load_failed.error_class == "PeerUnavailable" and list(out[4].load_failed.block_ids) == [4, 5]
    assert out[5].finished_sending.expired


def test_answers_and_events_go_in_one_batch_answers_first() -> None:
    answers = [answer_of(7)]
    out = _messages(answers, list(EVENTS), batches=True)
    assert answers == []
    (batch,) = out
    assert batch.WhichOneof("kind") == "batch"
    assert kinds(batch.batch.messages) == ["pulls_started", "finished_recving", "load_failed", "finished_sending"]
    assert batch.batch.messages[0].pulls_started.seq == 7


def test_a_lone_answer_or_event_is_sent_as_itself_not_as_a_batch() -> None:
    answers = [READY]
    assert kinds(_messages(answers, [], batches=True)) == ["ready"]
    assert answers == []
    assert kinds(_messages(answers, [EVENTS[0]], batches=True)) == ["finished_recving"]
    assert _messages(answers, [], batches=True) == []
    assert _messages(answers, [], batches=False) == []


def test_events_alone_keep_their_order() -> None:
    answers: list[engine_pb2.DaemonMessage] = []
    assert kinds(_messages(answers, list(EVENTS), batches=False)) == [
        "finished_recving",
        "load_failed",
        "finished_sending",
    ]
    (batch,) = _messages(answers, list(EVENTS), batches=True)
    assert kinds(batch.batch.messages) == ["finished_recving", "load_failed", "finished_sending"]


def test_a_backlog_is_cut_into_batches_with_the_answers_in_the_first() -> None:
    answers = [answer_of(1), answer_of(2)]
    count = 2 * MAX_BATCH_EVENTS - 1  # with the two answers: two full batches and one lone event
    events: list[EngineEvent] = [FinishedRecving(request_id=f"r{i}", transfer_id=f"t{i}") for i in range(count)]
    out = _messages(answers, events, batches=True)
    assert answers == []
    assert kinds(out) == ["batch", "batch", "finished_recving"]
    flat = [m for message in out for m in (message.batch.messages if message.HasField("batch") else [message])]
    assert all(len(m.batch.messages) <= MAX_BATCH_EVENTS for m in out if m.HasField("batch"))
    assert kinds(flat[:2]) == ["pulls_started", "pulls_started"]
    assert [m.finished_recving.transfer_id for m in flat[2:]] == [f"t{i}" for i in range(count)]


def test_the_answers_list_is_the_callers_own_and_emptied_in_place() -> None:
    answers = [answer_of(3)]
    same = answers
    engine_servicer._messages(answers, [], batches=False)
    assert same is answers and answers == []


# --- kvd.server.engine_servicer.EngineStream, driven in-process ----------------------------------


class StreamRank:
    """The EngineRank fields an engine stream uses; its post and drain are EngineRank's own."""

    post = EngineRank.post
    drain = EngineRank.drain

    def __init__(self, engine_id: str = "reader", tp_rank: int = 0) -> None:
        self.engine_id, self.tp_rank = engine_id, tp_rank
        self.stream_generation = 0
        self.stream_connected = False
        self.pending: collections.deque[EngineEvent] = collections.deque(maxlen=1024)
        self.wakeup: asyncio.Event | None = None


class StreamDaemon(FakeDaemon):
    """A FakeDaemon with one rank whose streams attach and detach as kvd.core.engines does; each
    pull it starts ends at once (its FinishedRecving posted before start_pulls returns)."""

    def __init__(self) -> None:
        super().__init__()
        self.rank = StreamRank()
        self.registry = types.SimpleNamespace(get=lambda engine_id, tp_rank: self.rank)

    def attach_stream(self, engine_id: str, tp_rank: int) -> tuple[Any, int]:
        return Engines.attach_stream(self, engine_id, tp_rank)  # type: ignore[arg-type]

    def detach_stream(self, rank: Any, generation: int) -> None:
        Engines.detach_stream(self, rank, generation)  # type: ignore[arg-type]

    def start_pulls(self, orders: Sequence[PullOrder | errors.KvdError]) -> list[Any]:
        results = super().start_pulls(orders)
        for result, order in zip(results, orders, strict=True):
            if isinstance(result, FakeTransfer) and isinstance(order, PullOrder):
                self.rank.post(FinishedRecving(request_id=order.request_id, transfer_id=result.transfer_id))
        return results


class StreamContext:
    def set_trailing_metadata(self, metadata: Any) -> None:
        self.trailing = metadata

    async def abort(self, code: Any, details: str) -> None:
        raise AssertionError(f"the stream was aborted: {code} {details}")


class EngineSide:
    """One engine's stream to the servicer: what it sends (a queue, None half-closes) and the
    servicer's generator of what the daemon sends."""

    def __init__(self, servicer: engine_servicer.EngineServicer, *, starts_pulls: bool, batches: bool) -> None:
        self.sent: asyncio.Queue[engine_pb2.EngineMessage | None] = asyncio.Queue()
        hello = engine_pb2.EngineHello(
            engine_id="reader", tp_rank=0, accepts_batches=batches, starts_pulls=starts_pulls
        )
        self.sent.put_nowait(engine_pb2.EngineMessage(hello=hello))
        self.out = servicer.EngineStream(self._requests(), StreamContext())  # type: ignore[arg-type]

    async def _requests(self) -> Any:
        while (message := await self.sent.get()) is not None:
            yield message

    def start_pulls(self, seq: int, pulls: Sequence[router_pb2.StartPullRequest]) -> None:
        self.sent.put_nowait(engine_pb2.EngineMessage(start_pulls=message(seq, pulls)))

    async def next(self, timeout_s: float = 2.0) -> engine_pb2.DaemonMessage:
        return await asyncio.wait_for(anext(self.out), timeout_s)  # type: ignore[arg-type]

    async def end(self) -> list[engine_pb2.DaemonMessage]:
        """Half-close; what the daemon still sent before it ended its side."""
        self.sent.put_nowait(None)
        rest: list[engine_pb2.DaemonMessage] = []
        async with asyncio.timeout(2.0):
            async for item in self.out:  # type: ignore[attr-defined]
                rest.append(item)
        return rest


def flat(messages: Sequence[engine_pb2.DaemonMessage]) -> list[engine_pb2.DaemonMessage]:
    return [m for message in messages for m in (message.batch.messages if message.HasField("batch") else [message])]


def run_stream(scenario: Callable[[StreamDaemon, engine_servicer.EngineServicer], Awaitable[None]]) -> None:
    async def main() -> None:
        daemon = StreamDaemon()
        await scenario(daemon, engine_servicer.EngineServicer(daemon))  # type: ignore[arg-type]

    asyncio.run(main())


def test_an_engine_that_does_not_start_pulls_gets_no_ready() -> None:
    async def scenario(daemon: StreamDaemon, servicer: engine_servicer.EngineServicer) -> None:
        engine = EngineSide(servicer, starts_pulls=False, batches=True)
        daemon.rank.post(FinishedRecving(request_id="r0", transfer_id="t0"))
        first = await engine.next()
        assert first.WhichOneof("kind") == "finished_recving"
        assert await engine.end() == []

    run_stream(scenario)


@pytest.mark.parametrize("batches", [True, False])
def test_a_pulls_answer_leaves_before_the_events_of_its_pulls(batches: bool) -> None:
    async def scenario(daemon: StreamDaemon, servicer: engine_servicer.EngineServicer) -> None:
        engine = EngineSide(servicer, starts_pulls=True, batches=batches)
        first = await engine.next()
        assert first.WhichOneof("kind") == "ready" and first.ready.takes_pulls
        engine.start_pulls(5, [pull("r0"), pull("bad", engine_id="holder"), pull("r2")])
        got = [await engine.next()]
        if not batches:
            got += [await engine.next(), await engine.next()]
        got += await engine.end()
        assert kinds(flat(got)) == ["pulls_started", "finished_recving", "finished_recving"], got
        answer = flat(got)[0].pulls_started
        assert answer.seq == 5
        assert [r.transfer_id for r in answer.results] == ["xfer-r0", "", "xfer-r2"]
        assert answer.results[1].error_class == "InvalidArgument"
        assert [m.finished_recving.transfer_id for m in flat(got)[1:]] == ["xfer-r0", "xfer-r2"]

    run_stream(scenario)


def test_a_superseded_streams_answers_never_reach_its_successor() -> None:
    async def scenario(daemon: StreamDaemon, servicer: engine_servicer.EngineServicer) -> None:
        one = EngineSide(servicer, starts_pulls=True, batches=True)
        assert (await one.next()).WhichOneof("kind") == "ready"
        one.start_pulls(1, [pull("one-0"), pull("one-1"), pull("one-2")])
        for _ in range(3):  # the first stream's reader starts them and queues its answer
            await asyncio.sleep(0)
        two = EngineSide(servicer, starts_pulls=True, batches=False)
        heard: list[engine_pb2.DaemonMessage] = []
        heard.append(await two.next())
        two.start_pulls(1, [pull("two-0")])
        while not any(m.WhichOneof("kind") == "pulls_started" for m in heard):
            heard.append(await two.next())
        heard += await two.end()
        answers = [m.pulls_started for m in flat(heard) if m.WhichOneof("kind") == "pulls_started"]
        assert len(answers) == 1, heard
        assert answers[0].seq == 1 and [r.transfer_id for r in answers[0].results] == ["xfer-two-0"]
        one.sent.put_nowait(None)
        with contextlib.suppress(StopAsyncIteration, TimeoutError):
            while True:
                await one.next()

    run_stream(scenario)


def test_a_stream_superseded_while_it_writes_ends() -> None:
    async def scenario(daemon: StreamDaemon, servicer: engine_servicer.EngineServicer) -> None:
        one = EngineSide(servicer, starts_pulls=True, batches=True)
        assert (await one.next()).WhichOneof("kind") == "ready"
        daemon.rank.post(FinishedRecving(request_id="r0", transfer_id="t0"))
        assert (await one.next()).WhichOneof("kind") == "finished_recving"  # its writer waits in that yield
        daemon.attach_stream("reader", 0)  # a second stream of the rank, as its EngineStream attaches
        try:
            with pytest.raises(StopAsyncIteration):
                await one.next()
        finally:
            one.sent.put_nowait(None)
            with contextlib.suppress(StopAsyncIteration, TimeoutError):
                while True:
                    await one.next()

    run_stream(scenario)


def test_the_ready_is_the_first_message_alone_even_with_events_queued() -> None:
    async def scenario(daemon: StreamDaemon, servicer: engine_servicer.EngineServicer) -> None:
        daemon.rank.post(FinishedRecving(request_id="r0", transfer_id="t0"))  # kept for the next stream
        engine = EngineSide(servicer, starts_pulls=True, batches=True)
        first = await engine.next()
        got = [first, *await engine.end()]
        assert first.WhichOneof("kind") == "ready", first
        assert kinds(flat(got)) == ["ready", "finished_recving"]

    run_stream(scenario)
