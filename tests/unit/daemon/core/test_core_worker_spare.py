"""The launcher's spare worker (kvd.core.workers): a spare lost before it served is replaced in
the background and is never a serving worker's loss; a dead one is never handed out.

The workers here are real processes (``cat``, reading its channel) on a real channel, started by a stand-in for
the launcher's ``_spawn`` (a real worker imports torch and NIXL for seconds): the test kills them
as an operator or the OOM killer would, and checks what the launcher hands out and starts.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from kvd.core.workers import WorkerLauncher, WorkerProcess, WorkerStartFailed, backoff_delay

WAIT_S = 10.0


class Spawns:
    """Stands in for WorkerLauncher._spawn: a ``cat`` process per worker, after its delay."""

    def __init__(self) -> None:
        self.delays: list[float] = []  # the back-off each start was asked to wait
        self.workers: list[WorkerProcess] = []
        self.errors: list[BaseException] = []  # raised, one per start, by the next starts

    async def spawn(self, agent_name: str, delay_s: float = 0.0) -> WorkerProcess:
        self.delays.append(delay_s)
        if delay_s:
            await asyncio.sleep(delay_s)
        if self.errors:
            raise self.errors.pop(0)
        ours, theirs = socket.socketpair()
        with theirs:  # the worker's end: it exits when the launcher closes its channel, as a worker does
            process = await asyncio.create_subprocess_exec("cat", stdin=theirs, stdout=asyncio.subprocess.DEVNULL)
        reader, writer = await asyncio.open_connection(sock=ours)
        worker = WorkerProcess(process, reader, writer, agent_name=agent_name)
        self.workers.append(worker)
        return worker

    def end_all(self) -> None:
        for worker in self.workers:
            worker.kill()


def launcher_with(spawns: Spawns, **backoff: float) -> WorkerLauncher:
    launcher = WorkerLauncher("spare-test", ("UCX",), False, "WARNING", 0.0002, **backoff)
    launcher._spawn = spawns.spawn  # type: ignore[method-assign]
    return launcher


def run(scenario: Callable[[WorkerLauncher, Spawns], Awaitable[None]], **backoff: float) -> None:
    async def main() -> None:
        errors: list[Any] = []
        asyncio.get_running_loop().set_exception_handler(lambda _loop, context: errors.append(context["message"]))
        spawns = Spawns()
        launcher = launcher_with(spawns, **backoff)
        try:
            await scenario(launcher, spawns)
        finally:
            await launcher.close()
            spawns.end_all()
            for worker in spawns.workers:
                await worker.reap()
        assert errors == []

    asyncio.run(main())


async def until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(WAIT_S):
        while not condition():
            await asyncio.sleep(0.005)


async def ready_spare(launcher: WorkerLauncher) -> WorkerProcess:
    """The spare once it has started."""
    await until(lambda: launcher._spare is not None and launcher._spare.done())
    assert launcher._spare is not None
    return launcher._spare.result()


def test_backoff_delay_is_none_at_first_then_doubles_up_to_its_cap() -> None:
    assert [backoff_delay(n, 0.25, 4.0) for n in range(1, 9)] == [0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert backoff_delay(100_000, 0.25, 4.0) == 4.0  # no overflow after a very long loop


def test_a_spare_killed_while_idle_is_replaced_in_the_background_and_handed_out_next() -> None:
    async def scenario(launcher: WorkerLauncher, spawns: Spawns) -> None:
        first = await launcher.take()
        spare = await ready_spare(launcher)
        os.kill(spare.pid, signal.SIGKILL)
        await until(lambda: launcher.spares_lost == 1)
        replacement = await ready_spare(launcher)
        assert replacement is not spare and not replacement.gone()
        assert spawns.delays == [0.0, 0.0, 0.0]  # the first, its spare, the spare's replacement (at once)
        assert await spare.reap() == -signal.SIGKILL

        taken = await launcher.take()
        assert taken is replacement and not first.gone()
        assert launcher.started == 4  # and the next spare: nothing started afresh for the taker

    run(scenario)


def test_a_spare_found_dying_when_a_worker_is_needed_is_passed_over_for_a_fresh_one() -> None:
    """The worker and its spare are killed together: the spare's death has not been seen yet
    when the worker's replacement is taken; the launcher sees it (a SIGKILL pending, exiting)."""

    async def scenario(launcher: WorkerLauncher, spawns: Spawns) -> None:
        await launcher.take()
        spare = await ready_spare(launcher)
        os.kill(spare.pid, signal.SIGKILL)
        deadline = time.monotonic() + WAIT_S
        while not spare.gone():  # (a kill is seen once pending or acted on; no await: no watch runs)
            assert time.monotonic() < deadline
        taken = await launcher.take()
        assert taken is not spare and not taken.gone()
        assert spare.gone() and launcher.spares_lost == 0  # passed over, not replaced in the background
        assert launcher.started == 4  # the first, its spare, a fresh one, the next spare

    run(scenario)


