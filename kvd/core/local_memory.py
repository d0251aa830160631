"""Engine memory mapped into the daemon and registered with NIXL, and when it may be let go.

A :class:`LocalMemory` is one mapping of an engine rank's regions: the opened regions, their
NIXL registrations and the descriptor lists prepared over them. Its life (docs/lifetimes.md):

* **pinned** by every pull reading into it (reader side) and every read admitted on a lease of
  its engine (holder side): a pin is taken before a NIXL call can touch the memory and dropped
  only once no byte can still move;
* **fenced** when its rank unregisters (or is re-mapped): no new pin is taken;
* **released** once fenced and unpinned: lists released, NIXL registration dropped, mapping
  unmapped;
* **retired** instead, when a read into it could not be proven over (a READ NIXL would not
  finish, an admitted read that ran past its deadline): host pages are replaced by private
  anonymous ones (:func:`kvd.worker.vm.retire_range`, in the worker) so a late copy cannot reach
  the engine, and the mapping stays reserved in the quarantine (metric
  ``kvd_quarantined_bytes``) until every such read is final: a READ of ours when NIXL says so,
  a peer's admitted read (a *taint*, :meth:`Memories.taint`) when its reader proves it over late
  (every part's notification arrived, or its AbandonPull, :meth:`Memories.prove`). VRAM cannot be
  retired: it stays mapped, quarantined, until then;
* **lost** with its data-plane worker: the worker's death unmapped it and ended every read into
  or out of it, so it holds nothing; a lost mapping is never used again (its rank gets a new
  one in the new worker) and its pins end as no-ops.

Everything here runs on the event loop; the mappings themselves are the worker's (the data plane
names them by region id).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import enum
import logging
import mmap
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvd.core.dataplane import DataPlane, Xfer
from kvd.core.finishing import Finishing
from kvd.core.memory import MemoryKind, OpenedRegion, RegionRequest
from kvd.core.metrics import Metrics
from kvd.core.tables import TableCache
from kvd.layout.geometry import DescGeometry

logger = logging.getLogger(__name__)

# How often an unregistration checks whether its rank's memory is let go (Memories.until_let_go):
# only while an UnregisterKvCache waits for its pulls' fences and its peers' admitted reads.
LET_GO_POLL_S = 0.005


class MemoryState(enum.Enum):
    ACTIVE = "active"
    FENCED = "fenced"  # no new pins; released when the last pin goes
    QUARANTINED = "quarantined"  # retired (host) or kept mapped (VRAM) until its stale reads are final
    RELEASED = "released"
    LOST = "lost"  # its data-plane worker died: nothing of it is left to release


@dataclasses.dataclass(eq=False)
class LocalMemory:
    """One mapping of an engine rank's regions; see the module docstring for its life."""

    registration_id: int
    regions: list[OpenedRegion]
    nixl_registrations: list[Any]
    tables: TableCache
    state: MemoryState = MemoryState.ACTIVE
    pins: int = 0  # every pin, reader and holder side
    holder_pins: int = 0  # pins of reads admitted on this mapping (peers read out of it)
    # Peers' reads out of this mapping (their admission ids) that ended without proof that nothing
    # can still move: while any is left the mapping is retired on release, not freed, and kept
    # until each is proven over (Memories.prove: its reader's late notifications or AbandonPull).
    taints: set[str] = dataclasses.field(default_factory=set)
    # Set once the pages were replaced: a pull that read into this mapping must not report DONE.
    retired: bool = False
    # Reads into this mapping that were given up before NIXL finished them.
    stale: list[Xfer] = dataclasses.field(default_factory=list)
    # Set while one pull cuts this mapping off (re-map, retire); other pulls fencing on it wait.
    cut_off: asyncio.Future[None] | None = None
    # The data plane (worker incarnation) whose mappings and registrations these are.
    plane: Any = None

    @property
    def addresses(self) -> list[int]:
        return [region.address for region in self.regions]

    @property
    def device_index(self) -> int:
        return self.regions[0].device_index

    @property
    def mem_type(self) -> str:
        return self.regions[0].mem_type

    @property
    def size_bytes(self) -> int:
        return sum(region.size_bytes for region in self.regions)

    @property
    def host(self) -> bool:
        return not any(region.vram for region in self.regions)

    @property
    def usable(self) -> bool:
        return self.state is MemoryState.ACTIVE

    @property
    def tainted(self) -> bool:
        """A peer's read out of it ended unproven and is not proven over yet (see ``taints``)."""
        return bool(self.taints)

    def ready_table(self, geometry: DescGeometry) -> Any | None:
        """The list :meth:`table` would return, if it is prepared already."""
        return self.tables.ready(self.registration_id, geometry)

    async def table(self, geometry: DescGeometry, executor: concurrent.futures.Executor) -> Any:
        return await self.tables.get(
            self.registration_id, geometry, self.addresses, self.device_index, self.mem_type, executor
        )


