"""The daemon's sweeper: deadlines acted on when they pass, and what is polled rather than announced.

One part of the daemon (:class:`kvd.core.daemon.Daemon` composes it and runs :meth:`Sweeper.run`
as a task): each round expires leases and ends overdue admissions (the lease table's sweep),
frees quarantined memory whose reads are over, hands back what stale pulls held, and forgets
idle peers. Event-loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from kvd.core.leases import LeaseTable
from kvd.core.local_memory import Memories
from kvd.core.peers import Peers
from kvd.core.pulls import Puller
from kvd.core.transfers import TransferTable

logger = logging.getLogger(__name__)

SWEEP_S = 0.05  # leases, admissions, quarantine, stale pulls
# The sweeper sleeps until the next lease or admission deadline (it is woken when one comes
# nearer); it rounds every SWEEP_S only while something is polled rather than announced (pulls in
# flight, stale pulls, quarantined mappings). This bounds its sleep otherwise: an idle daemon
# wakes once a second here, not 20 times (issue 19: idle CPU).
SWEEP_IDLE_MAX_S = 1.0
SWEEP_MIN_S = 0.001  # never spin, even on a deadline the sweep could not act on
IDLE_PEER_SWEEP_S = 5.0


class Sweeper:
    """When the next round is due, and the rounds (module docstring)."""

    def __init__(
        self,
        leases: LeaseTable,
        transfers: TransferTable,
        *,
        memories: Callable[[], Memories | None],
        puller: Callable[[], Puller | None],
        peers: Callable[[], Peers | None],
    ) -> None:
        self.leases = leases
        self.transfers = transfers
        self._memories = memories  # built at start, as the two below
        self._puller = puller
        self._peers = peers
        self._sweep_now = asyncio.Event()  # a deadline came nearer, or something needs polling
        self._sweep_at = 0.0  # when the sweeper's next round is due (monotonic)

    def wake(self) -> None:
        """Have the sweeper recompute its sleep, if it sleeps longer than SWEEP_S (a round due
        sooner sees the news anyway: a burst of holds or pulls costs no extra rounds)."""
        if self._sweep_at - time.monotonic() > SWEEP_S:
            self._sweep_now.set()

    def _delay(self) -> float:
        """Seconds the sweeper may sleep: SWEEP_S while it polls something that announces no
        end (a stale pull's or a quarantined mapping's reads turning final, a pull in flight that
        may leave one), else until the next lease or admission deadline, at most SWEEP_IDLE_MAX_S."""
        puller, memories = self._puller(), self._memories()
        if (
            (memories is not None and memories.quarantine)
            or (puller is not None and puller.stale_pulls)
            or self.transfers.any_in_flight()
        ):
            return SWEEP_S
        due = self.leases.next_deadline() - time.monotonic()
        return max(SWEEP_MIN_S, min(SWEEP_IDLE_MAX_S, due))

    async def run(self) -> None:
        """Expire leases, end overdue admissions, free quarantined memory, forget idle peers.

        A deadline is acted on when it passes (not on a fixed 50 ms tick): the sweeper sleeps
        until the next one, woken early when a lease, renewal, admission, pull or quarantined
        mapping may bring one nearer (see SWEEP_IDLE_MAX_S).
        """
        last_idle_sweep = time.monotonic()
        while True:
            self._sweep_now.clear()
            try:
                delay = self._delay()
            except Exception:  # the sweeper must survive a bug: round every SWEEP_S then
                logger.exception("sweep scheduling failed")
                delay = SWEEP_S
            self._sweep_at = time.monotonic() + delay
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._sweep_now.wait()
                    # Woken: a deadline may be nearer, or there is something to poll. A round
                    # SWEEP_S from now (later wakes are no-ops meanwhile) sees it: a burst of
                    # holds or pulls costs at most a round every SWEEP_S, as a fixed tick did.
                    self._sweep_at = time.monotonic() + SWEEP_S
                    await asyncio.sleep(SWEEP_S)
            try:
                self.leases.sweep()
                memories, puller, peers = self._memories(), self._puller(), self._peers()
                if memories is not None:
                    await memories.sweep_quarantine()
                if puller is not None:
                    await puller.sweep()
                if peers is not None and time.monotonic() - last_idle_sweep > IDLE_PEER_SWEEP_S:
                    last_idle_sweep = time.monotonic()
                    await peers.forget_idle()
            except Exception:  # the sweeper must survive a bug in one round: log and go on
                logger.exception("sweep failed")
