"""Peer daemons as this daemon knows them: a cached handshake and a NIXL agent per incarnation.

The handshake (over gRPC, through an injected :class:`PeerTransport`) gives a peer's NIXL agent
metadata and its engines' layouts and region addresses.

**Sessions** (:class:`PeerSession`) are cached per address. A re-handshake with the same
incarnation (a new engine registered on the peer, a registration replaced) updates the engine
table in place and loads the fresh metadata into the *same* NIXL agent: NIXL merges it, so
lists prepared from the agent and reads in flight stay valid. A session is dropped when NIXL
reports the peer gone, when its Handshake or PreparePull fails as unreachable, when its
incarnation changes, or when it was idle for ``peer_idle_s``; dropping it closes its gRPC
channel.

**Agents** (:class:`RemoteAgent`) outlive sessions: pulls pin the agent they read through,
and the agent (``remove_remote_agent``) and its prepared lists are released only when no live
session names it *and* no pull pins it. Everything here runs on the event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from kvd.core.dataplane import DataPlane
from kvd.core.metrics import Metrics
from kvd.core.tables import TableCache
from kvd.layout.geometry import DescGeometry
from kvd.layout.plan import EngineView
from kvd_client.errors import DeadlineExceeded, KvdError, PeerUnavailable, Unavailable

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RemoteEngine:
    """One engine rank of a peer, with what is needed to build NIXL descriptors for it."""

    engine_id: str
    view: EngineView
    region_addresses: tuple[int, ...]
    region_sizes: tuple[int, ...]
    vram: bool
    device_index: int
    registration_id: int
    extra_groups: tuple[EngineView, ...] = ()  # KV cache groups after group 0 (``view``)

    @property
    def groups(self) -> tuple[EngineView, ...]:
        return (self.view, *self.extra_groups)

    @property
    def mem_type(self) -> str:
        return "VRAM" if self.vram else "DRAM"


@dataclasses.dataclass(frozen=True)
class HandshakeInfo:
    incarnation: str
    agent_name: str
    agent_metadata: bytes
    engines: tuple[RemoteEngine, ...]


@dataclasses.dataclass(frozen=True)
class PrepareResult:
    registration_ids: tuple[int, ...]
    notif_tag: str
    verify_after_read: bool = False  # a soft hold: FinishRead must succeed before the pull is done


class PeerTransport(Protocol):
    """How the core reaches a peer daemon (implemented over gRPC in ``kvd.server``)."""

    async def handshake(self, address: str, timeout_s: float) -> HandshakeInfo: ...

    async def prepare_pull(
        self,
        address: str,
        *,
        lease_id: str,
        engine_id: str,
        block_ids: tuple[int, ...],
        num_tokens: int,
        reader_tp_rank: int,
        reader_tp_size: int,
        remote_tp_ranks: tuple[int, ...],
        reader_transfer_id: str,
        read_timeout_s: float,
        timeout_s: float,
        group_block_ids: tuple[tuple[int, ...], ...] = (),
    ) -> PrepareResult: ...

    async def abandon_pull(
        self, address: str, lease_id: str, reader_tp_rank: int, reader_transfer_id: str, reason: str, timeout_s: float
    ) -> None: ...

    async def finish_read(
        self, address: str, lease_id: str, reader_tp_rank: int, reader_transfer_id: str, timeout_s: float
    ) -> None:
        """A soft hold's read is over: the holder verifies its blocks again (an error fails the pull)."""

    async def renew_leases(self, address: str, lease_ids: list[str], timeout_s: float) -> list[str]:
        """Reader heartbeats; returns the ids the holder no longer holds."""
        ...

    async def release_leases(self, address: str, lease_ids: list[str], reason: str, timeout_s: float) -> None:
        """Nobody will read these leases."""

    async def forget(self, address: str) -> None:
        """Close the channel to a dropped peer."""

    async def close(self) -> None: ...


@dataclasses.dataclass(eq=False)
class RemoteAgent:
    """A peer incarnation's NIXL agent, its prepared lists, and who still uses it."""

    name: str
    tables: TableCache
    pins: int = 0
    live: bool = True  # a current session names it
    removed: bool = False

    async def table(self, engine: RemoteEngine, geometry: DescGeometry, executor: concurrent.futures.Executor) -> Any:
        return await self.tables.get(
            engine.registration_id, geometry, engine.region_addresses, engine.device_index, engine.mem_type, executor
        )


