"""Data-plane worker processes: started, kept one spare, connected, and ended.

A worker (``python -m kvd.worker``) takes about 1.5 s to import torch and NIXL, and half a second
more to create its NIXL agent (UCX's initialisation); a restart after a crash must serve again
well under a second. So the launcher keeps one **spare** worker that has imported everything and
already created its agent, under the name the next incarnation will have (``<base>-r<N>``): a
restart promotes the spare in milliseconds, and a new spare starts in the background.

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
import time
from pathlib import Path

from kvd.dataplane_protocol import (
    CALL,
    DEFAULT_MAX_POST_BYTES,
    DEFAULT_PARALLEL_READ_MIN_BYTES,
    HELLO,
    REPLY,
    AgentIdentity,
    CopySettings,
    decode_error,
    frame,
    read_frame,
)
from kvd_client.errors import KvdError, Unavailable

logger = logging.getLogger(__name__)

PF_EXITING = 0x4  # /proc/<pid>/stat flags: the process is exiting
SIGKILL_BIT = 1 << (signal.SIGKILL - 1)  # in /proc/<pid>/status's SigPnd/ShdPnd masks
REAP_WARN_S = 5.0  # a worker not gone this long after it ended or was killed is logged, and again each time
HELLO_TIMEOUT_S = 60.0  # a worker that has not imported NIXL by then is not coming


@dataclasses.dataclass(eq=False)
class WorkerProcess:
    """One worker process and the control process's end of its channel."""

    process: asyncio.subprocess.Process
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    agent_name: str = ""
    identity: AgentIdentity = AgentIdentity(b"", ())

    @property
    def exited(self) -> bool:
        return self.process.returncode is not None

    @property
    def pid(self) -> int:
        return self.process.pid

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()

    def _stat(self) -> list[str] | None:
        """The fields of ``/proc/<pid>/stat`` after the command name (state first); None once gone."""
        try:
            return Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return None

    def exiting(self) -> bool:
        """Whether the process is already on its way out (the kernel's PF_EXITING, or gone)."""
        fields = self._stat()
        if not fields:
            return self.exited
        return fields[0] in ("Z", "X") or bool(int(fields[6]) & PF_EXITING)

    def dying(self) -> bool:
        """Whether the process is exiting, or a SIGKILL already waits for it.

        A SIGKILL sent while a thread sits in an uninterruptible kernel call (a page fault on
        shared memory, a CMA copy) is acted on only when the call returns, seconds later under
        load: until then the process is neither exiting nor answering. It was killed, not hung,
        and the reader reports it with that cause once it is reaped."""
        return self.exiting() or self.kill_pending()

    def kill_pending(self) -> bool:
        """Whether any of its threads has a SIGKILL pending (queued, not yet acted on)."""
        try:
            tasks = list(Path(f"/proc/{self.pid}/task").iterdir())
        except OSError:
            return self.exited
        for task in tasks:
            with contextlib.suppress(OSError):
                if sigkill_pending((task / "status").read_text()):
                    return True
        return False

    async def reap(self) -> int:
        """Wait for the process to be gone (its mappings and endpoints with it); its exit status.

        A process killed inside an uninterruptible kernel call dies only when the call returns,
        and nothing of it may be reused before (it is the fence: docs/lifetimes.md). So this
        waits as long as it takes, and says every REAP_WARN_S that it still waits and on what."""
        waiting = asyncio.ensure_future(self.process.wait())
        started = time.monotonic()
        try:
            while True:
                done, _ = await asyncio.wait({waiting}, timeout=REAP_WARN_S)
                if done:
                    return waiting.result()
                logger.warning(
                    "data-plane worker %d has not exited %.0f s after it ended or was killed (%s); "
                    "its memory and endpoints stay fenced until it does",
                    self.pid,
                    time.monotonic() - started,
                    self.kernel_state(),
                )
        finally:
            waiting.cancel()

    def kernel_state(self) -> str:
        """What the kernel says the process is doing: its state letter and the call it waits in."""
        fields = self._stat()
        if not fields:
            return "no longer in /proc"
        wchan = ""
        with contextlib.suppress(OSError):
            wchan = Path(f"/proc/{self.pid}/wchan").read_text().strip()
        return f"state {fields[0]}" + (f", waiting in {wchan}" if wchan and wchan != "0" else "")

    async def end(self, grace_s: float = 5.0) -> int:
        """Close its channel (it releases everything and exits), reap it; SIGKILL it after
        ``grace_s``. Its exit status."""
        self.close_channel()
        try:
            async with asyncio.timeout(grace_s):
                return await self.reap()
        except TimeoutError:
            logger.warning(
                "data-plane worker %d did not exit within %.0f s of its channel closing: killed", self.pid, grace_s
            )
            self.kill()
            return await self.reap()

    def close_channel(self) -> None:
        self.writer.close()


