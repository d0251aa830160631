"""A peer incarnation's NIXL agent as this daemon knows it: :class:`RemoteAgent`.

**Agents outlive sessions** (kvd.core.peers): pulls pin the agent they read through, and the
agent (``remove_remote_agent``) and its prepared lists are released only when no live session
names it *and* no pull pins it. Everything here runs on the event loop.

**What NIXL holds for an agent.** Loading a peer's metadata into a known agent *merges* it:
regions the peer has since deregistered stay in NIXL's view of the peer. NIXL looks a
descriptor's region up assuming the regions do not overlap, so a stale region that overlaps one
the peer registered later makes ``prep_xfer_dlist`` fail (NIXL_ERR_NOT_FOUND) or resolve part of
a list through the stale region's keys; the same addresses registered again make the load itself
fail, and NIXL then drops the whole agent under lists still in use. So each agent records the
exact regions it has loaded (the holder lists them in its handshake, each with its registration
serial): when fresh metadata names a region that overlaps a region loaded before and no longer
registered (:meth:`RemoteAgent.needs_reload`), the agent is *reloaded* instead of merged: no new
pin is taken, the pulls reading through it finish, then it is removed and loaded afresh. A list
is only prepared for an engine whose regions the agent's current metadata names
(:meth:`RemoteAgent.names`).
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import dataclasses
from typing import Any

from kvd.core.dataplane import NixlRegion
from kvd.core.peer_protocol import RemoteEngine
from kvd.core.tables import TableCache
from kvd.layout.geometry import DescGeometry

# Regions a peer deregistered stay loaded in NIXL's view of it (merges never remove): past this
# many, the agent is reloaded so that neither NIXL's view nor kvd's record of it grows forever.
MAX_STALE_REGIONS = 4096
NAMED_CACHE = 256  # engines whose names() answer is kept (a peer serves a few; a bound all the same)


@dataclasses.dataclass(eq=False)
class RemoteAgent:
    """A peer incarnation's NIXL agent, its prepared lists, and who still uses it."""

    name: str
    tables: TableCache
    pins: int = 0
    live: bool = True  # a current session names it
    removed: bool = False
    # Every region loaded into NIXL for this agent since it was added, stale ones included.
    loaded: frozenset[NixlRegion] = frozenset()
    # The regions the last loaded metadata names (what the peer has registered now), and their
    # (address, size, device, vram) for the per-pull check.
    current: frozenset[NixlRegion] = frozenset()
    current_keys: frozenset[tuple[int, int, int, bool]] = frozenset()
    reloading: bool = False  # being drained for a reload: no new pins
    # The registrations the peer served at a handshake made while pulls pinned the agent: the
    # lists over any other registration are released when the last of those pins goes
    # (:meth:`Peers.unpin`), not left until a handshake finds no pull reading.
    trim_lists_to: frozenset[int] | None = None
    # First contact: a new agent's metadata loads in the data-plane worker while the first pull
    # plans and is admitted by the holder (``Peers._load_first``). Every list over the agent, and
    # so every READ through it, waits for it (:meth:`wait_loaded`); ``None`` once loaded inline.
    load: asyncio.Future[None] | None = None
    # names()'s answers since the last load: id(engine) -> (engine, named).
    _named: dict[int, tuple[RemoteEngine, bool]] = dataclasses.field(default_factory=dict, repr=False)

    def needs_reload(self, regions: frozenset[NixlRegion]) -> bool:
        """Would merging metadata naming ``regions`` leave a stale region overlapping a named one,
        or more stale regions than NIXL should keep for one peer?"""
        stale = sorted((r.address, r.address + r.size, r.device_index, r.vram) for r in self.loaded - regions)
        if len(stale) > MAX_STALE_REGIONS:
            return True
        starts = [start for start, _, _, _ in stale]
        longest = max((end - start for start, end, _, _ in stale), default=0)
        for new in regions - self.loaded:
            # Stale ranges that start before the new one ends and within the longest stale size of it.
            first = bisect.bisect_left(starts, new.address - longest)
            last = bisect.bisect_left(starts, new.address + new.size)
            for _start, end, device, vram in stale[first:last]:
                if end > new.address and device == new.device_index and vram == new.vram:
                    return True
        return False

    def loaded_metadata(self, regions: frozenset[NixlRegion], fresh: bool) -> None:
        """Record that metadata naming ``regions`` was loaded (into a fresh agent or merged)."""
        self.loaded = regions if fresh else self.loaded | regions
        self.current = regions
        self.current_keys = frozenset((r.address, r.size, r.device_index, r.vram) for r in regions)
        self._named.clear()

    def names(self, engine: RemoteEngine) -> bool:
        """Does the loaded metadata name every region of ``engine`` (so a list over it is sound)?
        Asked once per pull: answered once per engine (a set lookup per region: an engine's
        regions are registered one by one, 64 for a 32-layer model) until metadata is loaded again."""
        known = self._named.get(id(engine))
        if known is not None and known[0] is engine:
            return known[1]
        if len(self._named) >= NAMED_CACHE:
            self._named.clear()
        named = self._names(engine)
        self._named[id(engine)] = (engine, named)
        return named

    def _names(self, engine: RemoteEngine) -> bool:
        keys = self.current_keys
        return all(
            (address, size, engine.device_index, engine.vram) in keys
            or any(region.covers(address, size, engine.device_index, engine.vram) for region in self.current)
            for address, size in zip(engine.region_addresses, engine.region_sizes, strict=True)
        )

    async def wait_loaded(self) -> None:
        """Return once the agent's metadata is in NIXL; raise why it is not, if its load failed."""
        if self.load is not None:
            await asyncio.shield(self.load)

    async def settled(self) -> None:
        """Return once no load of the agent's metadata is in flight, whatever its outcome."""
        if self.load is not None and not self.load.done():
            await asyncio.wait([self.load])

    def ready_table(self, engine: RemoteEngine, geometry: DescGeometry) -> Any | None:
        """The list :meth:`table` would return, if it needs no wait: metadata loaded, list prepared."""
        load = self.load
        if load is not None and (not load.done() or load.cancelled() or load.exception() is not None):
            return None
        return self.tables.ready(engine.registration_id, geometry)

    async def table(self, engine: RemoteEngine, geometry: DescGeometry, executor: concurrent.futures.Executor) -> Any:
        await self.wait_loaded()  # NIXL resolves a list against the agent's loaded metadata
        return await self.tables.get(
            engine.registration_id, geometry, engine.region_addresses, engine.device_index, engine.mem_type, executor
        )
