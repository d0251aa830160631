"""WorkerProcess.reap: a worker that does not exit is waited for, and said so, with its kernel state."""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
import time
import types
from asyncio.subprocess import PIPE

import pytest

from kvd.core import dataplane as dataplane_module
from kvd.core import workers
from kvd.core.dataplane import DataPlane
from kvd.core.workers import WorkerProcess


def test_a_worker_that_does_not_exit_is_waited_for_and_logged_with_its_kernel_state(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """reap() waits as long as the process lives (it is the fence), warning every REAP_WARN_S
    with the process's state from /proc; once the process is killed, reap() returns its status."""
    monkeypatch.setattr(workers, "REAP_WARN_S", 0.2)

    async def main() -> None:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-c", "import time; print('sleeping', flush=True); time.sleep(60)", stdout=PIPE
        )
        assert process.stdout is not None
        await process.stdout.readline()  # asleep from now on (state S), not still starting up (R)
        worker = WorkerProcess(process, asyncio.StreamReader(), None)  # type: ignore[arg-type]
        reaping = asyncio.ensure_future(worker.reap())
        await asyncio.sleep(0.7)
        assert not reaping.done(), "reap() returned while the process still lives"
        process.send_signal(signal.SIGKILL)
        async with asyncio.timeout(10):
            assert await reaping == -signal.SIGKILL
        assert worker.kernel_state() == "no longer in /proc"

    with caplog.at_level(logging.WARNING, logger="kvd.core.workers"):
        asyncio.run(main())
    warnings = [r.getMessage() for r in caplog.records if "has not exited" in r.getMessage()]
    assert len(warnings) >= 2, caplog.text
    assert "state S" in warnings[0] and "stay fenced" in warnings[0]


def test_reap_cancelled_leaves_no_waiter_behind() -> None:
    """A reap cut short (WorkerProcess.end's grace period) cancels its wait; a later reap works."""

    async def main() -> None:
        process = await asyncio.create_subprocess_exec(sys.executable, "-c", "import time; time.sleep(60)")
        worker = WorkerProcess(process, asyncio.StreamReader(), None)  # type: ignore[arg-type]
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await worker.reap()
        process.kill()
        async with asyncio.timeout(10):
            assert await worker.reap() == -signal.SIGKILL
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        assert not pending, pending

    asyncio.run(main())


def test_sigkill_pending_reads_the_thread_and_the_process_masks() -> None:
    """SIGKILL is signal 9: bit 8 of SigPnd (the thread's) or ShdPnd (the process's), in hex."""
    quiet = "Name:\tpython\nSigPnd:\t0000000000000000\nShdPnd:\t0000000000000000\nSigBlk:\t0000000000000100\n"
    assert not workers.sigkill_pending(quiet)  # blocked is not pending (and SIGKILL cannot be blocked)
    assert workers.sigkill_pending(quiet.replace("SigPnd:\t0000000000000000", "SigPnd:\t0000000000000100"))
    assert workers.sigkill_pending(quiet.replace("ShdPnd:\t0000000000000000", "ShdPnd:\t0000000000004100"))
    assert not workers.sigkill_pending(quiet.replace("ShdPnd:\t0000000000000000", "ShdPnd:\t0000000000004000"))


def test_a_live_process_has_no_kill_pending_and_a_reaped_one_is_dying() -> None:
    """kill_pending reads every thread of the real process; once it is reaped, dying() is true."""

    async def main() -> None:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-c", "import time; print('sleeping', flush=True); time.sleep(60)", stdout=PIPE
        )
        assert process.stdout is not None
        await process.stdout.readline()
        worker = WorkerProcess(process, asyncio.StreamReader(), None)  # type: ignore[arg-type]
        assert not worker.kill_pending() and not worker.dying()
        process.send_signal(signal.SIGKILL)
        async with asyncio.timeout(10):
            await worker.reap()
        assert worker.dying()

    asyncio.run(main())


def test_a_kill_never_polls_the_process_so_its_exit_status_stays_the_watchers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``Process.kill`` polls first (``Popen.send_signal``), and a poll reaps a worker that has
    just died (its channel's end can come before asyncio's watcher thread has run, under load):
    the watcher then finds no child and reports exit 255, and a worker killed while it started
    passed for one that cannot start, which ends the daemon (kvd.core.restarts). So a kill is a
    plain SIGKILL, and what reap() reports is how the worker died."""

    async def main() -> None:
        process = await asyncio.create_subprocess_exec(sys.executable, "-c", "import time; time.sleep(60)")
        worker = WorkerProcess(process, asyncio.StreamReader(), None)  # type: ignore[arg-type]
        transport = process._transport  # type: ignore[attr-defined]
        monkeypatch.setattr(transport._proc, "poll", lambda: pytest.fail("the kill polled (and may reap)"))
        worker.kill()
        async with asyncio.timeout(10):
            assert await worker.reap() == -signal.SIGKILL
        worker.kill()  # reaped: nothing to signal, no error

    asyncio.run(main())


def test_a_worker_reaped_before_the_event_loop_hears_of_it_is_dying() -> None:
    """asyncio's watcher thread reaps a worker before the event loop learns its exit status: in
    between, ``/proc/<pid>`` is gone while ``returncode`` is still None. A heartbeat timing out
    in that instant must see a dead worker, not a hung one (a kill counted as 'hung')."""

    async def main() -> None:
        child = subprocess.Popen([sys.executable, "-c", "pass"])
        child.wait()  # reaped: its /proc entry is gone
        unheard = types.SimpleNamespace(pid=child.pid, returncode=None)
        worker = WorkerProcess(unheard, asyncio.StreamReader(), None)  # type: ignore[arg-type]
        assert not worker.exited
        assert worker.exiting() and worker.dying()

    asyncio.run(main())


def test_a_heartbeat_miss_waits_a_moment_for_a_dying_worker_to_show_it_and_no_longer() -> None:
    """A SIGKILL dequeued but not yet acted on looks neither killed nor exiting: the heartbeat
    looks again for DYING_GRACE_S before it calls the worker hung, and not longer."""

    class Worker:
        def __init__(self, dying_after: int | None) -> None:
            self.looks, self.dying_after = 0, dying_after

        def dying(self) -> bool:
            self.looks += 1
            return self.dying_after is not None and self.looks > self.dying_after

    async def main() -> None:
        killed = Worker(dying_after=3)
        assert await DataPlane._dying_after_all(killed)  # type: ignore[arg-type]
        assert killed.looks == 4
        hung = Worker(dying_after=None)
        started = time.monotonic()
        assert not await DataPlane._dying_after_all(hung)  # type: ignore[arg-type]
        assert dataplane_module.DYING_GRACE_S <= time.monotonic() - started < 5.0

    asyncio.run(main())
