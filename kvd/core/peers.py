"""Peer daemons as this daemon knows them: a cached handshake and a NIXL agent per incarnation.

The handshake (over gRPC, through an injected :class:`PeerTransport`, kvd.core.peer_protocol)
gives a peer's NIXL agent metadata and its engines' layouts and region addresses.

**Sessions** (:class:`PeerSession`) are cached per address. A re-handshake with the same
incarnation (a new engine registered on the peer, a registration replaced) updates the engine
table in place and loads the fresh metadata into the *same* NIXL agent: NIXL merges it, so
lists prepared from the agent and reads in flight stay valid. A session is dropped when NIXL
reports the peer gone, when its Handshake cannot reach it (a refusal it answers keeps the
channel), when its PreparePull fails as unreachable, when its
incarnation changes, or when it was idle for ``peer_idle_s``; dropping it closes its gRPC
channel.

**Agents** (:class:`RemoteAgent`, kvd.core.remote_agents) outlive sessions: pulls pin the agent
they read through, and the agent and its prepared lists are released only when no live session
names it *and* no pull pins it. Metadata that would leave a stale region overlapping a new one
is not merged: the agent is reloaded (kvd.core.remote_agents says why). Everything here runs on
the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from kvd.core.dataplane import DataPlane, NixlRegion
from kvd.core.metrics import Metrics
from kvd.core.peer_protocol import (
    AskedAdmission,
    HandshakeInfo,
    PeerTransport,
    PrepareRequest,
    PrepareResult,
    RemoteEngine,
    unreachable,
)
from kvd.core.remote_agents import MAX_STALE_REGIONS, RemoteAgent
from kvd.core.tables import TableCache
from kvd_client.errors import InvalidArgument, KvdError, PeerUnavailable, Unavailable

# Defined here before kvd.core.peer_protocol and kvd.core.remote_agents: still importable from here.
__all__ = [
    "MAX_STALE_REGIONS",
    "AskedAdmission",
    "HandshakeInfo",
    "NixlRegion",
    "PeerSession",
    "PeerTransport",
    "Peers",
    "PrepareRequest",
    "PrepareResult",
    "RemoteAgent",
    "RemoteEngine",
    "StaleView",
    "unreachable",
]

logger = logging.getLogger(__name__)


class StaleView(Exception):
    """The agent a pull planned against is being reloaded: plan again on the fresh session."""


class BrokenConnection(PeerUnavailable):
    """A known peer agent's fresh metadata could not be merged: NIXL found the connection to it
    broken (``NIXL_ERR_REMOTE_DISCONNECT``). Only :meth:`Peers._handshake` sees it: it loads the
    agent afresh, over a new connection, once."""


@dataclasses.dataclass(eq=False)
class PeerSession:
    address: str
    incarnation: str
    agent: RemoteAgent
    engines: dict[tuple[str, int], RemoteEngine]
    handshaken_at: float = dataclasses.field(default_factory=time.monotonic)
    last_used: float = dataclasses.field(default_factory=time.monotonic)
    # When the handshake this view is from was asked (before its answer was made), and how long
    # after that the holder keeps memory it lets go readable (HandshakeInfo.early_read_window_s):
    # a READ beside its admission is posted on this view only within that window (may_read_early).
    asked_at: float = dataclasses.field(default_factory=time.monotonic)
    early_read_window_s: float = 0.0
    # Forgotten because this daemon's data-plane worker was lost (the peer is fine): its pulls'
    # READs are final (the worker's death fenced them), so the holder is still told they are over.
    plane_lost: bool = False
    # engine_ranks' index and the ``engines`` dict it was built from.
    _ranks_index: tuple[dict[tuple[str, int], RemoteEngine], dict[str, dict[int, RemoteEngine]]] | None = (
        dataclasses.field(default=None, repr=False)
    )

    @property
    def agent_name(self) -> str:
        return self.agent.name

    def engine_ranks(self, engine_id: str) -> dict[int, RemoteEngine]:
        """The engine's ranks on this peer, by rank: every pull asks, so the index is built once
        per ``engines`` (a re-handshake assigns a new dict, which rebuilds it). Read-only to callers."""
        index = self._ranks_index
        if index is None or index[0] is not self.engines:
            by_engine: dict[str, dict[int, RemoteEngine]] = {}
            for (eid, rank), engine in self.engines.items():
                by_engine.setdefault(eid, {})[rank] = engine
            index = self._ranks_index = (self.engines, by_engine)
        return index[1].get(engine_id) or {}

    def may_read_early(self, now: float) -> bool:
        """Whether a READ planned on this view may be posted before its admission: only within the
        holder's window from when the handshake was asked. The memory the view names may since
        have been let go, but the holder keeps its addresses readable that long after (and more):
        never a READ of unmapped memory, whatever the lease's params say (docs/lifetimes.md)."""
        return now < self.asked_at + self.early_read_window_s


