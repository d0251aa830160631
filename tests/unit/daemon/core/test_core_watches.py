"""kvd.core.watches: one stream waiting on many transfers, each id answered exactly once, bounded."""

from __future__ import annotations

import asyncio

import pytest

from kvd.core import watches
from kvd.core.transfers import Transfer, TransferState, TransferTable
from kvd.core.watches import Refusal, TransferWatches
from kvd_client.errors import InvalidArgument, PeerUnavailable, ResourceExhausted, Unavailable, UnknownTransfer


def _new(table: TransferTable, request_id: str = "req") -> Transfer:
    return table.new(
        request_id=request_id,
        engine_id="eng",
        tp_rank=0,
        peer_address="10.0.0.2:50151",
        local_block_ids=(1,),
        deadline_s=30.0,
    )


def _ids(answers: list[watches.Answer]) -> list[str]:
    return [a.transfer_id for a in answers]


def test_a_running_transfer_is_answered_once_when_it_ends() -> None:
    """A watched transfer is answered with its final state when it ends, then no longer watched."""
    table = TransferTable()
    hub = TransferWatches(table)
    watch = hub.open()
    t = _new(table)
    watch.add([t.transfer_id])
    assert watch.drain() == [] and watch.watched == {t.transfer_id} and hub.watched == 1
    t.advance(TransferState.READING)
    assert watch.drain() == []  # not final: nothing to say yet
    t.advance(TransferState.FAILED, PeerUnavailable("peer 10.0.0.2 died"))
    (answer,) = watch.drain()
    assert answer is t and t.state is TransferState.FAILED and isinstance(t.error, PeerUnavailable)
    assert watch.watched == set() and hub.watched == 0 and watch.wakeup.is_set()


def test_a_transfer_that_ended_before_it_was_watched_is_answered_at_once() -> None:
    """Asking after the pull ended still gives its final outcome (nothing is left watched)."""
    table = TransferTable()
    watch = TransferWatches(table).open()
    t = _new(table)
    t.advance(TransferState.READING)
    t.advance(TransferState.DONE)
    watch.add([t.transfer_id])
    assert watch.drain() == [t] and watch.watched == set()
    watch.add([t.transfer_id])  # asked again: answered again
    assert watch.drain() == [t]


def test_unknown_and_empty_ids_are_refused_alone() -> None:
    """An unknown id gets UnknownTransfer and an empty one InvalidArgument, each for itself; the
    other ids of the same message are watched."""
    table = TransferTable()
    watch = TransferWatches(table).open()
    t = _new(table)
    watch.add(["nosuch", "", t.transfer_id, "x" * 4000])
    answers = watch.drain()
    assert _ids(answers) == ["nosuch", "", "x" * 4000]
    assert all(isinstance(a, Refusal) for a in answers)
    refusals = [a for a in answers if isinstance(a, Refusal)]
    assert isinstance(refusals[0].error, UnknownTransfer) and "'nosuch'" in refusals[0].error.message
    assert isinstance(refusals[1].error, InvalidArgument) and "empty" in refusals[1].error.message
    assert isinstance(refusals[2].error, UnknownTransfer) and len(refusals[2].error.message) < 400  # quoted, clipped
    assert watch.watched == {t.transfer_id}


def test_an_id_already_watched_is_not_watched_twice() -> None:
    """Adding a watched id again changes nothing: it is answered once, when it ends."""
    table = TransferTable()
    hub = TransferWatches(table)
    watch = hub.open()
    t = _new(table)
    watch.add([t.transfer_id, t.transfer_id])
    watch.add([t.transfer_id])
    assert hub.watched == 1
    t.advance(TransferState.ABORTED)
    assert watch.drain() == [t]


def test_two_streams_watching_one_transfer_are_both_answered() -> None:
    """Every stream watching a transfer hears of its end."""
    table = TransferTable()
    hub = TransferWatches(table)
    first, second = hub.open(), hub.open()
    t = _new(table)
    first.add([t.transfer_id])
    second.add([t.transfer_id])
    t.advance(TransferState.ABORTED)
    assert first.drain() == [t] and second.drain() == [t]


