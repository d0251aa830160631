"""Pulls whose holder is this daemon itself: both engines on one node.

One daemon serves every engine of its node, so a prefill engine and a decode engine on two GPUs
of one node hold and pull through the same daemon. Such a pull runs the same path as any other
(plan, the holder's admission, NIXL READs, the notification that proves them over, the fence):

* **Found by the handshake.** The params name the holder by address; the daemon learns that the
  address is its own when the handshake answers with its own incarnation (any of its addresses:
  the handshake goes over the network like any other, rare and off the hot path).
* **The holder's calls stay in the process.** :class:`LoopbackTransport` wraps the daemon's
  peer transport: calls to an address known to be this daemon go to its own holder methods
  (``prepare_pull``, ``abandon_pull``, ``finish_read``, lease renewals and releases) as
  coroutine calls, with the same arguments, errors and timeouts a peer's servicer gives them,
  and the same reader identity (this incarnation and the pull's transfer id).
* **The READ reads the daemon's own agent.** NIXL serves a transfer whose remote agent is the
  agent itself from its own registrations (no metadata is loaded); the READ's notification comes
  back to the same agent and reaches the holder's bookkeeping like a peer's
  (:mod:`kvd.core.peers` keeps the agent's lists and never loads or removes it).

Nothing of the lifetimes loosens: the holder's admission pins the holder engine's memory, the
reader's pins its own, and a failed pull is fenced before it is reported (docs/lifetimes.md).
Event-loop only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, TypeVar

from kvd.core.peers import AskedAdmission, HandshakeInfo, PeerTransport, PrepareRequest, PrepareResult
from kvd_client.errors import DeadlineExceeded

logger = logging.getLogger(__name__)

T = TypeVar("T")


class LocalHolder(Protocol):
    """The holder side of this daemon (kvd.core.daemon.Daemon), as a peer's servicer calls it."""

    @property
    def incarnation(self) -> str: ...

    async def prepare_pull(
        self, request: PrepareRequest, *, reader_address: str = "", reader_incarnation: str = ""
    ) -> PrepareResult: ...

    def abandon_pull(
        self,
        lease_id: str,
        reader_tp_rank: int,
        reason: str,
        reader_incarnation: str = "",
        reader_transfer_id: str = "",
    ) -> None: ...

    async def finish_read(
        self,
        lease_id: str,
        reader_tp_rank: int,
        reader_incarnation: str = "",
        reader_transfer_id: str = "",
        nbytes: int = 0,
    ) -> None: ...

    def renew_leases(self, lease_ids: Sequence[str]) -> list[str]: ...

    def release_leases(self, lease_ids: Sequence[str], reason: str) -> int: ...


class LoopbackTransport:
    """A :class:`~kvd.core.peers.PeerTransport` that answers calls to this daemon's own addresses
    itself and passes every other call to ``peers`` (the gRPC transport)."""

    def __init__(self, peers: PeerTransport, holder: LocalHolder) -> None:
        self._peers = peers
        self._holder = holder
        self._own: set[str] = set()  # addresses whose handshake answered with this incarnation

    def is_self(self, address: str) -> bool:
        return address in self._own

    async def handshake(self, address: str, timeout_s: float) -> HandshakeInfo:
        info = await self._peers.handshake(address, timeout_s)
        if info.incarnation == self._holder.incarnation:
            if address not in self._own:
                logger.info("%s is this daemon: pulls from it read this node's engines in place", address)
                self._own.add(address)
                await self._peers.forget(address)  # no channel to itself beyond the handshake
        else:
            self._own.discard(address)
        return info

    async def prepare_pull(self, address: str, request: PrepareRequest, timeout_s: float) -> PrepareResult:
        if address not in self._own:
            return await self._peers.prepare_pull(address, request, timeout_s)
        local = dataclasses.replace(request, read_timeout_s=max(0.001, request.read_timeout_s))
        return await _within(
            timeout_s,
            "prepare pull",
            address,
            lambda: self._holder.prepare_pull(
                local, reader_address=address, reader_incarnation=self._holder.incarnation
            ),
        )

    def ask_prepare_pull(self, address: str, request: PrepareRequest, timeout_s: float) -> AskedAdmission | None:
        if address in self._own:
            return None  # this daemon's own holder: prepare_pull answers it in place
        return self._peers.ask_prepare_pull(address, request, timeout_s)

    def flush(self) -> None:
        self._peers.flush()

    async def abandon_pull(
        self, address: str, lease_id: str, reader_tp_rank: int, reader_transfer_id: str, reason: str, timeout_s: float
    ) -> None:
        if address not in self._own:
            await self._peers.abandon_pull(address, lease_id, reader_tp_rank, reader_transfer_id, reason, timeout_s)
            return
        self._holder.abandon_pull(
            lease_id,
            reader_tp_rank,
            reason,
            reader_incarnation=self._holder.incarnation,
            reader_transfer_id=reader_transfer_id,
        )

    async def finish_read(
        self,
        address: str,
        lease_id: str,
        reader_tp_rank: int,
        reader_transfer_id: str,
        timeout_s: float,
        nbytes: int = 0,
    ) -> None:
        if address not in self._own:
            await self._peers.finish_read(address, lease_id, reader_tp_rank, reader_transfer_id, timeout_s, nbytes)
            return
        await _within(
            timeout_s,
            "finish read",
            address,
            lambda: self._holder.finish_read(
                lease_id,
                reader_tp_rank,
                reader_incarnation=self._holder.incarnation,
                reader_transfer_id=reader_transfer_id,
                nbytes=nbytes,
            ),
        )

    async def renew_leases(self, address: str, lease_ids: list[str], timeout_s: float) -> list[str]:
        if address not in self._own:
            return await self._peers.renew_leases(address, lease_ids, timeout_s)
        return self._holder.renew_leases(lease_ids)

    async def release_leases(self, address: str, lease_ids: list[str], reason: str, timeout_s: float) -> None:
        if address not in self._own:
            await self._peers.release_leases(address, lease_ids, reason, timeout_s)
            return
        self._holder.release_leases(lease_ids, reason or "released by the reader")

    async def forget(self, address: str) -> None:
        # An address that answered with this incarnation stays this daemon's for its whole life
        # (a reused address answers the next handshake with another incarnation).
        await self._peers.forget(address)

    async def close(self) -> None:
        self._own.clear()
        await self._peers.close()


async def _within(timeout_s: float, what: str, address: str, call: Callable[[], Awaitable[T]]) -> T:
    """``call()`` bounded as a peer's call is: DeadlineExceeded past ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s):
            return await call()
    except TimeoutError:
        raise DeadlineExceeded(f"{what} at {address} (this daemon) took longer than {timeout_s:.1f}s") from None
