"""Peer daemons as this daemon knows them: one cached handshake per peer incarnation.

The handshake (over gRPC, through an injected :class:`PeerTransport`) gives a peer's NIXL
agent metadata and its engines' layouts and region addresses. It is cached per address and
dropped when NIXL reports the peer disconnected, when the peer's incarnation changes, or when
a registration the cache describes is stale; the next pull handshakes again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Protocol

from kvd.core.dataplane import DataPlane
from kvd.core.metrics import Metrics
from kvd.layout.plan import EngineView
from kvd_client.errors import KvdError, PeerUnavailable

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
        timeout_s: float,
    ) -> PrepareResult: ...

    async def abandon_pull(self, address: str, lease_id: str, reader_tp_rank: int, reason: str, timeout_s: float) -> None: ...

    async def close(self) -> None: ...


@dataclasses.dataclass(eq=False)
class PeerSession:
    address: str
    incarnation: str
    agent_name: str
    engines: dict[tuple[str, int], RemoteEngine]
    handshaken_at: float = dataclasses.field(default_factory=time.monotonic)

    def engine_ranks(self, engine_id: str) -> dict[int, RemoteEngine]:
        return {rank: engine for (eid, rank), engine in self.engines.items() if eid == engine_id}


class Peers:
    """Cached peer sessions. Event-loop only; one handshake in flight per address."""

    def __init__(
        self,
        transport: PeerTransport,
        dataplane: DataPlane,
        metrics: Metrics,
        own_incarnation: Callable[[], str],
        timeout_s: float,
    ) -> None:
        self.transport = transport
        self._dataplane = dataplane
        self._metrics = metrics
        self._own_incarnation = own_incarnation
        self._timeout_s = timeout_s
        self._sessions: dict[str, PeerSession] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def cached(self, address: str) -> PeerSession | None:
        return self._sessions.get(address)

    def sessions(self) -> list[PeerSession]:
        return list(self._sessions.values())

    async def session(self, address: str, expect_incarnation: str = "") -> PeerSession:
        """The peer's session, handshaking if none is cached or the cached one is another incarnation."""
        lock = self._locks.setdefault(address, asyncio.Lock())
        async with lock:
            current = self._sessions.get(address)
            if current is not None and (not expect_incarnation or current.incarnation == expect_incarnation):
                return current
            if current is not None:
                self.drop(address, "incarnation changed")
            return await self._handshake(address)

    async def refresh(self, address: str, reason: str) -> PeerSession:
        """Drop the cached session and handshake again (stale registration ids)."""
        lock = self._locks.setdefault(address, asyncio.Lock())
        async with lock:
            self.drop(address, reason)
            return await self._handshake(address)

    async def _handshake(self, address: str) -> PeerSession:
        try:
            info = await self.transport.handshake(address, self._timeout_s)
        except KvdError:
            self._metrics.handshakes.labels(address, "failed").inc()
            raise
        if info.incarnation == self._own_incarnation():
            self._metrics.handshakes.labels(address, "failed").inc()
            raise PeerUnavailable(f"{address} is this daemon itself: a pull needs a peer daemon")
        agent_name = self._dataplane.add_remote(info.agent_metadata)
        session = PeerSession(
            address=address,
            incarnation=info.incarnation,
            agent_name=agent_name,
            engines={(e.engine_id, e.view.spec.tp_rank): e for e in info.engines},
        )
        self._sessions[address] = session
        self._metrics.handshakes.labels(address, "ok").inc()
        logger.info("handshake with %s: agent %s, %d engine ranks", address, agent_name, len(session.engines))
        return session

    def drop(self, address: str, reason: str) -> None:
        """Forget a peer: its NIXL agent, its prepared tables, its cached layouts."""
        session = self._sessions.pop(address, None)
        if session is None:
            return
        self._metrics.peer_drops.labels(address, reason).inc()
        logger.info("dropping peer %s (agent %s): %s", address, session.agent_name, reason)
        self._dataplane.remove_remote(session.agent_name)

    def drop_all(self) -> None:
        for address in list(self._sessions):
            self.drop(address, "shutdown")
