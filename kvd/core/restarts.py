"""Replacing a lost data-plane worker: the daemon's side of docs/lifetimes.md, "A lost data-plane worker".

One part of the daemon (:class:`kvd.core.daemon.Daemon` composes it): :class:`Restarts` owns the
data-plane worker now serving (``dataplane``), the launcher that starts workers, and everything
about replacing a lost one. The DataPlane reports its worker lost (reaped) through
:meth:`Restarts.lost`; a new worker (the launcher's spare) is started, the daemon's other parts
are rebound to it (``rebind``), and every registered rank is mapped again.

**A crash loop backs off; it does not end the daemon** (as a pre-fork server's arbiter respawns
workers that crash at run time): the first loss after a worker served ``dataplane_restart_stable_s``
is replaced at once, each further loss in a row waits longer (:class:`RestartBackoff`), and the
engines keep their registrations, streams and holds throughout. From a loss until its replacement
has mapped every rank again no worker serves: ``dataplane_serving`` is False (health NOT_SERVING,
``kvd_dataplane_serving`` 0) and work that needs the data plane is refused UNAVAILABLE. The daemon
gives up only when a new worker cannot start at all (``fatal`` is set, ``kvd serve`` exits 70); a
worker killed from outside while it starts is one more loss. Event-loop only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from kvd.core.context import CoreContext
from kvd.core.dataplane import DataPlane
from kvd.core.leases import Admission, AdmissionEnd
from kvd.core.local_memory import LocalMemory, Memories, MemoryState
from kvd.core.registry import EngineRank, next_registration_id
from kvd.core.workers import WorkerLauncher, WorkerStartFailed, backoff_delay
from kvd_client.errors import KvdError, Unavailable

logger = logging.getLogger(__name__)


class RestartBackoff:
    """How long a lost worker's replacement waits: nothing after stable serving, then
    ``first_s``, doubling with each loss in a row, at most ``max_s``. A worker that served
    ``stable_s`` ends the run of losses."""

    def __init__(self, first_s: float, max_s: float, stable_s: float) -> None:
        self.first_s, self.max_s, self.stable_s = first_s, max_s, stable_s
        self.losses_in_a_row = 0
        self.serving_since: float | None = None  # when the worker now serving began to (monotonic)
        self.delay_s = 0.0  # the last wait chosen

    def lost(self, now: float) -> float:
        """A worker was lost (or a new one killed while it started) at ``now``: the wait before
        the next one starts."""
        if self.serving_since is not None and now - self.serving_since >= self.stable_s:
            self.losses_in_a_row = 0
        self.serving_since = None
        self.losses_in_a_row += 1
        self.delay_s = backoff_delay(self.losses_in_a_row, self.first_s, self.max_s)
        return self.delay_s

    def serving(self, now: float) -> None:
        """A worker serves from ``now`` (started, every rank mapped)."""
        if self.serving_since is None:
            self.serving_since = now


class Restarts:
    """The data-plane worker now serving, and its replacement when it is lost (module docstring).

    Owns ``dataplane`` (the handle every other part reaches through a getter, since a restart
    replaces it), the worker launcher, the back-off, the restart under way, the counts and
    reason GetStatus shows, ``serving`` (a worker serves: health follows it) and ``fatal``.
    Event-loop only.
    """

    def __init__(
        self,
        ctx: CoreContext,
        *,
        agent_base: str,
        on_notifications: Callable[[dict[str, list[bytes]]], None],
        rebind: Callable[[DataPlane], None],
        prepare_tables: Callable[[EngineRank], Awaitable[None]],
        unregister: Callable[[EngineRank, str], Awaitable[None]],
        daemon_serving: Callable[[], bool],
        stop_serving: Callable[[], None],
    ) -> None:
        self.config = config = ctx.config
        self.metrics = ctx.metrics
        self.registry = ctx.registry
        self.leases = ctx.leases
        self._agent_base = agent_base
        self._on_notifications = on_notifications  # the holder's: READ notifications from readers
        self._memories = ctx.memories
        self._rebind = rebind  # the daemon's other parts that hold the worker (memories, peers, puller)
        self._prepare_tables = prepare_tables
        self._unregister = unregister
        self._daemon_serving = daemon_serving
        self._stop_serving = stop_serving
        self.dataplane: DataPlane | None = None
        self.launcher: WorkerLauncher | None = None
        self.backoff = RestartBackoff(
            config.dataplane_restart_backoff_s,
            config.dataplane_restart_backoff_max_s,
            config.dataplane_restart_stable_s,
        )
        self.restarting: asyncio.Task[None] | None = None
        self.restarts = 0
        self.last_restart = ""  # why the last worker was replaced ("" if never)
        self.serving = False  # a worker serves (started, every rank mapped): health follows it
        self.on_serving: Callable[[], None] = lambda: None  # called when ``serving`` changes (kvd.server.app)
        self.fatal: asyncio.Future[str] | None = None  # set with the reason when the daemon must exit

    def new_dataplane(self) -> DataPlane:
        assert self.launcher is not None
        return DataPlane(
            on_reads_in_flight=self.metrics.nixl_reads_in_flight.set,
            on_step_read=self.metrics.step_read_reads.observe,
            launcher=self.launcher,
            heartbeat_timeout_s=self.config.dataplane_heartbeat_timeout_s,
            on_lost=self.lost,
        )

    async def start(self) -> DataPlane:
        """Start the launcher and the daemon's first worker (it serves once every part is bound)."""
        config = self.config
        self.fatal = asyncio.get_running_loop().create_future()
        self.launcher = WorkerLauncher(
            self._agent_base,
            tuple(config.nixl_backends),
            config.nixl_progress_thread,
            config.log_level,
            config.gil_switch_interval_s,
            spare=config.dataplane_spare_worker,
            prefault=config.prefault_host_memory,
            max_post_bytes=config.dataplane_max_post_bytes,
            copy_threads=config.copy_threads,
            parallel_read_min_bytes=config.dataplane_parallel_read_min_bytes,
            respawn_backoff_s=config.dataplane_restart_backoff_s,
            respawn_backoff_max_s=config.dataplane_restart_backoff_max_s,
            orders_socket=config.dataplane_orders_socket,
        )
        dataplane = self.new_dataplane()
        try:
            await dataplane.start(self._on_notifications)
        except BaseException:
            await self.launcher.close()
            raise
        self.dataplane = dataplane
        return dataplane

    async def stop(self) -> None:
        """At shutdown, after every other part: end a restart under way, the worker, the launcher."""
        if self.restarting is not None:
            self.restarting.cancel()
            await asyncio.gather(self.restarting, return_exceptions=True)
        if self.dataplane is not None:
            await self.dataplane.stop()
        if self.launcher is not None:
            await self.launcher.close()

    def require_dataplane(self) -> None:
        """Refuse work that needs the data plane while a lost worker is being replaced."""
        if self.dataplane is None:
            raise Unavailable("the daemon is still starting")
        if self.restarting is not None or not self.dataplane.alive:
            why = self.last_restart or "gone"
            raise Unavailable(f"the daemon's data plane is restarting (its worker was lost: {why}): retry in a moment")

    def serves(self, serving: bool) -> None:
        """Whether a worker serves now: the gauge, the back-off's stable period, health (through
        ``on_serving``)."""
        if serving:
            self.backoff.serving(time.monotonic())
        if serving == self.serving:
            return
        self.serving = serving
        self.metrics.dataplane_serving.set(int(serving))
        self.on_serving()

    def lost(self, plane: DataPlane, reason: str) -> None:
        """DataPlane callback: its worker is gone (reaped). Replace it, unless shutting down."""
        if plane is not self.dataplane or not self._daemon_serving() or self.restarting is not None:
            return
        self.metrics.dataplane_restarts.labels(reason).inc()
        self.restarts += 1
        self.last_restart = reason
        self.serves(False)
        delay = self.backoff.lost(time.monotonic())
        self.restarting = asyncio.get_running_loop().create_task(
            self._restart(reason, delay), name="kvd-dataplane-restart"
        )

    def _give_up(self, why: str) -> None:
        logger.critical("%s: the daemon exits", why)
        self._stop_serving()
        self.serves(False)
        if self.fatal is not None and not self.fatal.done():
            self.fatal.set_result(why)

    async def _restart(self, reason: str, delay_s: float) -> None:
        """Start a new worker (after ``delay_s``, the back-off), map every registered engine
        again, serve again (docs/lifetimes.md)."""
        started = time.monotonic()
        lost = self.dataplane
        try:
            for rank in self.registry:
                Memories.lose(rank.memory)
            self._end_reads_of_lost_memory()
            if delay_s > 0:
                logger.warning(
                    "the data-plane worker was lost %d times in a row (last: %s): its replacement starts in %.2fs",
                    self.backoff.losses_in_a_row,
                    reason,
                    delay_s,
                )
                await asyncio.sleep(delay_s)
            plane = await self._start_replacement(reason)
            if plane is None:
                return
            self.dataplane = plane
            self._rebind(plane)
            if plane.alive:
                plane.fast_poll_until = self.leases.latest_admission_deadline()
            for rank in list(self.registry):
                if not plane.alive:
                    break  # the new worker died too: the restart below maps every rank
                await self._remap_rank(rank)
        finally:
            self.restarting = None
        if plane.alive:
            self.serves(True)
        logger.warning(
            "data plane restarted in %.0f ms after its worker (agent %s) was lost (%s): agent %s, pid %d, "
            "%d engine ranks mapped again",
            (time.monotonic() - started) * 1000,
            lost.name if lost is not None else "?",
            reason,
            plane.name,
            plane.pid,
            len(self.registry),
        )
        if not plane.alive and plane.lost_reason:
            # Lost while it was being set up, when its loss was not acted on: replace it too
            # (else the daemon would keep a dead data plane and refuse every pull for good).
            self.lost(plane, plane.lost_reason)

    def _end_reads_of_lost_memory(self) -> None:
        """Reads admitted out of host memory the lost worker mapped are over: nothing can be read
        out of a dead process (its endpoints, registrations and mappings are gone). VRAM is the
        exception (a reader's CUDA IPC copy reads the engine's memory itself): those admissions
        end by the usual rules (docs/lifetimes.md, "A lost data-plane worker")."""

        def lost_host_memory(admission: Admission) -> bool:
            return bool(admission.pinned) and all(
                isinstance(memory, LocalMemory) and memory.state is MemoryState.LOST and memory.host
                for memory in admission.pinned
            )

        ended = self.leases.end_admissions_if(lost_host_memory, AdmissionEnd.WORKER_LOST)
        if ended:
            logger.info("%d reads admitted out of the lost worker's host memory ended", ended)

    async def _start_replacement(self, reason: str) -> DataPlane | None:
        """A new worker (the spare, else a fresh one); None once the daemon gave up: a worker
        that cannot start ends the daemon, one killed while it started is one more loss."""
        while True:
            plane = self.new_dataplane()
            try:
                await plane.start(self._on_notifications)
                return plane
            except WorkerStartFailed as exc:
                if not exc.killed:
                    self._give_up(f"a new data-plane worker cannot start (the last was lost: {reason}): {exc.message}")
                    return None
                delay = self.backoff.lost(time.monotonic())
                logger.warning(
                    "a new data-plane worker was killed while it started (%s): another starts in %.2fs",
                    exc.message,
                    delay,
                )
                await asyncio.sleep(delay)
            except KvdError as exc:
                self._give_up(f"a new data-plane worker cannot start (the last was lost: {reason}): {exc.message}")
                return None

    async def _remap_rank(self, rank: EngineRank) -> None:
        """Map a registered rank's memory in the new worker (the engine does nothing)."""
        requests = [region.request for region in rank.memory.regions]
        try:
            # Cancelled only by shutdown, which stops this worker next: nothing of it outlives that.
            memory = await self._memories().open(requests, next_registration_id(), to_the_end=False)
        except KvdError as exc:
            if self.dataplane is not None and not self.dataplane.alive:
                return  # its worker died too: the rank stays registered for the next restart to map
            logger.error(
                "engine %s rank %d: its memory cannot be mapped again after the data-plane restart: %s",
                rank.engine_id,
                rank.tp_rank,
                exc.message,
            )
            await self._unregister(rank, f"memory lost in a data-plane restart: {exc.message}")
            return
        if self.registry.current(rank) is not rank:  # unregistered meanwhile
            await self._memories().fence(memory)
            return
        rank.memory = memory
        self.metrics.registered_bytes.labels(rank.engine_id, str(rank.tp_rank)).set(rank.registered_bytes)
        try:
            await self._prepare_tables(rank)
        except KvdError as exc:
            if self.dataplane is not None and not self.dataplane.alive:
                return  # its worker died meanwhile: the next restart maps the rank again
            logger.error(
                "engine %s rank %d: its lists cannot be prepared again after the data-plane restart: %s",
                rank.engine_id,
                rank.tp_rank,
                exc.message,
            )
            await self._unregister(rank, f"lists lost in a data-plane restart: {exc.message}")