def test_unwatched_and_released_ids_are_not_answered() -> None:
    """An id unwatched, or watched by a stream that ended, gets no answer when it ends."""
    table = TransferTable()
    hub = TransferWatches(table)
    watch, gone = hub.open(), hub.open()
    a, b = _new(table, "a"), _new(table, "b")
    watch.add([a.transfer_id, b.transfer_id])
    gone.add([a.transfer_id])
    watch.remove([a.transfer_id, "never-watched"])
    hub.release(gone)
    assert hub.watched == 1 and hub.streams == 1
    a.advance(TransferState.ABORTED)
    b.advance(TransferState.ABORTED)
    assert watch.drain() == [b] and gone.drain() == []


def test_too_many_ids_in_one_message_is_invalid_and_changes_nothing() -> None:
    """A message over MAX_IDS_PER_MESSAGE is refused whole (the stream ends INVALID_ARGUMENT)."""
    table = TransferTable()
    watch = TransferWatches(table).open()
    with pytest.raises(InvalidArgument, match="at most 4096"):
        watch.add(["x"] * (watches.MAX_IDS_PER_MESSAGE + 1))
    with pytest.raises(InvalidArgument, match="at most 4096"):
        watch.remove(["x"] * (watches.MAX_IDS_PER_MESSAGE + 1))
    assert watch.drain() == [] and watch.watched == set()


def test_a_stream_watches_at_most_max_watched(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past MAX_WATCHED, a running transfer's id is refused ResourceExhausted (alone); one that
    ended is still answered; room frees as watched transfers end."""
    monkeypatch.setattr(watches, "MAX_WATCHED", 2)
    table = TransferTable()
    watch = TransferWatches(table).open()
    running = [_new(table, f"r{i}") for i in range(3)]
    ended = _new(table, "e")
    ended.advance(TransferState.ABORTED)
    watch.add([t.transfer_id for t in running] + [ended.transfer_id])
    (refused, answered) = watch.drain()
    assert isinstance(refused, Refusal) and refused.transfer_id == running[2].transfer_id
    assert isinstance(refused.error, ResourceExhausted)
    assert answered is ended
    running[0].advance(TransferState.ABORTED)
    assert watch.drain() == [running[0]]
    watch.add([running[2].transfer_id])
    assert watch.watched == {running[1].transfer_id, running[2].transfer_id}


def test_answers_go_out_in_bounded_messages_and_hold_the_reader_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """drain gives at most MAX_ANSWERS_PER_MESSAGE answers; while MAX_UNSENT_ANSWERS wait, room()
    waits (the caller's next message is not read) until a drain makes room."""
    monkeypatch.setattr(watches, "MAX_ANSWERS_PER_MESSAGE", 3)
    monkeypatch.setattr(watches, "MAX_UNSENT_ANSWERS", 4)

    async def main() -> None:
        watch = TransferWatches(TransferTable()).open()
        watch.add([f"nosuch-{i}" for i in range(5)])
        room = asyncio.create_task(watch.room())
        await asyncio.sleep(0.01)
        assert not room.done()
        assert len(watch.drain()) == 3
        await asyncio.wait_for(room, 1.0)
        assert len(watch.drain()) == 2 and watch.drain() == []

    asyncio.run(main())


def test_close_ends_every_watch_and_refuses_new_ones() -> None:
    """At shutdown every watch is closed with the error (its queued answers kept), and opening one
    raises it."""
    table = TransferTable()
    hub = TransferWatches(table)
    watch = hub.open()
    t = _new(table)
    watch.add([t.transfer_id])
    t.advance(TransferState.ABORTED)
    error = Unavailable("the daemon is shutting down")
    hub.close(error)
    assert watch.ended is error and watch.wakeup.is_set()
    assert watch.drain() == [t]
    with pytest.raises(Unavailable):
        hub.open()


def test_a_failing_watch_does_not_fail_the_transfer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The end callback runs inside the pull's state change: an error there is logged, never raised."""
    table = TransferTable()
    hub = TransferWatches(table)
    watch, other = hub.open(), hub.open()
    t = _new(table)
    watch.add([t.transfer_id])
    other.add([t.transfer_id])

    def broken(transfer: Transfer) -> None:
        raise RuntimeError("bug")

    monkeypatch.setattr(watch, "transfer_ended", broken)
    t.advance(TransferState.ABORTED)
    assert t.state is TransferState.ABORTED and other.drain() == [t]
