"""When a holder's data-plane worker is told to poll fast, and when to slow down again.

The worker's NIXL thread polls every 0.2 ms while a reader is admitted (its READs, and over TCP
their bytes, need the holder's progress) and once a second with none (an idle daemon's cost:
docs/performance.md). Each change is a message to the worker and a wake of it, so it is told
only what it must be:

* a deadline within the one already told needs no message, and a raised one is told with
  :data:`FAST_POLL_SLACK_S` to spare, so the next admissions need none either;
* "none open" (0.0) is told only once it has held for :data:`SLOW_DOWN_AFTER_S`: a holder
  serving one pull after another (an engine's steps come every few ms) would otherwise send two
  messages per pull, the slow-down and the speed-up. An admission meanwhile cancels it.

Owned by :class:`kvd.core.dataplane.DataPlane`, on its event loop; closed with its worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

FAST_POLL_SLACK_S = 1.0
SLOW_DOWN_AFTER_S = 0.25


class FastPollTeller:
    """The deadline a worker was told, and the slow-down waiting to be told (event loop only)."""

    def __init__(self, tell: Callable[[float], None]) -> None:
        self._tell = tell  # sends the worker its new deadline
        self.told = 0.0
        self._slowing: asyncio.TimerHandle | None = None

    def want(self, deadline: float) -> None:
        """The latest open admission's deadline (0.0: none; a past one: poll now and then)."""
        if not deadline:
            if self.told and self._slowing is None:
                self._slowing = asyncio.get_running_loop().call_later(SLOW_DOWN_AFTER_S, self._slow_down)
            return
        self._cancel_slowing()
        if deadline > self.told:
            self._send(deadline + FAST_POLL_SLACK_S)

    def close(self) -> None:
        """The worker is gone: nothing more is told."""
        self._cancel_slowing()

    def _slow_down(self) -> None:
        self._slowing = None
        self._send(0.0)

    def _cancel_slowing(self) -> None:
        if self._slowing is not None:
            self._slowing.cancel()
            self._slowing = None

    def _send(self, deadline: float) -> None:
        self.told = deadline
        self._tell(deadline)