class Peers:
    """Cached peer sessions and their agents. Event-loop only; one handshake in flight per address."""

    def __init__(
        self,
        transport: PeerTransport,
        dataplane: DataPlane,
        metrics: Metrics,
        own_incarnation: Callable[[], str],
        timeout_s: float,
        idle_s: float = 600.0,
        warm: Callable[[PeerSession], Coroutine[Any, Any, None]] | None = None,
        reload_wait_s: float = 30.0,
    ) -> None:
        self.transport = transport
        self._dataplane = dataplane
        self._metrics = metrics
        self._own_incarnation = own_incarnation
        self._timeout_s = timeout_s
        self._idle_s = idle_s
        self._reload_wait_s = reload_wait_s  # at most this long for pulls through an agent to be reloaded
        self._sessions: dict[str, PeerSession] = {}
        self._agents: dict[str, RemoteAgent] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        # First contact is on the first pull's path: what can be made ready for later pulls
        # (the peer's whole-block lists) is started right after the handshake.
        self._warm = warm
        self._warming: set[asyncio.Task[None]] = set()

    async def warmed(self) -> None:
        """Wait for the background work started by handshakes (tests drive interleavings by hand)."""
        while self._warming:
            await asyncio.gather(*self._warming, return_exceptions=True)

    def cached(self, address: str) -> PeerSession | None:
        return self._sessions.get(address)

    def sessions(self) -> list[PeerSession]:
        return list(self._sessions.values())

    def agents(self) -> list[RemoteAgent]:
        return list(self._agents.values())

    async def session(self, address: str, expect_incarnation: str = "") -> PeerSession:
        """The peer's session, handshaking if none is cached or the cached one is another incarnation."""
        lock = self._locks.setdefault(address, asyncio.Lock())
        async with lock:
            current = self._sessions.get(address)
            if (
                current is not None
                and not current.agent.reloading  # a reload that did not finish: try it again
                and (not expect_incarnation or current.incarnation == expect_incarnation)
            ):
                current.last_used = time.monotonic()
                return current
            return await self._handshake(address)

    async def refresh(self, address: str, reason: str, unless_since: float = 0.0) -> PeerSession:
        """Handshake again (a cached view disagreed with the holder) without dropping the agent;
        with ``unless_since``, a session handshaken since then (by a pull that found the same) is
        returned as it is."""
        lock = self._locks.setdefault(address, asyncio.Lock())
        async with lock:
            current = self._sessions.get(address)
            if unless_since and current is not None and current.handshaken_at >= unless_since:
                return current
            logger.info("re-handshake with %s: %s", address, reason)
            return await self._handshake(address)

    async def _handshake(self, address: str) -> PeerSession:
        """Handshake and load the peer's agent; a connection found broken is made anew, once.

        A connection may break without the pull that broke it noticing (a READ of memory the
        holder had unmapped did, before the holder kept what it lets go readable: docs/lifetimes.md);
        merging the peer's fresh metadata is then the first NIXL call to see it. The failed merge dropped
        the peer and marked its agent for a reload: a second handshake unloads it (once no pull
        reads through it) and loads it over a new connection, so the pull that found it goes on."""
        try:
            return await self._handshake_once(address)
        except BrokenConnection as exc:
            logger.info("handshake with %s: %s; loading its NIXL agent again", address, exc.message)
        try:
            return await self._handshake_once(address)
        except BrokenConnection as exc:
            raise PeerUnavailable(exc.message) from exc
        except InvalidArgument as exc:
            # NIXL 1.5 keeps the UCX connection of an agent whose merge failed (nothing releases
            # it), so it refuses to load that agent again: not the caller's argument.
            raise PeerUnavailable(
                f"the NIXL connection to {address} broke and NIXL will not load its agent again "
                f"({exc.message}): a restart of either daemon's data plane clears it"
            ) from exc

    async def _handshake_once(self, address: str) -> PeerSession:
        asked_at = time.monotonic()
        try:
            info = await self.transport.handshake(address, self._timeout_s)
        except KvdError as exc:
            self._metrics.handshakes.labels(address, "failed").inc()
            if isinstance(exc, PeerUnavailable):
                # Not reached: a new channel for the next try (this one may wait out a reconnect
                # back-off). A peer that answered (its data plane restarting, say) keeps its
                # channel: dropping it made every pull in that window handshake on a new one, and
                # gRPC kept each one's connection open (the fleet counted 50-120 per peer).
                await self.drop(address, "handshake failed")
            raise
        known = self._agents.get(info.agent_name)
        if known is not None:
            await known.settled()  # its first load (through another address of the peer) is over
        current = self._sessions.get(address)
        if current is not None and current.incarnation != info.incarnation:
            await self.drop(address, "incarnation changed")
            current = None
        named = info.named_regions()
        agent = self._agents.get(info.agent_name)
        if agent is not None and (agent.reloading or agent.needs_reload(named)):
            await self._unload(agent, address)
            agent = None
        if agent is None and known is None and current is None:
            # Never seen through any address: nothing reads through the agent yet. (A reload, or
            # another address of the same peer, loads inline: its sessions move to the new agent.)
            session = self._first_contact(address, info, named)
        else:
            session = await self._load_inline(address, info, named, agent, current)
        session.asked_at = asked_at
        # This daemon itself (kvd.core.loopback): its admission is a coroutine call, so there is no
        # round trip to hide, and NIXL frees the keys of a registration its own agent drops at once:
        # a READ posted before its admission, on a view naming memory since let go, crashed the
        # worker. Its pulls are admitted before they read.
        session.early_read_window_s = 0.0 if info.incarnation == self._own_incarnation() else info.early_read_window_s
        self._metrics.handshakes.labels(address, "ok").inc()
        self._gauges()
        if self._warm is not None:
            task = asyncio.get_running_loop().create_task(self._warm(session), name=f"kvd-warm-{address}")
            self._warming.add(task)
            task.add_done_callback(self._warming.discard)
        logger.info("handshake with %s: agent %s, %d engine ranks", address, session.agent_name, len(session.engines))
        return session

    async def _add_remote(self, info: HandshakeInfo) -> str:
        """Load the peer agent's metadata into NIXL; the agent's name.

        The daemon itself (both engines on this node, kvd.core.loopback) is not loaded: NIXL
        serves a transfer to its own agent from its own registrations, and refuses its own
        metadata."""
        if info.incarnation == self._own_incarnation():
            if info.agent_name != self._dataplane.name:
                raise Unavailable(
                    f"this daemon's data plane was replaced during the handshake with itself "
                    f"(agent {info.agent_name!r} is now {self._dataplane.name!r}): retry"
                )
            return info.agent_name
        return await self._dataplane.add_remote(info.agent_metadata)

    @staticmethod
    async def _remove_remote(agent: RemoteAgent, dataplane: DataPlane) -> None:
        """Release the agent's lists and forget it in ``dataplane``'s NIXL agent (the worker the
        agent was loaded into; this daemon's own agent: the lists only)."""
        tables = agent.tables.close()
        await agent.tables.settle()  # a list still being prepared over the agent is released first
        if agent.name == dataplane.name:
            await dataplane.release_tables(tables)
        else:
            await dataplane.remove_remote(agent.name, tables)

    def _new_agent(self, name: str) -> RemoteAgent:
        """A peer agent known from now on, with its own list cache (its metadata is loaded by the caller)."""
        agent = RemoteAgent(name, TableCache(self._dataplane, name))
        self._agents[name] = agent
        return agent

    def _first_contact(self, address: str, info: HandshakeInfo, named: frozenset[NixlRegion]) -> PeerSession:
        """A peer never seen, whose agent is not loaded: cache its session now and load the agent's
        metadata in the background. The first pull plans and the holder admits it meanwhile (the
        load is 1.5-2 ms of first contact: a hop to the worker, ``add_remote_agent``, the connect);
        every list over the agent, so every READ, waits for the load (:meth:`RemoteAgent.wait_loaded`)."""
        agent = self._new_agent(info.agent_name)
        agent.loaded_metadata(named, fresh=True)  # what the load names; nothing is prepared before it
        session = PeerSession(
            address=address, incarnation=info.incarnation, agent=agent, engines=info.engines_by_rank()
        )
        self._sessions[address] = session
        load = asyncio.get_running_loop().create_task(self._load_first(session, info), name=f"kvd-load-{address}")
        load.add_done_callback(_retrieve)  # its error reaches the pulls through wait_loaded()
        agent.load = load
        return session

    async def _load_first(self, session: PeerSession, info: HandshakeInfo) -> None:
        """Load a first-contact agent's metadata. On failure no new pull pins the agent (each plans
        again and handshakes afresh); the pulls that pinned it fail with the load's error, and the
        session stays cached until they end, so their holders are told their reads are over."""
        agent = session.agent
        try:
            _require_agent(info, await self._add_remote(info), session.address)
        except KvdError as exc:
            agent.reloading = True
            logger.warning("loading the NIXL agent of %s failed: %s", session.address, exc.message)
            raise
        if agent.removed:
            if session.plane_lost:  # our data-plane worker was replaced while the metadata loaded
                raise Unavailable(
                    f"this daemon's data plane restarted during the handshake with {session.address}: retry"
                )
            raise PeerUnavailable(f"peer {session.address} was dropped while its NIXL metadata loaded: retry")

    async def _load_inline(
        self,
        address: str,
        info: HandshakeInfo,
        named: frozenset[NixlRegion],
        agent: RemoteAgent | None,
        current: PeerSession | None,
    ) -> PeerSession:
        """Load the metadata of a peer already known (a re-handshake: NIXL merges it into the
        agent, or loads a replacing agent) before the session changes: pulls already read through it."""
        fresh = agent is None
        if agent is None:
            agent = self._new_agent(info.agent_name)
        try:
            loaded = await self._add_remote(info)
        except KvdError as exc:
            if not fresh:
                # NIXL forgets an agent whose metadata it could not load: no new pull may read through
                # it, and the next handshake reloads it once the pulls already reading are over.
                agent.reloading = True
                await self.drop(address, "metadata rejected")
                if isinstance(exc, PeerUnavailable):
                    raise BrokenConnection(exc.message) from exc
            raise
        _require_agent(info, loaded, address)
        if agent.removed:  # our data-plane worker was replaced while the metadata loaded (rebind)
            raise Unavailable(f"this daemon's data plane restarted during the handshake with {address}: retry")
        agent.loaded_metadata(named, fresh)
        agent.live = True
        engines = info.engines_by_rank()
        for other in self._sessions.values():  # a reload replaced the agent every session of it uses
            if other.agent.name == agent.name:
                other.agent = agent
        replaced = current.agent if current is not None and current.agent is not agent else None
        if current is not None:
            current.engines = engines
            current.agent = agent
            current.handshaken_at = current.last_used = time.monotonic()
            session = current
        else:
            session = PeerSession(address=address, incarnation=info.incarnation, agent=agent, engines=engines)
            self._sessions[address] = session
        if replaced is not None and not any(s.agent is replaced for s in self._sessions.values()):
            # The peer's data plane restarted under a new agent name (same daemon incarnation):
            # the old agent goes once no pull reads through it.
            replaced.live = False
            await self._maybe_remove(replaced)
        # Lists of registrations the peer no longer serves: released now, or once no pull that
        # may have planned against the previous handshake still reads through the agent.
        serving = frozenset(e.registration_id for e in info.engines)
        if agent.pins == 0:
            agent.trim_lists_to = None
            await agent.tables.release(keep=set(serving))
        else:
            agent.trim_lists_to = serving
        return session

    # --- pins ---------------------------------------------------------------------------------

    async def _unload(self, agent: RemoteAgent, address: str) -> None:
        """Drain and remove an agent whose next metadata must not be merged (module docstring).

        No pull pins it from now on; those that did finish (their reads are final) first. The
        caller holds the peer's handshake lock, so new pulls to the peer wait for the fresh load.
        """
        agent.reloading = True
        logger.info("reloading NIXL agent %s of %s: memory it had registered was replaced", agent.name, address)
        deadline = time.monotonic() + self._reload_wait_s
        while agent.pins:
            if time.monotonic() > deadline:
                raise Unavailable(
                    f"peer {address} replaced registered memory and {agent.pins} pulls still read through the "
                    f"previous view of it after {self._reload_wait_s:.0f}s: retry"
                )
            await asyncio.sleep(0.002)
        agent.removed = True
        agent.live = False
        self._agents.pop(agent.name, None)
        await self._remove_remote(agent, self._dataplane)
        self._metrics.agent_reloads.inc()

    def pin(self, session: PeerSession) -> RemoteAgent:
        """A pull will read through the session's agent: keep it loaded until unpinned.

        Raises :class:`StaleView` while the agent is being reloaded (the pull plans again).
        """
        if session.agent.reloading:
            raise StaleView(f"the NIXL agent of {session.address} is being reloaded")
        if session.agent.removed:
            raise Unavailable(f"peer {session.address} was dropped")
        session.agent.pins += 1
        session.last_used = time.monotonic()
        return session.agent

    async def unpin(self, agent: RemoteAgent) -> None:
        agent.pins -= 1
        assert agent.pins >= 0, "unbalanced unpin"
        serving = agent.trim_lists_to
        if agent.pins == 0 and serving is not None and not agent.removed:
            agent.trim_lists_to = None  # taken before the await: a later handshake sets its own
            await agent.tables.release(keep=set(serving))
        await self._maybe_remove(agent)

    # --- dropping -----------------------------------------------------------------------------

    async def drop(self, address: str, reason: str) -> None:
        """Forget a peer: no new pull uses its session; its agent goes once nothing pins it."""
        session = self._sessions.pop(address, None)
        await self.transport.forget(address)
        if session is None:
            return
        self._metrics.peer_drops.labels(address, reason).inc()
        logger.info("dropping peer %s (agent %s): %s", address, session.agent_name, reason)
        if not any(s.agent is session.agent for s in self._sessions.values()):
            session.agent.live = False
            await self._maybe_remove(session.agent)
        self._gauges()

    async def drop_if(self, session: PeerSession, reason: str) -> None:
        """Drop the session if it is still the cached one (not replaced by a newer handshake)."""
        if self._sessions.get(session.address) is session:
            await self.drop(session.address, reason)

    async def _maybe_remove(self, agent: RemoteAgent) -> None:
        if agent.live or agent.pins or agent.removed:
            return
        agent.removed = True
        self._agents.pop(agent.name, None)
        dataplane = self._dataplane  # the worker it was loaded into, even if a restart rebinds meanwhile
        await agent.settled()  # never remove an agent while its metadata loads: the load would follow
        await self._remove_remote(agent, dataplane)
        self._gauges()
        logger.debug("removed NIXL agent %s", agent.name)

    async def forget_idle(self) -> None:
        cutoff = time.monotonic() - self._idle_s
        for session in list(self._sessions.values()):
            if session.last_used < cutoff and session.agent.pins == 0:
                await self.drop(session.address, "idle")

    def rebind(self, dataplane: Any) -> None:
        """A new data-plane worker replaced a lost one: every agent loaded into the old one went
        with it (and every list over it). Sessions are forgotten too: the next pull to a peer
        handshakes again and loads its agent into the new worker. No NIXL call: the old one is dead."""
        self._dataplane = dataplane
        for agent in self._agents.values():
            agent.removed = True
            agent.live = False
            agent.tables.close()
        for session in self._sessions.values():
            session.agent.removed = True
            session.agent.live = False
            session.plane_lost = True
        self._agents.clear()
        self._sessions.clear()
        self._gauges()

    async def drop_all(self) -> None:
        for address in list(self._sessions):
            await self.drop(address, "shutdown")

    def _gauges(self) -> None:
        self._metrics.peers.set(len(self._sessions))
        self._metrics.remote_agents.set(len(self._agents))


def _require_agent(info: HandshakeInfo, loaded: str, address: str) -> None:
    """The metadata NIXL loaded must be of the agent the handshake named."""
    if loaded != info.agent_name:
        raise PeerUnavailable(f"peer {address} sent metadata of agent {loaded!r}, not of {info.agent_name!r}")


def _retrieve(task: asyncio.Future[None]) -> None:
    """Mark a background load's outcome as seen: the pulls waiting on it get its error."""
    if not task.cancelled():
        task.exception()
