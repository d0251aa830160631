"""The control process's handle on one data-plane worker incarnation (kvd.dataplane_protocol).

A :class:`DataPlane` is one worker process and its NIXL agent: its memory mappings, registrations,
prepared lists and posted READs are named by ids that mean something only to that worker. When
the worker dies (a crash, an OOM kill, or a hang this side ended with SIGKILL), the DataPlane is
**lost** for good: every call in flight and every later call fails :class:`Unavailable` naming
the cause, and every READ it had posted is settled as final with that error, once the process is
reaped (no byte can land through a dead process's endpoints). The daemon then starts a new
DataPlane with a new agent name and maps every engine again (kvd.core.daemon, docs/lifetimes.md).

**Threads.** Everything runs on the event loop, except :meth:`prepare_table`, called from the
daemon's thread pool as before (it blocks that thread on the worker's answer).

**Transfers.** A posted READ is an :class:`Xfer`; ``Xfer.final`` is the proof that no byte of
it can land any more: NIXL said DONE or ERR in the worker, or the worker is dead.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import itertools
import logging
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from kvd.core.fast_poll import FastPollTeller
from kvd.core.read_batches import READS_PER_CALL, ReadBatcher, StepReadBook, ignore_outcome
from kvd.core.step_reads import StepPart
from kvd.core.workers import WorkerLauncher, WorkerProcess, exit_reason
from kvd.dataplane_protocol import (
    CALL,
    LOCAL_AGENT,
    NOTIFS,
    REPLY,
    SETTLED,
    AgentIdentity,
    MappedRegion,
    NixlRegion,
    ReadOrder,
    RegionRequest,
    WireError,
    Xfer,
    XferState,
    decode_error,
    frame,
    read_frame,
)
from kvd_client.errors import KvdError, Unavailable

__all__ = ["LOCAL", "READS_PER_CALL", "AgentIdentity", "DataPlane", "NixlRegion", "Xfer", "XferState"]

logger = logging.getLogger(__name__)

LOCAL = LOCAL_AGENT
STACKS_GRACE_S = 0.2  # a hung worker gets this long to write its stacks to the log before its kill
DYING_GRACE_S = 0.1  # a worker that missed its heartbeat gets this long to show it is dying, not hung
DYING_POLL_S = 0.01
HEARTBEAT_S = 1.0  # how often the worker's NIXL thread is asked to answer (an idle daemon pays for each)
# A registration (or deregistration) is one NIXL call on the worker's NIXL thread, which answers
# no heartbeat meanwhile, and its time grows with the region: over RDMA UCX pins and maps every
# page (ibv_reg_mr; tens of GiB of host KV take seconds). While one is in flight the heartbeat
# waits longer by the region's size at this rate: a large engine registering is not a hang.
REGISTER_BYTES_PER_S = 1e9


class DataPlane:
    """One data-plane worker: its NIXL agent and its mappings of engine memory."""

    def __init__(
        self,
        *,
        launcher: WorkerLauncher,
        on_reads_in_flight: Callable[[int], None] = lambda _: None,
        heartbeat_timeout_s: float = 5.0,
        on_lost: Callable[[DataPlane, str], None] = lambda _plane, _reason: None,
        on_step_read: Callable[[int], None] = lambda _: None,
    ) -> None:
        self.name = ""  # the worker's NIXL agent, once started
        self._on_reads_in_flight = on_reads_in_flight
        self._launcher = launcher
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._on_lost = on_lost
        self._on_notifications: Callable[[dict[str, list[bytes]]], None] = lambda _: None
        self._worker: WorkerProcess | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count(1)
        self._xfer_ids = itertools.count(1)
        self._xfers: dict[int, Xfer] = {}
        # READs asked for during one turn of the event loop, posted together at its end (once started).
        self._batcher: ReadBatcher | None = None
        # The step READs in flight: each is settled by its own id, and settles the READs it carries.
        self._step_reads = StepReadBook(lambda: next(self._xfer_ids), on_step_read)
        self._identity = AgentIdentity(b"", ())
        self._tasks: list[asyncio.Task[None]] = []
        self._fast_poll = FastPollTeller(self._tell_fast_poll)
        # (De)registrations in flight: call token -> until when the heartbeat waits for them.
        self._registering: dict[object, float] = {}
        self._registered_bytes: dict[Any, int] = {}  # registration -> its size (for its deregistration)
        self.lost_reason = ""  # set once the worker is gone
        self._stopping = False
        self._reported = False

    # --- life cycle ---------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        return self._worker.pid if self._worker is not None else 0

    @property
    def alive(self) -> bool:
        return self._worker is not None and not self.lost_reason

    async def start(self, on_notifications: Callable[[dict[str, list[bytes]]], None]) -> None:
        """Take a worker (its NIXL agent already created) from the launcher and serve through it."""
        self._loop = asyncio.get_running_loop()
        self._batcher = ReadBatcher(self._loop, lambda op, *args: self._submit(op, *args), self._step_reads)
        self._on_notifications = on_notifications
        self._worker = await self._launcher.take()
        self.name = self._worker.agent_name  # the launcher names each incarnation (kvd.core.workers)
        self._identity = self._worker.identity
        self._tasks = [
            self._loop.create_task(self._read_loop(), name="kvd-dataplane-reader"),
            self._loop.create_task(self._heartbeat_loop(), name="kvd-dataplane-heartbeat"),
        ]
        logger.info("data-plane worker %d serves NIXL agent %s", self._worker.pid, self.name)

    async def stop(self) -> None:
        """End the worker: close its channel (it releases everything and exits), then reap it."""
        worker = self._worker
        if worker is None or self._stopping:
            return
        self._stopping = True
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        await worker.end()
        if self._xfers:
            logger.warning("%d NIXL reads were still in flight at shutdown", len(self._xfers))
        self._lose(self.lost_reason or "stopped")

    # --- the channel --------------------------------------------------------------------------

    def _gone(self) -> Unavailable:
        why = self.lost_reason or "not started"
        return Unavailable(
            f"the data-plane worker of agent {self.name} is gone ({why}): the data plane restarts; retry"
        )

    def _submit(self, op: str, *args: Any) -> asyncio.Future[Any]:
        assert self._loop is not None
        future: asyncio.Future[Any] = self._loop.create_future()
        if self.lost_reason or self._worker is None:
            future.set_exception(self._gone())
            return future
        call_id = next(self._call_ids)
        # frame() raises (nothing sent, nothing recorded) if the message cannot be framed.
        parts = frame((CALL, call_id, op, args))
        orders = self._worker.orders
        if op == "reads" and orders is not None:
            orders.writelines(parts)  # read by the worker's NIXL thread itself (kvd.worker.service)
        else:
            self._worker.writer.writelines(parts)
        self._calls[call_id] = future  # its reply is read on this loop, after this returns
        return future

    async def _call(self, op: str, *args: Any) -> Any:
        """Run ``op`` in the worker and wait for its answer (a cancel does not retract the call)."""
        future = self._submit(op, *args)
        future.add_done_callback(ignore_outcome)  # a cancelled waiter's call may still fail: not an unretrieved error
        return await asyncio.shield(future)

    async def _read_loop(self) -> None:
        assert self._worker is not None
        reader = self._worker.reader
        try:
            while True:
                message = await read_frame(reader)
                kind = message[0]
                if kind == REPLY:
                    self._reply(message[1], message[2], message[3])
                elif kind == SETTLED:
                    self._settle(message[1], XferState(message[2]), message[3])
                elif kind == NOTIFS:
                    self._on_notifications(message[1])
        except asyncio.CancelledError:
            raise
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass  # the worker is gone: reaped below
        except Exception:
            logger.exception("the data-plane channel of agent %s is corrupt: ending its worker", self.name)
            self._worker.kill()
        if self._stopping:
            return
        returncode = await self._worker.reap()
        self._lose(exit_reason(returncode))

    def _reply(self, call_id: int, value: Any, error: WireError | None) -> None:
        future = self._calls.pop(call_id, None)
        if future is None or future.done():
            return
        if error is not None:
            future.set_exception(decode_error(error))
        else:
            future.set_result(value)

    def _settle(self, xfer_id: int, state: XferState, error: WireError | None) -> None:
        carried = self._step_reads.settled(xfer_id)
        if carried:  # a step READ: every READ it carried is final with it
            for carried_id in carried:
                self._settle(carried_id, state, error)
            return
        xfer = self._xfers.pop(xfer_id, None)
        if xfer is None:
            return
        xfer.state = state
        if error is not None:
            xfer.error = decode_error(error)
        if not xfer.settled.done():
            xfer.settled.set_result(None)
        self._on_reads_in_flight(len(self._xfers))

    async def _heartbeat_loop(self) -> None:
        """Ask the worker's NIXL thread to answer every HEARTBEAT_S; no answer in time is a hang."""
        while not self.lost_reason:
            await asyncio.sleep(HEARTBEAT_S)
            if self.lost_reason or self._worker is None:
                return
            try:
                async with asyncio.timeout(self._heartbeat_timeout_s):
                    await self._call("ping")
            except TimeoutError:
                if await self._dying_after_all(self._worker):
                    # Not hung but dying (a crash; a kill whose exit outlasts the timeout: a big
                    # address space takes a while to tear down; a kill not yet acted on by a
                    # thread in an uninterruptible call): the reader reports it, with its real
                    # cause, once it is reaped.
                    return
                registering_until = max(self._registering.values(), default=0.0)
                if time.monotonic() < registering_until:
                    logger.warning(
                        "data-plane worker %d (agent %s) has not answered for %.1fs: it is registering memory "
                        "(given until %.0fs from now)",
                        self._worker.pid,
                        self.name,
                        self._heartbeat_timeout_s,
                        registering_until - time.monotonic(),
                    )
                    continue
                logger.error(
                    "data-plane worker %d (agent %s) did not answer within %.1fs: hung, killing it "
                    "(its threads' stacks follow)",
                    self._worker.pid,
                    self.name,
                    self._heartbeat_timeout_s,
                )
                self.lost_reason = "hung"
                worker = self._worker
                worker.dump_stacks()
                await asyncio.sleep(STACKS_GRACE_S)
                worker.kill()
                returncode = await worker.reap()
                if returncode != -signal.SIGKILL:  # it died of its own cause meanwhile
                    self.lost_reason = exit_reason(returncode)
                self._lose(self.lost_reason)
                return
            except KvdError:
                return  # lost: the reader reports it

    @staticmethod
    async def _dying_after_all(worker: WorkerProcess) -> bool:
        """Whether a worker that missed its heartbeat is dying rather than hung, looked at for up to
        DYING_GRACE_S: the kernel dequeues a SIGKILL before it marks the process exiting, and a
        process killed in that instant looks neither killed nor exiting (under load, for a while)."""
        deadline = time.monotonic() + DYING_GRACE_S
        while not worker.dying():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(DYING_POLL_S)
        return True

    def _lose(self, reason: str) -> None:
        """The worker is reaped: fail every call, settle every READ (final: the process is gone)."""
        self.lost_reason = self.lost_reason or reason
        error = self._gone()
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        self._calls.clear()
        for xfer in self._xfers.values():
            xfer.state = XferState.ERROR
            xfer.error = xfer.error or Unavailable(
                f"read from {xfer.peer} lost: the data-plane worker of agent {self.name} died ({self.lost_reason})"
            )
            if not xfer.settled.done():
                xfer.settled.set_result(None)
        self._xfers.clear()
        self._step_reads.clear()
        self._fast_poll.close()
        self._on_reads_in_flight(0)
        if self._worker is not None:
            self._worker.close_channel()  # reaped: its end of the channel is of no more use (an fd per loss)
        if self._reported or self._stopping:
            return
        self._reported = True
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        logger.error("data-plane worker of agent %s is gone: %s", self.name, self.lost_reason)
        self._on_lost(self, self.lost_reason)

    # --- identity -----------------------------------------------------------------------------

    def metadata(self) -> bytes:
        return self._identity.metadata

    def identity(self) -> AgentIdentity:
        """The agent's metadata and exactly the regions it names (one snapshot, no call)."""
        return self._identity

    @property
    def fast_poll_until(self) -> float:
        """The worker's fast-poll deadline, as it was last told (kvd.core.fast_poll)."""
        return self._fast_poll.told

    @fast_poll_until.setter
    def fast_poll_until(self, deadline: float) -> None:
        """Have the worker poll fast until ``deadline`` (0.0: none open), told only when it
        must be (kvd.core.fast_poll.FastPollTeller)."""
        self._fast_poll.want(deadline)

    def _tell_fast_poll(self, deadline: float) -> None:
        if self.alive:
            self._submit("fast_poll", deadline).add_done_callback(ignore_outcome)

    # --- memory -------------------------------------------------------------------------------

    async def open_regions(self, requests: Sequence[RegionRequest]) -> list[MappedRegion]:
        """Map the engine's regions in the worker (all or none)."""
        return list(await self._call("open_regions", tuple(requests)))

    async def close_regions(self, region_ids: Sequence[int], keep_readable_s: float = 0.0) -> None:
        """Drop the worker's mappings; with ``keep_readable_s``, host mappings are retired now and
        unmapped only that long after (kvd.worker.regions.Regions.close)."""
        if region_ids and self.alive:
            await self._call("close_regions", tuple(region_ids), keep_readable_s)

    async def duplicate_region(self, region_id: int) -> MappedRegion:
        """The same shared pages mapped again at a new address (a re-map; kvd.worker.vm)."""
        result: MappedRegion = await self._call("duplicate_region", region_id)
        return result

    async def retire_region(self, region_id: int) -> None:
        """Replace the mapping's pages with throw-away ones (host memory; VRAM: nothing)."""
        await self._call("retire_region", region_id)

    async def open_staging(self, size: int, device: str) -> MappedRegion:
        result: MappedRegion = await self._call("open_staging", size, device)
        return result

    async def convert(
        self, postprocess: Any, staging_region: int, offset: int, size: int, engine_regions: Sequence[int]
    ) -> None:
        """Run a pull's conversion in the worker: staging bytes into the engine's blocks."""
        await self._call("convert", postprocess, staging_region, offset, size, tuple(engine_regions))

    async def register(self, address: int, size: int, device_index: int, mem_type: str) -> Any:
        with self._registration_in_flight(size):
            registration, self._identity = await self._call("register", address, size, device_index, mem_type)
        self._registered_bytes[registration] = size
        return registration

    async def deregister(self, registration: Any) -> None:
        if self.alive:
            with self._registration_in_flight(self._registered_bytes.get(registration, 0)):
                self._identity = await self._call("deregister", registration)
            self._registered_bytes.pop(registration, None)

    @contextlib.contextmanager
    def _registration_in_flight(self, size: int) -> Iterator[None]:
        """While the worker (de)registers ``size`` bytes, a heartbeat unanswered for up to
        REGISTER_BYTES_PER_S's time for them more is not a hang (see _heartbeat_loop)."""
        token = object()
        self._registering[token] = time.monotonic() + self._heartbeat_timeout_s + size / REGISTER_BYTES_PER_S
        try:
            yield
        finally:
            del self._registering[token]

    # --- peers --------------------------------------------------------------------------------

    async def add_remote(self, metadata: bytes) -> str:
        name: str = await self._call("add_remote", metadata)
        return name

    async def remove_remote(self, agent_name: str, tables: Sequence[Any]) -> None:
        if self.alive:
            await self._call("remove_remote", agent_name, tuple(tables))

    # --- tables -------------------------------------------------------------------------------

    def prepare_table(self, agent_name: str, rows: np.ndarray, mem_type: str) -> Any:
        """Prepare a descriptor list in the worker (blocking: call it from a pool thread)."""
        loop = self._loop
        if loop is None:
            raise Unavailable("the data plane is not started")
        rows = np.ascontiguousarray(rows)
        future = asyncio.run_coroutine_threadsafe(self._call("prepare_table", agent_name, rows, mem_type), loop)
        try:
            return future.result()
        except concurrent.futures.CancelledError as exc:
            raise Unavailable("the data plane stopped while a list was prepared") from exc

    async def release_tables(self, tables: Sequence[Any]) -> None:
        if tables and self.alive:
            await self._call("release_tables", tuple(tables))

    # --- transfers ----------------------------------------------------------------------------

    def read(
        self,
        local_table: Any,
        local_indices: np.ndarray,
        remote_table: Any,
        remote_indices: np.ndarray,
        notif: bytes,
        peer: str,
        nbytes: int,
        step: StepPart | None = None,
    ) -> asyncio.Future[Xfer]:
        """Queue a READ (sent at the end of this loop turn, or at :meth:`flush_reads`); the future
        is its Xfer once the worker answered the post, or raises if NIXL refused to build it
        (nothing was posted). Not a coroutine: the READ is queued when this returns, so StartPulls
        queues a step's READs before any of its pulls' tasks runs (kvd.core.start_posts).

        A READ NIXL built but failed to post (wholly or in part) has ``error`` set: part of it may
        be on its way, so it is polled to a final state like any other. With ``step``, it may go
        within a step READ with others of this loop turn (:mod:`kvd.core.step_reads`; ``notif`` is
        then ``step.notification`` encoded alone): it gets that READ's outcome, final when it is.
        """
        assert self._loop is not None and self._batcher is not None
        xfer_id = next(self._xfer_ids)
        xfer = Xfer(xfer_id, peer, nbytes, 0.0, self._loop.create_future())
        self._xfers[xfer_id] = xfer  # before the call: the worker may settle it right after posting
        local_indices = np.ascontiguousarray(local_indices, dtype=np.int32)
        remote_indices = np.ascontiguousarray(remote_indices, dtype=np.int32)
        order = ReadOrder(xfer_id, local_table, local_indices, remote_table, remote_indices, notif, peer, nbytes)
        post = self._batcher.post(order, step)
        posted: asyncio.Future[Xfer] = self._loop.create_future()
        post.add_done_callback(functools.partial(self._answered, xfer, posted))
        return posted

    def _answered(self, xfer: Xfer, posted: asyncio.Future[Xfer], post: asyncio.Future[Any]) -> None:
        """The worker answered a READ's post (or could not be asked): its Xfer, or why nothing was posted."""
        if posted.done():
            return
        if post.cancelled():
            posted.cancel()
            return
        error = post.exception()
        if error is not None:
            if isinstance(error, KvdError):
                if xfer.final:  # the worker died with it posted or not: its death is the fence
                    posted.set_result(xfer)
                    return
                self._xfers.pop(xfer.handle, None)  # nothing was posted
            posted.set_exception(error)
            return
        state, wire_error = post.result()
        if state == XferState.DONE.value:
            self._settle(xfer.handle, XferState.DONE, wire_error)  # finished within the post: no SETTLED follows
        else:
            if wire_error is not None and xfer.error is None:
                xfer.error = decode_error(wire_error)
            self._on_reads_in_flight(len(self._xfers))
        posted.set_result(xfer)

    def flush_reads(self) -> None:
        """Send the READs queued so far now, not at the end of this loop turn."""
        if self._batcher is not None:
            self._batcher.flush()

    async def wait(self, xfers: Sequence[Xfer]) -> None:
        """Wait until every read is final; raise the first error. Cancelling the wait leaves the
        reads running: check ``Xfer.final`` before letting anything reuse their destination."""
        for xfer in xfers:
            await asyncio.shield(xfer.settled)
            if xfer.error is not None:
                raise xfer.error

    def in_flight(self) -> int:
        """Reads posted and not yet final."""
        return len(self._xfers)

    async def ping(self) -> float:
        """Round trip to the worker's NIXL thread, in seconds."""
        started = time.monotonic()
        await self._call("ping")
        return time.monotonic() - started
