"""kvd.core.commits: committed-token watermarks per (engine, rank, request) and bounded waits."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.core.commits import CommitTracker
from kvd_client.errors import Aborted


def test_unknown_request_has_watermark_zero() -> None:
    """Nothing committed yet reads as 0 tokens."""
    assert CommitTracker().watermark("e", 0, "r") == 0


@settings(deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10_000), max_size=30))
def test_watermark_never_decreases(commits: list[int]) -> None:
    """After any sequence of commits the watermark is the running maximum: it never goes down."""
    tracker = CommitTracker()
    previous = 0
    for tokens in commits:
        tracker.commit("e", 0, "r", tokens)
        mark = tracker.watermark("e", 0, "r")
        assert mark == max(previous, tokens)
        assert mark >= previous
        previous = mark


def test_watermarks_are_per_engine_rank_and_request() -> None:
    """A commit on one (engine, rank, request) does not move another's watermark."""
    tracker = CommitTracker()
    tracker.commit("e", 0, "r", 10)
    assert tracker.watermark("e", 1, "r") == 0
    assert tracker.watermark("f", 0, "r") == 0
    assert tracker.watermark("e", 0, "s") == 0
    assert len(tracker) == 1


def test_wait_for_already_committed_returns_true_at_once() -> None:
    """A wait for tokens already committed returns True without waiting."""

    async def main() -> bool:
        tracker = CommitTracker()
        tracker.commit("e", 0, "r", 32)
        return await asyncio.wait_for(tracker.wait_for("e", 0, "r", 32, timeout_s=60.0), 1.0)

    assert asyncio.run(main()) is True


def test_wait_for_returns_true_when_committed_later() -> None:
    """A waiter wakes with True once a later commit reaches its token count, not before."""

    async def main() -> None:
        tracker = CommitTracker()
        waiter = asyncio.create_task(tracker.wait_for("e", 0, "r", 20, timeout_s=5.0))
        await asyncio.sleep(0.01)
        tracker.commit("e", 0, "r", 10)  # not enough
        await asyncio.sleep(0.01)
        assert not waiter.done()
        tracker.commit("e", 0, "r", 25)
        assert await asyncio.wait_for(waiter, 1.0) is True

    asyncio.run(main())


def test_wait_for_returns_false_on_timeout_and_leaves_no_waiter() -> None:
    """A wait that is not satisfied in time returns False, and a later commit still works."""

    async def main() -> None:
        tracker = CommitTracker()
        tracker.commit("e", 0, "r", 5)
        loop = asyncio.get_running_loop()
        start = loop.time()
        assert await tracker.wait_for("e", 0, "r", 6, timeout_s=0.05) is False
        assert loop.time() - start >= 0.04
        assert tracker._waiters == {}
        tracker.commit("e", 0, "r", 6)
        assert tracker.watermark("e", 0, "r") == 6

    asyncio.run(main())


def test_one_commit_wakes_only_the_waiters_it_satisfies() -> None:
    """Waiters for 10 and 30 tokens: committing 20 wakes the first only."""

    async def main() -> None:
        tracker = CommitTracker()
        low = asyncio.create_task(tracker.wait_for("e", 0, "r", 10, timeout_s=5.0))
        high = asyncio.create_task(tracker.wait_for("e", 0, "r", 30, timeout_s=5.0))
        other = asyncio.create_task(tracker.wait_for("e", 1, "r", 10, timeout_s=5.0))
        await asyncio.sleep(0.01)
        tracker.commit("e", 0, "r", 20)
        assert await asyncio.wait_for(low, 1.0) is True
        await asyncio.sleep(0.01)
        assert not high.done() and not other.done()
        tracker.commit("e", 0, "r", 30)
        tracker.commit("e", 1, "r", 10)
        assert await asyncio.wait_for(asyncio.gather(high, other), 1.0) == [True, True]

    asyncio.run(main())


def test_forget_engine_aborts_its_waiters_only() -> None:
    """forget_engine(e, rank) fails that rank's waiters with Aborted and drops its marks; others go on."""

    async def main() -> None:
        tracker = CommitTracker()
        tracker.commit("e", 0, "done", 4)
        tracker.commit("e", 1, "kept", 4)
        gone = asyncio.create_task(tracker.wait_for("e", 0, "r", 10, timeout_s=5.0))
        kept = asyncio.create_task(tracker.wait_for("e", 1, "r", 10, timeout_s=5.0))
        await asyncio.sleep(0.01)
        tracker.forget_engine("e", 0)
        with pytest.raises(Aborted, match="went away"):
            await asyncio.wait_for(gone, 1.0)
        assert tracker.watermark("e", 0, "done") == 0
        assert tracker.watermark("e", 1, "kept") == 4
        assert not kept.done()
        tracker.commit("e", 1, "r", 10)
        assert await asyncio.wait_for(kept, 1.0) is True

    asyncio.run(main())


def test_forget_request_drops_marks_of_every_rank() -> None:
    """forget_request removes that request's watermark on every rank of the engine, and nothing else."""
    tracker = CommitTracker()
    tracker.commit("e", 0, "r", 5)
    tracker.commit("e", 1, "r", 5)
    tracker.commit("e", 0, "s", 5)
    tracker.forget_request("e", "r")
    assert tracker.watermark("e", 0, "r") == 0 and tracker.watermark("e", 1, "r") == 0
    assert tracker.watermark("e", 0, "s") == 5


def test_watermarks_are_bounded_oldest_first() -> None:
    """A long-running daemon forgets the oldest watermarks beyond its bound; recent ones stay."""
    tracker = CommitTracker(max_watermarks=3)
    for i in range(5):
        tracker.commit("e", 0, f"r{i}", 10 + i)
    tracker.commit("e", 0, "r2", 20)  # refreshed: now the newest
    tracker.commit("e", 0, "r5", 1)
    assert len(tracker) == 3
    assert tracker.watermark("e", 0, "r0") == 0 and tracker.watermark("e", 0, "r3") == 0
    assert [tracker.watermark("e", 0, r) for r in ("r4", "r2", "r5")] == [14, 20, 1]
