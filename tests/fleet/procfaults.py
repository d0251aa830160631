"""The fleet's process faults: a daemon's data-plane worker killed, crashed or hung mid-read; a
daemon restarted cleanly; a rolling restart of every daemon. See docs/fleet.md, "Faults".

What the daemon must do is documented: a lost worker (docs/lifetimes.md, "A lost data-plane
worker") is replaced by the spare while the engines keep their registrations and streams; a hung
one (no heartbeat answer within ``dataplane_heartbeat_timeout_s``) is killed by the daemon and
replaced the same way; a daemon stopped by SIGTERM finishes or aborts its pulls within
``shutdown_grace_s``, tells their outcomes, and exits 0; its engines register again with the new
one. Each fault measures how long the node took to serve an exact pull again with probes: moves
of a fresh prompt held on another node into an engine of the faulted node (the reader side, where
the worker does the READs), one after the other until one is verified.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fleet.run import DaemonProc, FaultRecord, Fleet

WORKER_SIGNALS = {"worker_kill": signal.SIGKILL, "worker_segv": signal.SIGSEGV, "worker_hang": signal.SIGSTOP}
MID_READ_WAIT_S = 10.0  # how long a worker fault waits for a pull in flight on its node before it strikes anyway
PROBE_LIMIT_S = 60.0  # a node that serves no exact pull this long after a fault has not recovered
REREGISTER_LIMIT_S = 60.0  # engines not registered with a restarted daemon by then: a violation
REGISTERED_WAIT_S = 30.0  # how long a fault waits for its node's engines to be registered before it counts them
HEARTBEAT_TIMEOUT_S = 5.0  # the daemon's default dataplane_heartbeat_timeout_s (the fleet keeps it)


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (a daemon's data-plane workers: the serving one, the spare)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


class ProcessFaults:
    """The faults on a node's processes, injected by :class:`fleet.run.Fleet`."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        # One row per worker fault: what was hit, whether a pull was in flight, how long recovery took.
        self.worker_recovery: list[dict[str, Any]] = []
        self.restarts: list[dict[str, Any]] = []  # one row per clean daemon restart

    # -- helpers ------------------------------------------------------------------------------

    async def status(self, node: int) -> Any:
        return await self.fleet.router.clients[node].get_status(timeout_s=2.0)

    async def wait_busy(self, node: int) -> tuple[bool, Any]:
        """Until a pull runs on ``node`` (as reader: transfers in flight; as holder: admitted
        reads), at most MID_READ_WAIT_S; returns (whether one did, the last status)."""
        limit = time.monotonic() + MID_READ_WAIT_S
        status = None
        while time.monotonic() < limit:
            with contextlib.suppress(Exception):
                status = await self.status(node)
                if status.transfers_in_flight or status.admitted_reads:
                    return True, status
            await asyncio.sleep(0.01)
        if status is None:
            status = await self.status(node)
        return False, status

    async def registrations(self, node: int, settle_s: float = 0.0) -> dict[str, int]:
        """Each engine of ``node`` registered now: how many times it has registered with a daemon.

        ``settle_s``: first wait up to that long for every engine of the node to be registered.
        An earlier fault of the node (its daemon killed, say) may still have an engine
        registering again when this fault starts: counted before it is done, that engine's own
        recovery would read as this fault's doing. One still unregistered after the wait is
        left out (its count is not this fault's to judge)."""
        from fleet.router import EngineDown, engine_call

        limit = time.monotonic() + settle_s
        while True:
            out: dict[str, int] = {}
            unregistered = 0
            for e in self.fleet.engines:
                if e.node == node:
                    with contextlib.suppress(EngineDown):
                        answer = await engine_call(self.fleet.ref(e), "status", timeout_s=3.0)
                        if answer["registered"]:
                            out[e.engine_id] = int(answer["registrations"])
                        else:
                            unregistered += 1
            if not unregistered or time.monotonic() >= limit:
                return out
            await asyncio.sleep(0.1)

    async def probe_until_exact(self, node: int, since: float) -> float | None:
        """Probes into ``node`` until one is verified; the seconds from ``since`` (monotonic) to
        the end of its pull, or None after PROBE_LIMIT_S."""
        readers = [self.fleet.ref(e) for e in self.fleet.engines if e.node == node]
        holders = [self.fleet.ref(e) for e in self.fleet.engines if e.node != node]
        rng = self.fleet.rng
        limit = time.monotonic() + PROBE_LIMIT_S
        while time.monotonic() < limit:
            before = len(self.fleet.router.tally.ok_pulls_by_node.get(node, []))
            if await self.fleet.router.probe(rng.choice(holders), rng.choice(readers)):
                pulls = self.fleet.router.tally.ok_pulls_by_node[node][before:]
                return round(max(end for _, end in pulls) - since, 2)
            await asyncio.sleep(0.05)
        return None

    # -- the data-plane worker ------------------------------------------------------------------

    async def worker(self, r: FaultRecord) -> None:
        """SIGKILL, SIGSEGV or SIGSTOP the serving worker of node ``r.node`` while a pull runs there.

        A stopped worker is the daemon's to find hung (no heartbeat answer within
        ``dataplane_heartbeat_timeout_s``) and to kill and replace: the fault waits for that and
        never sends SIGCONT unless the daemon failed to (a violation)."""
        fleet = self.fleet
        sig = WORKER_SIGNALS[r.kind]
        node = r.node
        before = await self.registrations(node, settle_s=REGISTERED_WAIT_S)
        mid_read, status = await self.wait_busy(node)
        pid, restarts = status.dataplane_pid, status.dataplane_restarts
        if not pid:
            raise RuntimeError(f"n{node} reports no data-plane worker")
        daemon = fleet.daemons[node].process
        assert daemon is not None
        others = [c for c in children(daemon.pid) if c != pid]  # the spare, ready or starting, if any
        t_signal = time.monotonic()
        os.kill(pid, sig)
        row: dict[str, Any] = {
            "kind": r.kind,
            "node": node,
            "at_s": round(t_signal - fleet.t0, 1),
            "pid": pid,
            "mid_read": mid_read,
            "in_flight": status.transfers_in_flight,
            "admitted": status.admitted_reads,
            "spare": bool(others),
        }
        self.worker_recovery.append(row)
        probe = asyncio.create_task(self.probe_until_exact(node, t_signal))
        replaced = await self._wait_replaced(node, pid, restarts, limit_s=HEARTBEAT_TIMEOUT_S + 60.0)
        if replaced is None:
            fleet.violations.append(f"n{node}: worker {pid} ({r.kind}) was not replaced")
            if sig == signal.SIGSTOP:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        else:
            row["replaced_s"] = round(replaced[0] - t_signal, 2)
            row["reason"] = replaced[1]
        row["exact_pull_s"] = await probe
        if row["exact_pull_s"] is None:
            fleet.violations.append(f"n{node}: no exact pull within {PROBE_LIMIT_S:.0f}s of {r.kind}")
        after = await self.registrations(node)
        again = sorted(k for k, n in after.items() if k in before and n != before[k])
        if again:
            fleet.violations.append(f"n{node}: engines {again} registered again after {r.kind} (they must keep theirs)")
        r.detail = (
            f"pid {pid}{' mid-read' if mid_read else ' (no pull in flight)'}"
            f"{'' if others else ', no spare worker yet'}, replaced in "
            f"{row.get('replaced_s')}s ({row.get('reason')}), exact pull after {row['exact_pull_s']}s"
        )

    async def _wait_replaced(self, node: int, pid: int, restarts: int, limit_s: float) -> tuple[float, str] | None:
        """Until the daemon counts one more worker restart and names another worker in GetStatus
        (``dataplane_pid``: set as the new worker takes over, just before it maps the engines
        again): (when, the restart's reason)."""
        limit = time.monotonic() + limit_s
        while time.monotonic() < limit:
            with contextlib.suppress(Exception):
                status = await self.status(node)
                if status.dataplane_restarts > restarts and status.dataplane_pid not in (0, pid):
                    return time.monotonic(), status.dataplane_last_restart
            await asyncio.sleep(0.05)
        return None

    # -- daemons restarted cleanly ------------------------------------------------------------

    async def restart(self, d: DaemonProc) -> dict[str, Any]:
        """SIGTERM the daemon (with a pull in flight when there is one), wait for its exit (0),
        start a new ``kvd serve`` with the same config, wait for its engines to register again."""
        fleet = self.fleet
        before = await self.registrations(d.node, settle_s=REGISTERED_WAIT_S)
        mid_read, _ = await self.wait_busy(d.node)
        t0 = time.monotonic()
        d.expect_exit = True
        assert d.process is not None
        d.process.send_signal(signal.SIGTERM)
        d.clean_stops.add(d.epoch)
        grace = 5.0 + 30.0
        try:
            code: int | str = await asyncio.wait_for(asyncio.to_thread(d.process.wait), grace)
        except TimeoutError:
            d.process.kill()
            await asyncio.to_thread(d.process.wait)
            code = "timeout"
        stopped = time.monotonic()
        if code != 0:
            fleet.violations.append(f"daemon n{d.node} exited {code} on SIGTERM (restart):\n{fleet.log_tail(d)}")
        fleet.launch_daemon(d)
        await fleet.wait_daemon(d)
        ready = time.monotonic()
        limit = ready + REREGISTER_LIMIT_S
        waiting = dict(before)
        while waiting and time.monotonic() < limit:
            now = await self.registrations(d.node)
            waiting = {k: n for k, n in waiting.items() if now.get(k, n) <= n}
            if waiting:
                await asyncio.sleep(0.1)
        registered = time.monotonic()
        if waiting:
            fleet.violations.append(f"n{d.node}: engines {sorted(waiting)} did not register again after its restart")
        exact = await self.probe_until_exact(d.node, registered)
        if exact is None:
            fleet.violations.append(f"n{d.node}: no exact pull within {PROBE_LIMIT_S:.0f}s of its restart")
        row = {
            "node": d.node,
            "at_s": round(t0 - fleet.t0, 1),
            "mid_read": mid_read,
            "exit": code,
            "stop_s": round(stopped - t0, 2),
            "start_s": round(ready - stopped, 2),
            "reregister_s": round(registered - ready, 2),
            "exact_pull_s": None if exact is None else round(registered + exact - t0, 2),
        }
        self.restarts.append(row)
        return row

    async def daemon_restart(self, r: FaultRecord) -> None:
        row = await self.restart(self.fleet.daemons[r.node])
        r.detail = self._describe(row)

    async def rolling_restart(self, r: FaultRecord) -> None:
        """Every daemon restarted, one node at a time, in an order drawn from the seed."""
        order = list(range(len(self.fleet.daemons)))
        self.fleet.rng.shuffle(order)
        parts = []
        for node in order:
            r.node = node  # the node the fault is at now; the last one stays
            parts.append(f"n{node}: " + self._describe(await self.restart(self.fleet.daemons[node])))
        r.detail = "; ".join(parts)

    @staticmethod
    def _describe(row: dict[str, Any]) -> str:
        return (
            f"exit {row['exit']} in {row['stop_s']}s{' (pulls in flight)' if row['mid_read'] else ''}, "
            f"ready {row['start_s']}s later, engines registered {row['reregister_s']}s later, "
            f"exact pull {row['exact_pull_s']}s after SIGTERM"
        )