@dataclasses.dataclass(eq=False)
class PeerSession:
    address: str
    incarnation: str
    agent: RemoteAgent
    engines: dict[tuple[str, int], RemoteEngine]
    handshaken_at: float = dataclasses.field(default_factory=time.monotonic)
    last_used: float = dataclasses.field(default_factory=time.monotonic)

    @property
    def agent_name(self) -> str:
        return self.agent.name

    def engine_ranks(self, engine_id: str) -> dict[int, RemoteEngine]:
        return {rank: engine for (eid, rank), engine in self.engines.items() if eid == engine_id}


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
    ) -> None:
        self.transport = transport
        self._dataplane = dataplane
        self._metrics = metrics
        self._own_incarnation = own_incarnation
        self._timeout_s = timeout_s
        self._idle_s = idle_s
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
            if current is not None and (not expect_incarnation or current.incarnation == expect_incarnation):
                current.last_used = time.monotonic()
                return current
            return await self._handshake(address)

    async def refresh(self, address: str, reason: str) -> PeerSession:
        """Handshake again (a cached view disagreed with the holder) without dropping the agent."""
        lock = self._locks.setdefault(address, asyncio.Lock())
        async with lock:
            logger.info("re-handshake with %s: %s", address, reason)
            return await self._handshake(address)

    async def _handshake(self, address: str) -> PeerSession:
        try:
            info = await self.transport.handshake(address, self._timeout_s)
        except KvdError as exc:
            self._metrics.handshakes.labels(address, "failed").inc()
            if unreachable(exc):
                await self.drop(address, "handshake failed")
            raise
        if info.incarnation == self._own_incarnation():
            self._metrics.handshakes.labels(address, "failed").inc()
            raise PeerUnavailable(f"{address} is this daemon itself: a pull needs a peer daemon")
        current = self._sessions.get(address)
        if current is not None and current.incarnation != info.incarnation:
            await self.drop(address, "incarnation changed")
            current = None
        agent = self._agents.get(info.agent_name)
        if agent is None:
            agent = RemoteAgent(info.agent_name, TableCache(self._dataplane, info.agent_name))
            self._agents[info.agent_name] = agent
        loaded = await self._dataplane.add_remote(info.agent_metadata)
        if loaded != info.agent_name:
            raise PeerUnavailable(f"peer {address} sent metadata of agent {loaded!r}, not of {info.agent_name!r}")
        agent.live = True
        engines = {(e.engine_id, e.view.spec.tp_rank): e for e in info.engines}
        if current is not None:
            current.engines = engines
            current.handshaken_at = current.last_used = time.monotonic()
            session = current
        else:
            session = PeerSession(address=address, incarnation=info.incarnation, agent=agent, engines=engines)
            self._sessions[address] = session
        if agent.pins == 0:  # lists of registrations the peer no longer serves
            await agent.tables.release(keep={e.registration_id for e in info.engines})
        self._metrics.handshakes.labels(address, "ok").inc()
        self._gauges()
        if self._warm is not None:
            task = asyncio.get_running_loop().create_task(self._warm(session), name=f"kvd-warm-{address}")
            self._warming.add(task)
            task.add_done_callback(self._warming.discard)
        logger.info("handshake with %s: agent %s, %d engine ranks", address, agent.name, len(engines))
        return session

    # --- pins ---------------------------------------------------------------------------------

    def pin(self, session: PeerSession) -> RemoteAgent:
        """A pull will read through the session's agent: keep it loaded until unpinned."""
        if session.agent.removed:
            raise Unavailable(f"peer {session.address} was dropped")
        session.agent.pins += 1
        session.last_used = time.monotonic()
        return session.agent

    async def unpin(self, agent: RemoteAgent) -> None:
        agent.pins -= 1
        assert agent.pins >= 0, "unbalanced unpin"
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
        await self._dataplane.remove_remote(agent.name, agent.tables.close())
        self._gauges()
        logger.debug("removed NIXL agent %s", agent.name)

    async def forget_idle(self) -> None:
        cutoff = time.monotonic() - self._idle_s
        for session in list(self._sessions.values()):
            if session.last_used < cutoff and session.agent.pins == 0:
                await self.drop(session.address, "idle")

    async def drop_all(self) -> None:
        for address in list(self._sessions):
            await self.drop(address, "shutdown")

    def _gauges(self) -> None:
        self._metrics.peers.set(len(self._sessions))
        self._metrics.remote_agents.set(len(self._agents))


def unreachable(exc: KvdError) -> bool:
    """Errors that say the peer cannot be reached (as opposed to refusing a request)."""
    return isinstance(exc, PeerUnavailable) or type(exc) in (Unavailable, DeadlineExceeded)
