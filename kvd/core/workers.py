"""Data-plane worker processes: started, kept one spare, connected, and ended.

A worker (``python -m kvd.worker``) takes about 1.5 s to import torch and NIXL, and half a second
more to create its NIXL agent (UCX's initialisation); a restart after a crash must serve again
well under a second. So the launcher keeps one **spare** worker that has imported everything and
already created its agent, under the name the next incarnation will have (``<base>-r<N>``): a
restart promotes the spare in milliseconds, and a new spare starts in the background.

A spare is watched while it waits: one that dies idle (or is killed while it starts) is replaced
in the background, after a back-off that doubles while spares keep dying, and it is never a
serving worker's loss (the daemon counts only those). A spare found dead or dying when a worker
is needed is passed over for a fresh one. A worker that cannot start (its exec fails, it exits
or crashes before it is ready, NIXL refuses its agent, it is not ready within HELLO_TIMEOUT_S)
raises :class:`WorkerStartFailed`; one killed from outside while it started (SIGKILL: an operator,
the OOM killer) says so (``killed``), since that says nothing about the next one.

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
    STACKS_SIGNAL,
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
# Signals that end a starting worker from outside (an operator, the OOM killer, a test): a start
# they cut short says nothing about the next one. Any other end (an exit status, SIGSEGV, SIGABRT)
# is the worker's own failure to start, and the next one would fail alike.
EXTERNAL_SIGNALS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP})


def backoff_delay(losses_in_a_row: int, first_s: float, max_s: float) -> float:
    """The wait before replacing the ``losses_in_a_row``-th worker lost in a row: none for the
    first (a single loss is replaced at once), then ``first_s``, doubling, at most ``max_s``."""
    if losses_in_a_row <= 1:
        return 0.0
    return min(max_s, first_s * 2.0 ** min(losses_in_a_row - 2, 64))  # (no overflow after many losses)


class WorkerStartFailed(Unavailable):
    """A data-plane worker did not become ready. ``killed``: a signal from outside ended it while
    it started (see EXTERNAL_SIGNALS); otherwise it cannot start, and neither would another."""

    def __init__(self, message: str, killed: bool = False) -> None:
        super().__init__(message)
        self.killed = killed


@dataclasses.dataclass(eq=False)
class WorkerProcess:
    """One worker process and the control process's end of its channel."""

    process: asyncio.subprocess.Process
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    agent_name: str = ""
    identity: AgentIdentity = AgentIdentity(b"", ())
    # READ orders, on a socket of their own that the worker's NIXL thread reads (None: on the channel).
    orders: asyncio.WriteTransport | None = None
    # Seen ending once (see gone()): the kernel dequeues a SIGKILL before it marks the process
    # exiting, so between the two it looks neither killed nor exiting; being doomed is for good.
    doomed: bool = False

    @property
    def exited(self) -> bool:
        return self.process.returncode is not None

    @property
    def pid(self) -> int:
        return self.process.pid

    def kill(self) -> None:
        """SIGKILL it, leaving the reaping to asyncio's child watcher. Never through
        ``Process.kill``: its ``Popen.send_signal`` first polls, which reaps a process that has
        just died behind the watcher's back, and the watcher then reports exit 255 instead of
        how it died (a worker killed while it started would pass for one that cannot start)."""
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def dump_stacks(self) -> None:
        """Have it write every thread's stack to its log (its faulthandler; before a hang's kill)."""
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, STACKS_SIGNAL)

    def gone(self) -> bool:
        """Whether the process has ended or is ending (reaped, a zombie, exiting, a SIGKILL
        pending): a spare in this state must not be handed out. Once True, True for good (a
        spare seen dying was handed out, under load, in the instant after its SIGKILL was
        dequeued and before the kernel marked it exiting)."""
        return self.dying()  # exiting() counts a process reaped, or gone from /proc, as ending

    def _stat(self) -> list[str] | None:
        """The fields of ``/proc/<pid>/stat`` after the command name (state first); None once gone."""
        try:
            return Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return None

    def exiting(self) -> bool:
        """Whether the process is already on its way out (the kernel's PF_EXITING, or gone).

        Gone from ``/proc`` is gone: a child's pid is not reused before its parent reaps it, and
        asyncio's watcher thread reaps it before the event loop hears the exit status (in between,
        ``exited`` is still False: under load a heartbeat's timeout can run in that instant)."""
        fields = self._stat()
        if not fields:
            return self.exited or not Path(f"/proc/{self.pid}").exists()
        return fields[0] in ("Z", "X") or bool(int(fields[6]) & PF_EXITING)

    def dying(self) -> bool:
        """Whether the process is exiting, or a SIGKILL already waits for it.

        A SIGKILL sent while a thread sits in an uninterruptible kernel call (a page fault on
        shared memory, a CMA copy) is acted on only when the call returns, seconds later under
        load: until then the process is neither exiting nor answering. It was killed, not hung,
        and the reader reports it with that cause once it is reaped. Once True, True for good
        (``doomed``)."""
        if not self.doomed:
            self.doomed = self.exiting() or self.kill_pending()
        return self.doomed

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
        if self.orders is not None:
            self.orders.close()


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
        respawn_backoff_s: float = 0.25,
        respawn_backoff_max_s: float = 4.0,
        orders_socket: bool = True,
    ) -> None:
        self._agent_base = agent_base
        self._orders_socket = orders_socket
        self._copying = CopySettings(max_post_bytes, copy_threads, parallel_read_min_bytes)
        self._backends = backends
        self._progress_thread = progress_thread
        self._log_level = log_level
        self._switch_interval_s = switch_interval_s
        self._prefault = prefault
        self._spare_wanted = spare
        self._spare: asyncio.Task[WorkerProcess] | None = None
        self._spare_due = 0.0  # when the spare's start begins (monotonic; later while it backs off)
        self._spare_watch: asyncio.Task[None] | None = None
        self._respawn_backoff_s = respawn_backoff_s
        self._respawn_backoff_max_s = respawn_backoff_max_s
        self.spares_lost = 0  # spares that died idle or were killed while they started (never served)
        self._spares_lost_in_a_row = 0
        self._closed = False
        self.started = 0

    async def take(self) -> WorkerProcess:
        """A worker whose NIXL agent is created (the spare, else a new one); starts the next spare.

        Raises :class:`WorkerStartFailed` if the worker it waits for does not start."""
        if self._closed:
            raise Unavailable("the daemon is shutting down: no data-plane worker is started")
        task, self._spare = self._spare, None
        if self._spare_watch is not None:
            self._spare_watch.cancel()  # it is ours now: its end is the caller's to see
            self._spare_watch = None
        if task is not None and not task.done() and time.monotonic() < self._spare_due:
            task.cancel()  # a replacement spare still backing off: a worker is needed now
            task = None
        elif task is not None and task.done():
            if self._usable(task):
                self._spares_lost_in_a_row = 0
            else:
                task = None
        if task is None:
            task = self._launch()
        # A ready spare is replaced at once. A worker still starting (the daemon's first, or no spare
        # was ready) starts alone, and its spare after it: two imports side by side on two cores made
        # the serving worker, and so the daemon's readiness, wait for the spare's CPU too.
        starting = not task.done()
        if self._spare_wanted and not starting:
            self._keep_spare()
        try:
            worker = await asyncio.shield(task)
        except BaseException:
            if not task.done():
                task.add_done_callback(_kill_when_ready)
            raise
        if self._spare_wanted and starting and self._spare is None and not self._closed:
            self._keep_spare()
        return worker

    @staticmethod
    def _usable(task: asyncio.Task[WorkerProcess]) -> bool:
        """Whether a started spare can serve: it started and has not died (or begun to) since."""
        if task.cancelled():
            return False
        error = task.exception()
        if error is not None:
            logger.warning("the spare data-plane worker did not start (%s): starting a fresh one", error)
            return False
        worker = task.result()
        if worker.gone():
            logger.warning(
                "the spare data-plane worker %d died while idle (%s): starting a fresh one",
                worker.pid,
                exit_reason(worker.process.returncode) if worker.exited else worker.kernel_state(),
            )
            worker.kill()
            worker.close_channel()
            return False
        return True

    def _keep_spare(self, delay_s: float = 0.0) -> None:
        """Start the next spare (after ``delay_s``) and watch it until it is taken."""
        self._spare_due = time.monotonic() + delay_s
        spare = self._spare = self._launch(delay_s)
        self._spare_watch = asyncio.get_running_loop().create_task(self._watch_spare(spare), name="kvd-worker-spare")

    async def _watch_spare(self, spare: asyncio.Task[WorkerProcess]) -> None:
        """Replace the spare if it dies idle or is killed while it starts; cancelled when taken.

        A spare that cannot start is left as it is: the next worker needed starts afresh, and
        its failure is the daemon's to judge (a daemon whose workers cannot start exits)."""
        try:
            worker = await asyncio.shield(spare)
        except asyncio.CancelledError:
            if not spare.cancelled():
                raise  # this watch was cancelled (taken, closed): nothing to do
            return
        except WorkerStartFailed as exc:
            if not exc.killed:
                logger.error("the spare data-plane worker cannot start: %s", exc.message)
                return
            why = exc.message
        else:
            why = exit_reason(await worker.process.wait())
            worker.close_channel()
        if self._spare is not spare or self._closed:
            return
        self.spares_lost += 1
        self._spares_lost_in_a_row += 1
        delay = backoff_delay(self._spares_lost_in_a_row, self._respawn_backoff_s, self._respawn_backoff_max_s)
        logger.warning(
            "the spare data-plane worker was lost before it served (%s): another starts in %.2fs (not a restart)",
            why,
            delay,
        )
        self._keep_spare(delay)

    def reserve_name(self) -> str:
        """The NIXL agent name of the next worker: ``<base>``, then ``<base>-r1``, ``<base>-r2``…
        (never reused: a peer that loaded one agent must never mistake another for it)."""
        name = self._agent_base if self.started == 0 else f"{self._agent_base}-r{self.started}"
        self.started += 1
        return name

    def _launch(self, delay_s: float = 0.0) -> asyncio.Task[WorkerProcess]:
        return asyncio.get_running_loop().create_task(
            self._spawn(self.reserve_name(), delay_s), name="kvd-worker-spawn"
        )

    async def _spawn(self, agent_name: str, delay_s: float = 0.0) -> WorkerProcess:
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        orders_ours, orders_theirs = (
            socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM) if self._orders_socket else (None, None)
        )
        passed = (theirs.fileno(),) if orders_theirs is None else (theirs.fileno(), orders_theirs.fileno())
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
                *(() if orders_theirs is None else ("--orders-fd", str(orders_theirs.fileno()))),
                pass_fds=passed,
                stdin=asyncio.subprocess.DEVNULL,
                # The binary this process runs, whatever path led to it: a daemon started as a
                # service user may not traverse the directories sys.executable names (argv[0]
                # stays sys.executable, so the worker finds the same virtual environment).
                executable="/proc/self/exe",
            )
        except OSError as exc:
            ours.close()
            if orders_ours is not None:
                orders_ours.close()
            raise WorkerStartFailed(f"the data-plane worker could not be started: {exc}") from exc
        finally:
            theirs.close()
            if orders_theirs is not None:
                orders_theirs.close()
        try:
            reader, writer = await asyncio.open_connection(sock=ours, limit=1 << 24)
        except BaseException as exc:
            # No transport owns either of our ends yet, and no WorkerProcess the process: end
            # both here, as the failures below do through the worker.
            ours.close()
            if orders_ours is not None:
                orders_ours.close()
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)
            await asyncio.shield(process.wait())
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise WorkerStartFailed(
                f"the data-plane worker (pid {process.pid}) did not start: its sockets could not be set up ({exc})"
            ) from exc
        worker = WorkerProcess(process, reader, writer)
        try:
            if orders_ours is not None:
                # Written only (the worker answers on the channel); its end is the channel's.
                try:
                    worker.orders, _ = await asyncio.get_running_loop().create_unix_connection(
                        asyncio.Protocol, sock=orders_ours
                    )
                except BaseException:
                    orders_ours.close()  # no transport owns it yet
                    raise
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
            died = isinstance(exc, (asyncio.IncompleteReadError, ConnectionError))  # its channel closed
            worker.kill()
            worker.close_channel()
            returncode = await worker.reap()
            if isinstance(exc, asyncio.CancelledError):
                raise
            if isinstance(exc, KvdError):
                detail = exc.message
            elif isinstance(exc, TimeoutError):
                detail = f"not ready within {HELLO_TIMEOUT_S:.0f}s"
            elif isinstance(exc, OSError) and not died:  # ours, not the worker's: say what failed
                detail = f"its sockets could not be set up ({exc})"
            else:
                detail = exit_reason(returncode)
            killed = died and returncode < 0 and -returncode in EXTERNAL_SIGNALS
            raise WorkerStartFailed(
                f"the data-plane worker (pid {process.pid}) did not start: {detail}; see its log", killed=killed
            ) from exc
        worker.agent_name, worker.identity = agent_name, reply[2]
        logger.debug("data-plane worker %d ready (agent %s)", process.pid, agent_name)
        return worker

    async def close(self) -> None:
        """No more workers; end the spare."""
        self._closed = True
        if self._spare_watch is not None:
            watch, self._spare_watch = self._spare_watch, None
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
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