def sigkill_pending(status: str) -> bool:
    """Whether a ``/proc/<pid>[/task/<tid>]/status`` text shows SIGKILL pending (for the thread
    or the whole process)."""
    for line in status.splitlines():
        name, _, value = line.partition(":")
        if name in ("SigPnd", "ShdPnd") and int(value.strip() or "0", 16) & SIGKILL_BIT:
            return True
    return False


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

    def __init__(
        self,
        agent_base: str,
        backends: tuple[str, ...],
        progress_thread: bool,
        log_level: str,
        switch_interval_s: float,
        spare: bool = True,
        prefault: bool = True,
        max_post_bytes: int = DEFAULT_MAX_POST_BYTES,
        copy_threads: int = 1,
        parallel_read_min_bytes: int = DEFAULT_PARALLEL_READ_MIN_BYTES,
    ) -> None:
        self._agent_base = agent_base
        self._copying = CopySettings(max_post_bytes, copy_threads, parallel_read_min_bytes)
        self._backends = backends
        self._progress_thread = progress_thread
        self._log_level = log_level
        self._switch_interval_s = switch_interval_s
        self._prefault = prefault
        self._spare_wanted = spare
        self._spare: asyncio.Task[WorkerProcess] | None = None
        self._closed = False
        self.started = 0

    async def take(self) -> WorkerProcess:
        """A worker whose NIXL agent is created (the spare, else a new one); starts the next spare."""
        if self._closed:
            raise Unavailable("the daemon is shutting down: no data-plane worker is started")
        task = self._spare if self._spare is not None else self._launch()
        if task.done() and not task.cancelled() and task.exception() is None and task.result().exited:
            logger.warning(
                "the spare data-plane worker %d had died (%s)", task.result().pid, task.result().process.returncode
            )
            task = self._launch()
        self._spare = None
        if self._spare_wanted:  # the next spare imports while this one starts (two cores: in parallel)
            self._spare = self._launch()
        try:
            worker = await asyncio.shield(task)
        except BaseException:
            if not task.done():
                task.add_done_callback(_kill_when_ready)
            raise
        return worker

    def reserve_name(self) -> str:
        """The NIXL agent name of the next worker: ``<base>``, then ``<base>-r1``, ``<base>-r2``…
        (never reused: a peer that loaded one agent must never mistake another for it)."""
        name = self._agent_base if self.started == 0 else f"{self._agent_base}-r{self.started}"
        self.started += 1
        return name

    def _launch(self) -> asyncio.Task[WorkerProcess]:
        return asyncio.get_running_loop().create_task(self._spawn(self.reserve_name()), name="kvd-worker-spawn")

    async def _spawn(self, agent_name: str) -> WorkerProcess:
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
                *(() if self._prefault else ("--no-prefault",)),
                pass_fds=(theirs.fileno(),),
                stdin=asyncio.subprocess.DEVNULL,
                # The binary this process runs, whatever path led to it: a daemon started as a
                # service user may not traverse the directories sys.executable names (argv[0]
                # stays sys.executable, so the worker finds the same virtual environment).
                executable="/proc/self/exe",
            )
        finally:
            theirs.close()
        reader, writer = await asyncio.open_connection(sock=ours, limit=1 << 24)
        worker = WorkerProcess(process, reader, writer)
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                message = await read_frame(reader)
                if message[0] != HELLO:
                    raise Unavailable(f"the data-plane worker said {message[0]!r} instead of hello")
                # Create the agent now, under the name its incarnation will have.
                writer.writelines(
                    frame((CALL, 0, "start", (agent_name, self._backends, self._progress_thread, self._copying)))
                )
                reply = await read_frame(reader)
                if reply[0] != REPLY or reply[1] != 0:
                    raise Unavailable(f"the data-plane worker answered {reply[0]!r} to start")
                if reply[3] is not None:
                    raise decode_error(reply[3])
        except BaseException as exc:
            worker.kill()
            worker.close_channel()
            returncode = await worker.reap()
            if isinstance(exc, asyncio.CancelledError):
                raise
            detail = exc.message if isinstance(exc, KvdError) else exit_reason(returncode)
            raise Unavailable(
                f"the data-plane worker (pid {process.pid}) did not start: {detail}; see its log"
            ) from exc
        worker.agent_name, worker.identity = agent_name, reply[2]
        logger.debug("data-plane worker %d ready (agent %s)", process.pid, agent_name)
        return worker

    async def close(self) -> None:
        """No more workers; end the spare."""
        self._closed = True
        if self._spare is not None:
            spare, self._spare = self._spare, None
            spare.cancel()
            with contextlib.suppress(BaseException):
                await (await spare).end()


def _kill_when_ready(task: asyncio.Task[WorkerProcess]) -> None:
    if not task.cancelled() and task.exception() is None:
        worker = task.result()
        worker.kill()
        worker.close_channel()
