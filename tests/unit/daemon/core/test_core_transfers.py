"""kvd.core.transfers: the pull state machine planned -> reading -> postprocessing -> done | failed | aborted."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.core import transfers
from kvd.core.transfers import Transfer, TransferState, TransferTable
from kvd_client.errors import PeerUnavailable, UnknownTransfer

P, R, PP, D, F, A = (
    TransferState.PLANNED,
    TransferState.READING,
    TransferState.POSTPROCESSING,
    TransferState.DONE,
    TransferState.FAILED,
    TransferState.ABORTED,
)

# The documented machine, written out independently of the module's table.
FE = TransferState.FENCING
LEGAL = {
    P: {R, FE, F, A},
    R: {PP, D, FE, F, A},
    PP: {D, FE, F, A},
    FE: {F, A},
}
FINAL = {D, F, A}


def _transfer(transfer_id: str = "t1") -> Transfer:
    return Transfer(
        transfer_id=transfer_id,
        request_id="req",
        engine_id="eng",
        tp_rank=0,
        peer_address="10.0.0.2:50151",
        local_block_ids=(1, 2, 3),
        deadline_s=30.0,
    )


def test_final_states() -> None:
    """DONE, FAILED and ABORTED are final; the others are not."""
    assert {s for s in TransferState if s.final} == FINAL


def test_a_new_transfer_is_planned() -> None:
    """A transfer starts PLANNED with no error."""
    t = _transfer()
    assert t.state is P and t.error is None and t.finished == 0.0


@pytest.mark.parametrize(("path"), [[R, D], [R, PP, D], [F], [A], [R, F], [R, A], [R, PP, F], [R, PP, A]])
def test_legal_paths(path: list[TransferState]) -> None:
    """Every legal path from PLANNED is followed state by state, and ends final with a finish time."""
    t = _transfer()
    for state in path:
        t.advance(state)
        assert t.state is state
    assert t.state.final and t.finished > 0


@pytest.mark.parametrize(
    ("before", "target"),
    [(P, P), (P, PP), (P, D), (R, R), (R, P), (PP, PP), (PP, R), (PP, P)],
)
def test_illegal_transitions_are_refused(before: TransferState, target: TransferState) -> None:
    """A transition the machine does not allow raises and leaves the state unchanged."""
    t = _transfer()
    for state in {P: [], R: [R], PP: [R, PP]}[before]:
        t.advance(state)
    with pytest.raises(RuntimeError, match=f"{before.value} -> {target.value} is not allowed"):
        t.advance(target)
    assert t.state is before


@pytest.mark.parametrize("final", sorted(FINAL, key=lambda s: s.value))
def test_final_states_never_move(final: TransferState) -> None:
    """A transfer that ended stays in its final state; its error and finish time are kept."""
    t = _transfer()
    if final is D:
        t.advance(R)
    first_error = PeerUnavailable("peer 10.0.0.2 died") if final is not D else None
    t.advance(final, first_error)
    finished = t.finished
    for state in TransferState:
        t.advance(state, PeerUnavailable("later"))
        assert t.state is final
    assert t.error is first_error
    assert t.finished == finished


@settings(deadline=None)
@given(st.lists(st.sampled_from(list(TransferState)), max_size=12))
def test_state_machine_property(targets: list[TransferState]) -> None:
    """For any sequence of requests, the state moves exactly along legal edges and stops at a final state."""
    t = _transfer()
    for target in targets:
        before = t.state
        if before in FINAL:
            t.advance(target)
            assert t.state is before
        elif target in LEGAL[before]:
            t.advance(target)
            assert t.state is target
        else:
            with pytest.raises(RuntimeError):
                t.advance(target)
            assert t.state is before


def test_advance_records_the_error() -> None:
    """The error given with FAILED is kept on the transfer."""
    t = _transfer()
    err = PeerUnavailable("peer 10.0.0.2:50151 disconnected")
    t.advance(R)
    t.advance(F, err)
    assert t.error is err


def test_changes_yields_each_change_and_ends_at_a_final_state() -> None:
    """A watcher sees PLANNED, then each new state, and its iteration ends after DONE."""

    async def main() -> list[TransferState]:
        t = _transfer()
        seen: list[TransferState] = []

        async def watch() -> None:
            async for snapshot in t.changes():
                assert snapshot is t
                seen.append(t.state)

        watcher = asyncio.create_task(watch())
        await asyncio.sleep(0)
        for state in (R, PP, D):
            t.advance(state)
            await asyncio.sleep(0.01)
        await asyncio.wait_for(watcher, 1.0)  # ended by itself
        return seen

    assert asyncio.run(main()) == [P, R, PP, D]


def test_changes_of_a_finished_transfer_yields_once() -> None:
    """Watching a transfer that already ended yields its final state once and stops."""

    async def main() -> list[TransferState]:
        t = _transfer()
        t.advance(A)
        return [s.state async for s in t.changes()]

    assert asyncio.run(main()) == [A]


def test_changes_loses_no_final_state() -> None:
    """Several changes with no chance for the watcher to run: it still ends, at the final state."""

    async def main() -> list[TransferState]:
        t = _transfer()
        seen: list[TransferState] = []

        async def watch() -> None:
            async for s in t.changes():
                seen.append(s.state)

        watcher = asyncio.create_task(watch())
        await asyncio.sleep(0)
        t.advance(R)
        t.advance(PP)
        t.advance(F, PeerUnavailable("gone"))
        await asyncio.wait_for(watcher, 1.0)
        return seen

    seen = asyncio.run(main())
    assert seen[0] is P and seen[-1] is F


def test_changes_waits_while_nothing_changes() -> None:
    """A watcher of a transfer that does not move does not spin: it blocks until a change."""

    async def main() -> None:
        t = _transfer()
        it = t.changes().__aiter__()
        assert (await it.__anext__()).state is P
        pending = asyncio.ensure_future(it.__anext__())
        await asyncio.sleep(0.02)
        assert not pending.done()
        t.advance(R)
        assert (await asyncio.wait_for(pending, 1.0)).state is R
        await it.aclose()  # type: ignore[attr-defined]

    asyncio.run(main())


# --- TransferTable ------------------------------------------------------------------------------


def _fields() -> dict[str, object]:
    return dict(request_id="r", engine_id="e", tp_rank=0, peer_address="p:1", local_block_ids=(0,), deadline_s=1.0)


def test_table_new_get_and_in_flight() -> None:
    """new() gives distinct unguessable ids; get finds them; in_flight lists only unfinished ones."""
    table = TransferTable()
    a, b = table.new(**_fields()), table.new(**_fields())
    assert a.transfer_id != b.transfer_id and len(a.transfer_id) >= 32
    assert table.get(a.transfer_id) is a
    a.advance(A)
    assert table.in_flight() == [b]


@pytest.mark.parametrize(("path"), [[R, D], [R, PP, D], [F], [A], [R, FE, F], [R, PP, FE, A]])
def test_table_in_flight_follows_each_transfer_to_its_end(
    monkeypatch: pytest.MonkeyPatch, path: list[TransferState]
) -> None:
    """in_flight / any_in_flight (kept apart, not found by a pass over the finished ones) list a
    transfer, oldest first, until its path ends, whatever the path and however many finished
    ones are kept or forgotten meanwhile."""
    monkeypatch.setattr(transfers, "KEEP_FINISHED", 2)
    table = TransferTable()
    assert not table.any_in_flight() and table.in_flight() == []
    old, new = table.new(**_fields()), table.new(**_fields())
    for _ in range(5):  # finished ones come and go (trimmed past KEEP_FINISHED)
        table.new(**_fields()).advance(A)
    for state in path:
        assert table.any_in_flight() and table.in_flight() == [old, new]
        old.advance(state)
    assert table.in_flight() == [new]
    old.advance(R)  # an ended transfer never moves again, nor comes back
    assert table.in_flight() == [new]
    new.advance(F)
    assert not table.any_in_flight() and table.in_flight() == []


def test_transfer_ids_are_version_4_uuids_never_repeated() -> None:
    """Ids drawn from the batched random source are what uuid4().hex made: 32 hex digits, version
    4, RFC 4122 variant, distinct across several batches of random bytes."""
    table = TransferTable()
    ids = [table.new(**_fields()).transfer_id for _ in range(3 * transfers._TransferIds.BATCH + 7)]
    assert len(set(ids)) == len(ids)
    for transfer_id in ids:
        parsed = uuid.UUID(hex=transfer_id)
        assert parsed.hex == transfer_id and parsed.version == 4 and parsed.variant == uuid.RFC_4122


def test_table_get_unknown() -> None:
    """An unknown transfer id is NOT_FOUND (UnknownTransfer), naming it."""
    with pytest.raises(UnknownTransfer, match="nope"):
        TransferTable().get("nope")


def test_table_forgets_only_finished_transfers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past KEEP_FINISHED entries the oldest finished transfers are dropped; live ones never are."""
    monkeypatch.setattr(transfers, "KEEP_FINISHED", 3)
    table = TransferTable()
    live = table.new(**_fields())
    done = []
    for _ in range(4):
        t = table.new(**_fields())
        t.advance(A)
        done.append(t)
    table.new(**_fields())
    assert table.get(live.transfer_id) is live
    with pytest.raises(UnknownTransfer):
        table.get(done[0].transfer_id)
    assert table.get(done[-1].transfer_id) is done[-1]