class Memories:
    """Creates, pins, fences, re-maps, releases and quarantines LocalMemory. Event-loop only."""

    def __init__(self, dataplane: DataPlane, metrics: Metrics, keep_readable_s: float = 0.0) -> None:
        self._dataplane = dataplane
        self._metrics = metrics
        # How long a freed mapping's addresses stay readable (throw-away pages) before the worker
        # unmaps them: a peer may still post a READ beside its admission against them, planned on
        # a handshake that named them (docs/lifetimes.md, "Memory let go stays readable").
        self.keep_readable_s = keep_readable_s
        self.quarantine: list[LocalMemory] = []
        self._releasing: set[LocalMemory] = set()
        # Called when a mapping enters the quarantine: the daemon's sweeper, which frees it once its
        # stale reads are final, sleeps while there is nothing to sweep and must be woken.
        self.on_quarantined: Callable[[], None] = lambda: None
        # Opening and releasing run to their end even if their caller is cancelled (kvd.core.finishing).
        self.finishing = Finishing("memory")

    async def register(self, regions: Sequence[OpenedRegion], registration_id: int) -> LocalMemory:
        """Register every region with NIXL; all or nothing."""
        registrations: list[Any] = []
        try:
            for region in regions:
                registrations.append(
                    await self._dataplane.register(
                        region.address, region.size_bytes, region.device_index, region.mem_type
                    )
                )
        except BaseException:
            for registration in registrations:
                await self._dataplane.deregister(registration)
            raise
        return LocalMemory(
            registration_id,
            list(regions),
            registrations,
            TableCache(self._dataplane, "NIXL_INIT_AGENT"),
            plane=self._dataplane,
        )

    async def open(
        self, requests: Sequence[RegionRequest], registration_id: int, *, to_the_end: bool = True
    ) -> LocalMemory:
        """Map an engine's regions in the worker and register them with NIXL; all or nothing.

        A caller cancelled meanwhile leaves it to finish; the mapping is then released. Not
        ``to_the_end``: a cancel stops it where it is, for a caller whose only cancel is the
        shutdown that stops the worker next (a data-plane restart re-mapping ranks)."""
        if not to_the_end:
            return await self._open(requests, registration_id)
        return await self.finishing.run(self._open(requests, registration_id), abandoned=self._drop)

    def _drop(self, memory: LocalMemory) -> None:
        """A mapping made for a caller that gave up: nothing pins it, nothing will."""
        self.finishing.start(self.fence(memory))

    async def _open(self, requests: Sequence[RegionRequest], registration_id: int) -> LocalMemory:
        plane = self._dataplane
        mapped = await plane.open_regions(requests)
        regions = [OpenedRegion(request, region) for request, region in zip(requests, mapped, strict=True)]
        try:
            return await self.register(regions, registration_id)
        except BaseException:
            await plane.close_regions([region.region_id for region in regions])
            raise

    def rebind(self, dataplane: DataPlane) -> None:
        """A new worker replaced a lost one: every mapping of the old one is lost (nothing to free)."""
        self._dataplane = dataplane
        for memory in self.quarantine:
            memory.state = MemoryState.LOST
            self._metrics.quarantined_bytes.dec(memory.size_bytes)
        self.quarantine.clear()

    @staticmethod
    def lose(memory: LocalMemory) -> None:
        """Its worker died: the mapping, its registration and every read through it are gone."""
        memory.state = MemoryState.LOST
        memory.tables.close()
        memory.nixl_registrations.clear()
        memory.taints.clear()  # nothing is read out of a dead worker's mappings any more

    @staticmethod
    def _lost(memory: LocalMemory) -> bool:
        """Is the mapping gone with its worker (marked LOST if the worker died since)?"""
        if memory.state is not MemoryState.LOST and not memory.plane.alive:
            Memories.lose(memory)
        return memory.state is MemoryState.LOST

    # --- pins -------------------------------------------------------------------------------

    def pin(self, memory: LocalMemory, *, holder: bool = False) -> None:
        """Take a pin (the caller checked ``usable``); ``holder``: a peer's admitted read."""
        memory.pins += 1
        memory.holder_pins += holder

    async def unpin(self, memory: LocalMemory, *, holder: bool = False, stale: Sequence[Xfer] = ()) -> None:
        """Drop a pin. ``stale``: reads into this mapping still in flight that nobody waits for.
        (A holder pin whose read was not proven over is tainted first: :meth:`taint`.)"""
        memory.pins -= 1
        memory.holder_pins -= holder
        assert memory.pins >= 0 and memory.holder_pins >= 0, "unbalanced unpin"
        memory.stale.extend(x for x in stale if not x.final)
        if memory.state is MemoryState.FENCED and memory.pins == 0:
            await self._release(memory)

    @staticmethod
    def taint(memory: LocalMemory, read: str) -> None:
        """A peer's read out of ``memory`` (admission id ``read``) ended without proof that it is
        over: a peer may still be reading, so the mapping is retired, not freed, when released."""
        if memory.state is not MemoryState.LOST:
            memory.taints.add(read)

    def prove(self, memory: LocalMemory, read: str) -> None:
        """The tainting read ``read`` is proven over after all (its reader's notifications or its
        AbandonPull came late). A quarantined mapping that nothing else keeps is then freed by
        the sweeper's next round (woken here), as one whose stale READs turned final."""
        memory.taints.discard(read)
        if memory.state is MemoryState.QUARANTINED and not memory.tainted:
            self.on_quarantined()

    async def fence(self, memory: LocalMemory) -> None:
        """No new pins; released now if nothing pins it, else when the last pin goes."""
        if memory.state is MemoryState.ACTIVE:
            memory.state = MemoryState.FENCED
        if memory.state is MemoryState.FENCED and memory.pins == 0:
            await self._release(memory)

    # --- re-mapping ---------------------------------------------------------------------------

    def can_remap(self, memory: LocalMemory) -> bool:
        """Host memory from a shared mapping can be mapped again at new addresses."""
        return memory.host and all(
            r.request.kind is MemoryKind.SHM and r.address % mmap.PAGESIZE == 0 for r in memory.regions
        )

    async def remap(self, memory: LocalMemory, registration_id: int) -> LocalMemory:
        """A new mapping of the same engine pages at new addresses, registered with NIXL.

        The old mapping can then be retired without the engine losing its memory: this is how a
        pull whose READ NIXL will not finish is failed safely (see PullEnding.fence in kvd.core.pull_resources).
        A caller cancelled meanwhile leaves it to finish; the new mapping is then released.
        """
        return await self.finishing.run(self._remap(memory, registration_id), abandoned=self._drop)

    async def _remap(self, memory: LocalMemory, registration_id: int) -> LocalMemory:
        plane = memory.plane
        regions: list[OpenedRegion] = []
        try:
            for region in memory.regions:
                regions.append(OpenedRegion(region.request, await plane.duplicate_region(region.region_id)))
            return await self.register(regions, registration_id)
        except BaseException:
            await plane.close_regions([region.region_id for region in regions])
            raise

    # --- release ------------------------------------------------------------------------------

    async def retire(self, memory: LocalMemory) -> None:
        """Cut the mapping off the engine's pages now (host memory); a no-op for VRAM."""
        if memory.retired or not memory.host or self._lost(memory):  # a lost worker's pages went with it
            return
        for region in memory.regions:
            await memory.plane.retire_region(region.region_id)
        memory.retired = True
        logger.warning(
            "retired a mapping of %d bytes (registration %d): a read into it could not be proven over",
            memory.size_bytes,
            memory.registration_id,
        )

    def let_go(self, memory: LocalMemory) -> bool:
        """Whether nothing of this daemon can write or read the engine's pages through ``memory``
        any more: freed (no pin, no READ in flight into it), retired (host: its addresses now hold
        throw-away pages), or gone with its worker. A quarantined VRAM mapping is not: a stale READ
        may still land in it."""
        return self._lost(memory) or memory.retired or memory.state is MemoryState.RELEASED

    async def until_let_go(self, memory: LocalMemory, timeout_s: float) -> bool:
        """Wait (polling, on the event loop) until :meth:`let_go`; False if ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        while not self.let_go(memory):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(LET_GO_POLL_S)
        return True

    async def _release(self, memory: LocalMemory) -> None:
        """Free or quarantine ``memory``, to the end even if the caller is cancelled meanwhile."""
        await self.finishing.run(self._release_now(memory))

    async def _release_now(self, memory: LocalMemory) -> None:
        if memory in self._releasing or memory.state in (MemoryState.RELEASED, MemoryState.QUARANTINED):
            return
        if self._lost(memory):  # its worker is gone: nothing of it is left to release
            return
        self._releasing.add(memory)
        try:
            memory.stale = [x for x in memory.stale if not x.final]
            if memory.stale or memory.tainted:
                await self.retire(memory)
                memory.state = MemoryState.QUARANTINED
                self.quarantine.append(memory)
                self._metrics.quarantined_bytes.inc(memory.size_bytes)
                self.on_quarantined()
                if not memory.stale:  # no read of ours is built on its lists any more
                    await memory.tables.release()
                return
            await self._free(memory)
        finally:
            self._releasing.discard(memory)

    async def _free(self, memory: LocalMemory) -> None:
        memory.state = MemoryState.RELEASED
        plane = memory.plane
        await memory.tables.release()
        for registration in memory.nixl_registrations:
            await plane.deregister(registration)
        memory.nixl_registrations.clear()
        # The worker's mapping, kept readable a while (host memory): never unmapped under a READ.
        await plane.close_regions([region.region_id for region in memory.regions], self.keep_readable_s)
        memory.regions.clear()

    async def sweep_quarantine(self) -> None:
        """Free quarantined mappings whose stale reads have all finished and whose taints are
        all proven over.

        A tainted mapping (a peer's read out of it that was never proven over) stays retired until
        its reader proves it over (:meth:`prove`): no NIXL handle on this side can say when a peer
        stops reading it. A reader that never does (it died) leaves it for the daemon's life:
        address space and a NIXL registration, no memory (its pages were retired).
        """
        for memory in list(self.quarantine):
            memory.stale = [x for x in memory.stale if not x.final]
            if memory.stale or memory.tainted:
                continue
            self.quarantine.remove(memory)
            self._metrics.quarantined_bytes.dec(memory.size_bytes)
            await self._free(memory)
            logger.info(
                "freed quarantined mapping (registration %d): its stale reads finished, its readers' reads proven over",
                memory.registration_id,
            )

    @property
    def quarantined_bytes(self) -> int:
        return sum(m.size_bytes for m in self.quarantine)