def test_spares_that_keep_dying_are_replaced_after_a_growing_back_off() -> None:
    async def scenario(launcher: WorkerLauncher, spawns: Spawns) -> None:
        await launcher.take()
        for lost in range(1, 6):
            spare = await ready_spare(launcher)
            os.kill(spare.pid, signal.SIGKILL)
            await until(lambda lost=lost: launcher.spares_lost == lost)
        assert spawns.delays == [0.0, 0.0, 0.0, 0.01, 0.02, 0.04, 0.04]
        await ready_spare(launcher)

        # A spare taken alive ends the run: the next spare lost is replaced at once again.
        await launcher.take()
        spare = await ready_spare(launcher)
        os.kill(spare.pid, signal.SIGKILL)
        await until(lambda: launcher.spares_lost == 6)
        assert spawns.delays[-1] == 0.0

    run(scenario, respawn_backoff_s=0.01, respawn_backoff_max_s=0.04)


def test_a_spare_killed_while_it_starts_is_replaced() -> None:
    async def scenario(launcher: WorkerLauncher, spawns: Spawns) -> None:
        await launcher.take()
        spare = await ready_spare(launcher)
        spawns.errors = [WorkerStartFailed("did not start: SIGKILL", killed=True)]
        os.kill(spare.pid, signal.SIGKILL)  # its replacement is then killed while it starts
        await until(lambda: launcher.spares_lost == 2)
        assert not (await ready_spare(launcher)).gone()

    run(scenario, respawn_backoff_s=0.01)


def test_a_spare_that_cannot_start_is_left_and_the_next_worker_needed_starts_afresh() -> None:
    async def scenario(launcher: WorkerLauncher, spawns: Spawns) -> None:
        await launcher.take()
        spare = await ready_spare(launcher)
        spawns.errors = [WorkerStartFailed("did not start: exit 1")]  # for the spare's replacement
        os.kill(spare.pid, signal.SIGKILL)
        await until(lambda: launcher.spares_lost == 1)
        await until(lambda: launcher._spare is not None and launcher._spare.done())
        assert launcher._spare is not None and isinstance(launcher._spare.exception(), WorkerStartFailed)
        await asyncio.sleep(0.05)
        assert launcher.started == 3  # no start after the one that could not

        taken = await launcher.take()  # a fresh one; its failure would be the caller's to judge
        assert not taken.gone() and launcher.started == 5

    run(scenario)


def test_a_worker_needed_while_the_spare_backs_off_starts_at_once() -> None:
    async def scenario(launcher: WorkerLauncher, spawns: Spawns) -> None:
        await launcher.take()
        for lost in (1, 2):
            spare = await ready_spare(launcher)
            os.kill(spare.pid, signal.SIGKILL)
            await until(lambda lost=lost: launcher.spares_lost == lost)
        assert spawns.delays[-1] == 3600.0  # the second spare lost in a row: its replacement waits
        taken = await launcher.take()
        await until(lambda: len(spawns.delays) == launcher.started)
        assert not taken.gone() and spawns.delays[-2:] == [0.0, 0.0]  # a fresh one, and the next spare

    run(scenario, respawn_backoff_s=3600.0, respawn_backoff_max_s=3600.0)


@pytest.mark.parametrize("state", ["ready", "replaced", "backing-off"])
def test_close_ends_the_spare_and_its_watch_whatever_its_state(state: str) -> None:
    async def scenario(launcher: WorkerLauncher, spawns: Spawns) -> None:
        await launcher.take()
        spare = await ready_spare(launcher)
        if state != "ready":
            os.kill(spare.pid, signal.SIGKILL)
            await until(lambda: launcher.spares_lost == 1)
        if state == "backing-off":
            spare = await ready_spare(launcher)
            os.kill(spare.pid, signal.SIGKILL)
            await until(lambda: launcher.spares_lost == 2)
        watch = launcher._spare_watch
        await launcher.close()
        assert launcher._spare_watch is None and watch is not None and watch.done()
        assert all(worker.gone() for worker in spawns.workers[1:])  # every spare; the first is the caller's
        with pytest.raises(Exception, match="shutting down"):
            await launcher.take()

    run(scenario, respawn_backoff_s=3600.0, respawn_backoff_max_s=3600.0)
