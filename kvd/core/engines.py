"""This daemon's engines: their registrations, their engine streams, their liveness.

One part of the daemon (:class:`kvd.core.daemon.Daemon` composes it and forwards the
EngineService calls to it). :class:`Engines` maps an engine rank's memory (through
:class:`~kvd.core.local_memory.Memories`, in the data-plane worker) and adds it to the
:class:`~kvd.core.registry.Registry`; :meth:`Engines.unregister` fences a rank at once and lets
its memory go when nothing can touch it any more (docs/lifetimes.md); the engine stream's
attach, commits and post-forward signals land here; :meth:`Engines.watch_liveness` unregisters a
rank whose engine process exited without saying so. It owns the liveness watch; the tables it
shares with the other parts (registry, leases, commits, transfers) come in explicitly, and what
a data-plane restart replaces through getters. Event-loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Sequence

from kvd.core.context import CoreContext
from kvd.core.finishing import Finishing
from kvd.core.leases import LeaseEnd
from kvd.core.memory import RegionRequest
from kvd.core.registry import EngineRank, next_registration_id
from kvd.layout import groups as kv_groups
from kvd.layout.plan import EngineView, block_geometry
from kvd.layout.spec import LayerPlacement, LayoutSpec
from kvd_client.errors import Internal, InvalidArgument, KvdError, Unavailable

logger = logging.getLogger(__name__)

# What an engine's UnregisterKvCache waits beyond fence_timeout_s for its memory to be let go: a
# pull's fence may end in a re-map and retire (worker calls), and a peer's admitted read ends at
# its notification. Past it the call answers anyway (Engines.unregister_engine).
UNREGISTER_WAIT_MARGIN_S = 5.0

LIVENESS_S = 0.25  # how often an engine pid without a pidfd is checked (a kill is noticed within this)


class Engines:
    """The engine ranks registered here (module docstring)."""

    def __init__(self, ctx: CoreContext) -> None:
        self.config = ctx.config
        self.metrics = ctx.metrics
        self.registry = ctx.registry
        self.leases = ctx.leases
        self.commits = ctx.commits
        self.transfers = ctx.transfers
        self._executor = ctx.executor
        self._dataplane = ctx.dataplane
        self._memories = ctx.memories
        self._require_serving = ctx.require_serving
        self._require_dataplane = ctx.require_dataplane
        self._loop = ctx.loop
        self._liveness_now = asyncio.Event()  # an engine registered with a pid, or one exited
        # A registration runs to its end even if its caller is cancelled, and is then undone.
        self.finishing = Finishing("engine registration")

    async def register(
        self,
        engine_id: str,
        spec: LayoutSpec,
        regions: Sequence[RegionRequest],
        placements: Sequence[LayerPlacement],
        require_commits: bool = False,
        engine_pid: int = 0,
        extra_groups: Sequence[EngineView] = (),
    ) -> EngineRank:
        """Map the engine's memory (zero copy) and register it with NIXL. All or nothing.

        ``extra_groups``: a hybrid model's KV cache groups after group 0 (``spec`` and
        ``placements``), each over the same regions (vLLM overlays groups on one allocation).
        A caller cancelled meanwhile (its client gave up) leaves it to finish, then it is undone:
        a registration nobody was told of does not stay (the engine's retry registers anew).
        """
        return await self.finishing.run(
            self._register(engine_id, spec, regions, placements, require_commits, engine_pid, extra_groups),
            abandoned=self._undo_abandoned,
        )

    def _undo_abandoned(self, rank: EngineRank) -> None:
        self.finishing.start(self.unregister(rank, "its registration's caller gave up before it finished"))

    async def _register(
        self,
        engine_id: str,
        spec: LayoutSpec,
        regions: Sequence[RegionRequest],
        placements: Sequence[LayerPlacement],
        require_commits: bool,
        engine_pid: int,
        extra_groups: Sequence[EngineView],
    ) -> EngineRank:
        self._require_serving()
        if not regions:
            raise InvalidArgument("a registration needs at least one memory region")
        if len({region.kind for region in regions}) != 1:
            raise InvalidArgument("all regions of one engine rank must be of one memory kind")
        groups = (EngineView(spec, tuple(placements)), *extra_groups)
        kv_groups.validate_groups(groups)
        self.registry.check_can_add(engine_id, spec, tuple(extra_groups))
        sizes = [region.size_bytes for region in regions]
        for index, group in enumerate(groups):
            try:
                group.spec.validate_placements(group.placements, sizes)
            except InvalidArgument as exc:
                raise InvalidArgument(
                    f"{kv_groups.describe_group(index, group)}: {exc.message}" if index else exc.message
                ) from None
        plane = self._dataplane()
        self._require_dataplane()
        try:
            memory = await self._memories().open(regions, next_registration_id())
        except KvdError:
            raise
        except Exception as exc:
            raise Internal(f"NIXL could not register engine {engine_id!r} memory: {exc}") from exc
        if self._dataplane() is not plane:  # the worker was replaced meanwhile: that mapping is gone
            raise Unavailable(f"the data plane restarted while engine {engine_id!r} registered: register again")
        rank = EngineRank(
            engine_id=engine_id,
            spec=spec,
            placements=tuple(placements),
            memory=memory,
            require_commits=require_commits,
            engine_pid=engine_pid,
            extra_groups=tuple(extra_groups),
        )
        try:
            self.registry.add(rank)  # a racing registration of the same rank loses here
        except Exception:
            await self._memories().fence(memory)
            raise
        if engine_pid:
            self._liveness_now.set()  # watch its pid
        self.metrics.engines.set(len(self.registry))
        self.metrics.registered_bytes.labels(engine_id, str(spec.tp_rank)).set(rank.registered_bytes)
        logger.info(
            "registered engine %s rank %d: %s, %d bytes in %d %s regions",
            engine_id,
            spec.tp_rank,
            " + ".join(f"{g.kind.name.lower()} {g.spec.describe()}" for g in rank.groups)
            if extra_groups
            else spec.describe(),
            rank.registered_bytes,
            len(regions),
            rank.mem_type,
        )
        # An unregister may come while the lists are prepared: it then owns the memory (no rank's
        # field is read after this await).
        await self.prepare_tables(rank)
        return rank

    async def prepare_tables(self, rank: EngineRank) -> None:
        """Prepare the rank's whole-block tables now, so the first pull does not pay for them."""
        memory = rank.memory
        if not memory.usable:
            return
        self._memories().pin(memory)
        try:
            for group in rank.groups:
                await memory.table(block_geometry(group, self.config.max_run_blocks), self._executor)
        finally:
            await self._memories().unpin(memory)

    async def unregister_engine(self, engine_id: str, tp_rank: int, *, until_let_go: bool = False) -> None:
        """The engine's own unregistration. ``until_let_go`` (UnregisterKvCache): return only once
        nothing of this daemon can write or read the rank's memory any more (its pulls fenced,
        its peers' admitted reads over), so the engine may reuse that memory at once; bounded:
        past ``fence_timeout_s`` plus UNREGISTER_WAIT_MARGIN_S it returns anyway, and logs why."""
        rank = self.registry.get(engine_id, tp_rank)
        memory = rank.memory
        await self.unregister(rank, "unregistered by the engine")
        if not until_let_go:
            return
        wait_s = self.config.fence_timeout_s + UNREGISTER_WAIT_MARGIN_S
        if not await self._memories().until_let_go(memory, wait_s):
            logger.warning(
                "engine %s rank %d: unregistered, but after %.1fs a read into or out of its memory is "
                "still running (%d pins, %d of them peers' reads): a late byte may still touch it",
                engine_id,
                tp_rank,
                wait_s,
                memory.pins,
                memory.holder_pins,
            )

    async def unregister(self, rank: EngineRank, reason: str) -> None:
        """Fence the rank at once; its memory is released when nothing can touch it any more.

        Fenced: no new pull, hold or admitted read finds it. In-flight pulls into it are
        cancelled (each fences its own reads). Its engine's leases end once their admitted reads
        are over. The mapping and its NIXL registration go when the last pin does.
        """
        if self.registry.current(rank) is not rank:
            return
        self.registry.remove(rank.engine_id, rank.tp_rank)
        for transfer in self.transfers.in_flight():
            if transfer.engine_id == rank.engine_id and transfer.tp_rank == rank.tp_rank and transfer.task:
                transfer.task.cancel(f"engine {rank.engine_id} rank {rank.tp_rank}: {reason}")
        if not self.registry.ranks_of(rank.engine_id):
            self.leases.end_all(LeaseEnd.ENGINE_GONE, rank.engine_id)
        self.commits.forget_engine(rank.engine_id, rank.tp_rank)
        if rank.wakeup is not None:
            rank.wakeup.set()
        self.metrics.engines.set(len(self.registry))
        self.metrics.registered_bytes.remove(rank.engine_id, str(rank.tp_rank))
        for state in ("hard", "soft", "draining"):
            with contextlib.suppress(KeyError):
                self.metrics.held_bytes.remove(rank.engine_id, str(rank.tp_rank), state)
        logger.info("unregistered engine %s rank %d: %s", rank.engine_id, rank.tp_rank, reason)
        await self._memories().fence(rank.memory)

    def attach_stream(self, engine_id: str, tp_rank: int) -> tuple[EngineRank, int]:
        """Make a new stream the rank's current one; returns the rank and the stream's generation.

        A stream that is still open is superseded, not refused: an engine that reconnects after
        losing its connection must not wait for the daemon to notice the old one is dead.
        """
        rank = self.registry.get(engine_id, tp_rank)
        previous = rank.wakeup
        rank.stream_generation += 1
        rank.stream_connected = True
        rank.wakeup = asyncio.Event()
        if previous is not None:
            previous.set()  # the superseded stream wakes, sees it is no longer current, and ends
            logger.info("engine %s rank %d: a new stream supersedes the open one", engine_id, tp_rank)
        if rank.pending:
            rank.wakeup.set()
        return rank, rank.stream_generation

    def detach_stream(self, rank: EngineRank, generation: int) -> None:
        if rank.stream_generation == generation:
            rank.stream_connected = False
            rank.wakeup = None

    def commit(self, rank: EngineRank, request_id: str, committed_tokens: int) -> None:
        self.commits.commit(rank.engine_id, rank.tp_rank, request_id, committed_tokens)
        self.metrics.commits.inc()

    def post_forward(self, rank: EngineRank, step: int, finished_request_ids: Sequence[str]) -> None:
        """A step's KV is complete (sent after the draft proposer ran): nothing to serve yet."""
        self.metrics.post_forward.inc()
        logger.debug(
            "engine %s rank %d: step %d post-forward, %d finished",
            rank.engine_id,
            rank.tp_rank,
            step,
            len(finished_request_ids),
        )

    async def watch_liveness(self) -> None:
        """An engine process that exited without unregistering is unregistered here.

        Each engine pid is watched through a pidfd, readable once the process exits: the exit is
        noticed at once, and an idle daemon is not woken every LIVENESS_S to look (issue 19). A
        pid no pidfd can be opened for (a kernel without pidfd_open) is checked every LIVENESS_S.
        A registration wakes the loop to watch its pid.
        """
        loop = asyncio.get_running_loop()
        watched: dict[int, int] = {}  # engine pid -> its pidfd (registered with the loop)
        exited: set[int] = set()  # pids whose pidfd said so, not yet acted on

        def on_exit(pid: int) -> None:
            fd = watched.pop(pid)
            loop.remove_reader(fd)
            os.close(fd)
            exited.add(pid)
            self._liveness_now.set()

        try:
            while True:
                self._liveness_now.clear()
                pids = {rank.engine_pid for rank in self.registry if rank.engine_pid}
                for pid in watched.keys() - pids:  # its ranks are gone
                    loop.remove_reader(watched[pid])
                    os.close(watched.pop(pid))
                gone, polled = set(exited), set()
                exited.clear()  # an exit seen while this round awaits is left for the next one
                for pid in pids - watched.keys() - gone:
                    fd = _open_pidfd(pid)
                    if fd is None:
                        polled.add(pid)
                    elif fd < 0:
                        gone.add(pid)
                    else:
                        watched[pid] = fd
                        loop.add_reader(fd, on_exit, pid)
                for rank in list(self.registry):
                    pid = rank.engine_pid
                    if pid in gone or (pid in polled and not _process_alive(pid)):
                        logger.warning("engine %s rank %d (pid %d) exited", rank.engine_id, rank.tp_rank, pid)
                        await self.unregister(rank, f"engine process {pid} exited")
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(LIVENESS_S if polled else None):
                        await self._liveness_now.wait()
        finally:
            for fd in watched.values():
                loop.remove_reader(fd)
                os.close(fd)


def _open_pidfd(pid: int) -> int | None:
    """A pidfd of ``pid``; -1 if no such process is left; None if pidfds are not to be had."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return -1
    except (OSError, AttributeError):  # no pidfd_open (kernel < 5.3, not Linux): poll instead
        return None


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
