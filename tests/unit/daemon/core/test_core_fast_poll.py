"""What a holder's worker is told about fast polling (kvd.core.fast_poll.FastPollTeller).

Each message wakes the worker, so: one message where a deadline is raised, none for a deadline
within the one told, the slow-down only once "none open" has held for SLOW_DOWN_AFTER_S (pulls
one after another send nothing between them), and nothing after close.
"""

from __future__ import annotations

import asyncio

import pytest

from kvd.core import fast_poll
from kvd.core.fast_poll import FAST_POLL_SLACK_S, FastPollTeller

LINGER_S = 0.05


@pytest.fixture(autouse=True)
def _short_linger(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fast_poll, "SLOW_DOWN_AFTER_S", LINGER_S)


def _teller() -> tuple[FastPollTeller, list[float]]:
    told: list[float] = []
    return FastPollTeller(told.append), told


def test_a_raised_deadline_is_told_once_with_slack_and_one_within_it_not_at_all() -> None:
    async def main() -> None:
        teller, told = _teller()
        teller.want(100.0)
        teller.want(100.5)  # within the slack already told
        teller.want(50.0)
        assert told == [100.0 + FAST_POLL_SLACK_S] and teller.told == told[-1]
        teller.want(200.0)
        assert told[-1] == 200.0 + FAST_POLL_SLACK_S

    asyncio.run(main())


def test_none_open_is_told_only_once_it_has_held_and_an_admission_meanwhile_cancels_it() -> None:
    async def main() -> None:
        teller, told = _teller()
        teller.want(100.0)
        for _ in range(5):  # pulls one after another: each ends (0.0) and the next is admitted
            teller.want(0.0)
            await asyncio.sleep(LINGER_S / 5)
            teller.want(100.0)
        assert told == [100.0 + FAST_POLL_SLACK_S]  # nothing between them
        teller.want(0.0)
        teller.want(0.0)  # asked again while waiting: still one slow-down
        await asyncio.sleep(LINGER_S * 3)
        assert told == [100.0 + FAST_POLL_SLACK_S, 0.0] and teller.told == 0.0
        teller.want(0.0)  # slow already
        await asyncio.sleep(LINGER_S * 2)
        assert told[-1] == 0.0 and len(told) == 2
        teller.want(100.0)  # the next admission after the slow-down is told again
        assert told[-1] == 100.0 + FAST_POLL_SLACK_S

    asyncio.run(main())


def test_a_past_deadline_is_told_from_slow_and_nothing_is_told_after_close() -> None:
    async def main() -> None:
        teller, told = _teller()
        teller.want(1e-3)  # a read never proven over: poll now and then, not at the slowest
        assert told == [1e-3 + FAST_POLL_SLACK_S]
        teller.want(0.0)
        teller.close()  # the worker is gone before the slow-down is due
        await asyncio.sleep(LINGER_S * 3)
        assert told == [1e-3 + FAST_POLL_SLACK_S]

    asyncio.run(main())
