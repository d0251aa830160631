"""Data-plane worker processes: started, kept one spare, connected, and ended.

A worker (``python -m kvd.worker``) takes about 1.5 s to import torch and NIXL; a restart after
a crash must serve again well under a second. So the launcher keeps one **spare** worker that
has finished importing and waits, on its channel, for ``start``: a restart promotes the spare
(creating its NIXL agent takes tens of milliseconds) and a new spare starts in the background.

Each worker gets one end of a private ``socketpair`` (its fd passed at exec); the other end
stays here. The worker also asks the kernel to kill it if the control process dies
(``PR_SET_PDEATHSIG``), so no worker outlives its daemon. Event-loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import sys

from kvd.dataplane_protocol import HELLO, read_frame
from kvd_client.errors import Unavailable

logger = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 60.0  # a worker that has not imported NIXL by then is not coming


@dataclasses.dataclass(eq=False)
class WorkerProcess:
    """One worker process and the control process's end of its channel."""

    process: asyncio.subprocess.Process
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    @property
    def pid(self) -> int:
        return self.process.pid

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()

    async def reap(self) -> int:
        """Wait for the process to be gone (its mappings and endpoints with it); its exit status."""
        return await self.process.wait()

    def close_channel(self) -> None:
        self.writer.close()


def exit_reason(returncode: int | None) -> str:
    """ "SIGSEGV", "SIGKILL", "exit 3": how a worker ended, for logs, status and metric labels."""
    if returncode is None:
        return "unknown"
    if returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            return f"signal {-returncode}"
    return f"exit {returncode}"


class WorkerLauncher:
    """Starts workers and keeps one spare ready (see the module docstring)."""

    def __init__(self, log_level: str, switch_interval_s: float, spare: bool = True) -> None:
        self._log_level = log_level
        self._switch_interval_s = switch_interval_s
        self._spare_wanted = spare
        self._spare: asyncio.Task[WorkerProcess] | None = None
        self._closed = False
        self.started = 0

    async def take(self) -> WorkerProcess:
        """A worker that has imported NIXL and waits for ``start``; starts the next spare."""
        if self._closed:
            raise Unavailable("the daemon is shutting down: no data-plane worker is started")
        task = self._spare if self._spare is not None else self._launch()
        self._spare = None
        try:
            worker = await asyncio.shield(task)
        except BaseException:
            if not task.done():
                task.add_done_callback(_kill_when_ready)
            raise
        finally:
            if self._spare_wanted and not self._closed:
                self._spare = self._launch()
        return worker

    def _launch(self) -> asyncio.Task[WorkerProcess]:
        return asyncio.get_running_loop().create_task(self._spawn(), name="kvd-worker-spawn")

    async def _spawn(self) -> WorkerProcess:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "kvd.worker",
                "--channel-fd",
                str(theirs.fileno()),
                "--log-level",
                self._log_level,
                "--switch-interval",
                repr(self._switch_interval_s),
                "--parent-pid",
                str(os.getpid()),
                pass_fds=(theirs.fileno(),),
                stdin=asyncio.subprocess.DEVNULL,
            )
        finally:
            theirs.close()
        self.started += 1
        reader, writer = await asyncio.open_connection(sock=ours, limit=1 << 24)
        worker = WorkerProcess(process, reader, writer)
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                message = await read_frame(reader)
        except BaseException as exc:
            worker.kill()
            worker.close_channel()
            returncode = await worker.reap()
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise Unavailable(
                f"the data-plane worker (pid {process.pid}) did not start: {exit_reason(returncode)}; see its log"
            ) from exc
        if message[0] != HELLO:
            worker.kill()
            raise Unavailable(f"the data-plane worker said {message[0]!r} instead of hello")
        logger.debug("data-plane worker %d ready", process.pid)
        return worker

    async def close(self) -> None:
        """No more workers; end the spare."""
        self._closed = True
        if self._spare is not None:
            spare, self._spare = self._spare, None
            spare.cancel()
            with contextlib.suppress(BaseException):
                worker = await spare
                worker.close_channel()  # the worker exits at end of channel
                try:
                    async with asyncio.timeout(5.0):
                        await worker.reap()
                except TimeoutError:
                    worker.kill()
                    await worker.reap()


def _kill_when_ready(task: asyncio.Task[WorkerProcess]) -> None:
    if not task.cancelled() and task.exception() is None:
        worker = task.result()
        worker.kill()
        worker.close_channel()
