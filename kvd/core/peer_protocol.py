"""What the core asks of a peer daemon, and what it answers: :class:`PeerTransport` and its
request and answer records.

The core reaches peers only through this protocol (implemented over gRPC in ``kvd.server``, and
by kvd.core.loopback for the daemon itself), so the core holds no gRPC. A handshake gives a
peer's NIXL agent metadata and its engines' layouts and region addresses
(:class:`HandshakeInfo`); a PreparePull asks the holder to admit one read (:class:`PrepareRequest`,
one record wherever the request travels).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from kvd.core.dataplane import NixlRegion
from kvd.layout.plan import EngineView
from kvd_client.errors import DeadlineExceeded, KvdError, PeerUnavailable, Unavailable


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
    # A reader may post its READ beside the admission (EngineDescriptor.early_reads in peer.proto).
    early_reads: bool = False
    # This holder decodes a step's READ notification (EngineDescriptor.step_notifications in peer.proto).
    step_notifications: bool = False
    # This holder ends a hard hold's read on the reader's FinishRead too, so a reader may post its
    # READs without a notification (EngineDescriptor.finish_read_ends_reads in peer.proto).
    finish_read_ends_reads: bool = False

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
    # Exactly the regions agent_metadata names; () from a peer that does not list them.
    regions: tuple[NixlRegion, ...] = ()
    # How long after asking for this answer a READ beside its admission may still be posted against
    # the memory it names (HandshakeResponse.early_read_window_ms); 0: only after the admission.
    early_read_window_s: float = 0.0

    def engines_by_rank(self) -> dict[tuple[str, int], RemoteEngine]:
        """The peer's engines keyed as a session keeps them: (engine id, TP rank)."""
        return {(e.engine_id, e.view.spec.tp_rank): e for e in self.engines}

    def named_regions(self) -> frozenset[NixlRegion]:
        """The regions the metadata names (a peer that does not list them: its engines' regions)."""
        if self.regions:
            return frozenset(self.regions)
        return frozenset(
            NixlRegion(address, size, engine.device_index, engine.vram, 0)
            for engine in self.engines
            for address, size in zip(engine.region_addresses, engine.region_sizes, strict=True)
        )


@dataclasses.dataclass(frozen=True)
class PrepareRequest:
    """A reader's PreparePull: the read it asks the holder to admit (peer.proto's
    PreparePullRequest, less what the transport adds: the reader's incarnation and address)."""

    lease_id: str
    engine_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    reader_tp_rank: int
    reader_tp_size: int
    remote_tp_ranks: tuple[int, ...]  # the holder's ranks the reader will read
    reader_transfer_id: str = ""  # with the reader's incarnation it names the admitted read
    read_timeout_s: float = 0.0  # how long the reader may still read; 0: the holder's transfer_deadline_s
    group_block_ids: tuple[tuple[int, ...], ...] = ()  # the lease's groups after group 0 (hybrid models)
    read_id: str = ""  # the reader's name for the read: its READ is posted beside the admission
    registration_ids: tuple[int, ...] = ()  # the holder registrations planned against (checked with read_id)


@dataclasses.dataclass(frozen=True)
class PrepareResult:
    registration_ids: tuple[int, ...]
    notif_tag: str
    verify_after_read: bool = False  # a soft hold: FinishRead must succeed before the pull is done


class AskedAdmission(Protocol):
    """A PreparePull already queued to its holder (:meth:`PeerTransport.ask_prepare_pull`)."""

    async def answer(self) -> PrepareResult:
        """The holder's answer, as :meth:`PeerTransport.prepare_pull` returns or raises it (its
        timeout counted from the ask); a cancel of this wait withdraws the call."""
        ...

    def withdraw(self) -> None:
        """Nobody will await the answer (the pull ended before its task ran): the holder is told
        to stop working on it. A no-op once answered."""


class PeerTransport(Protocol):
    """How the core reaches a peer daemon (implemented over gRPC in ``kvd.server``)."""

    async def handshake(self, address: str, timeout_s: float) -> HandshakeInfo: ...

    async def prepare_pull(self, address: str, request: PrepareRequest, timeout_s: float) -> PrepareResult: ...

    def ask_prepare_pull(self, address: str, request: PrepareRequest, timeout_s: float) -> AskedAdmission | None:
        """Queue the PreparePull now, without awaiting anything, to leave at the next
        :meth:`flush`: how StartPulls sends a pull's admission before it returns. None where the
        transport cannot (the caller then awaits :meth:`prepare_pull`)."""

    def flush(self) -> None:
        """Send the calls asked so far now, where that needs no await (the rest leave as the
        transport's own tasks write them)."""

    async def abandon_pull(
        self, address: str, lease_id: str, reader_tp_rank: int, reader_transfer_id: str, reason: str, timeout_s: float
    ) -> None: ...

    async def finish_read(
        self,
        address: str,
        lease_id: str,
        reader_tp_rank: int,
        reader_transfer_id: str,
        timeout_s: float,
        nbytes: int = 0,
    ) -> None:
        """The read's READs are final: a soft hold's holder verifies its blocks again (an error fails
        the pull); a hard hold's read ends (its READs carried no notification: ``nbytes`` they moved)."""

    async def renew_leases(self, address: str, lease_ids: list[str], timeout_s: float) -> list[str]:
        """Reader heartbeats; returns the ids the holder no longer holds."""
        ...

    async def release_leases(self, address: str, lease_ids: list[str], reason: str, timeout_s: float) -> None:
        """Nobody will read these leases."""

    async def forget(self, address: str) -> None:
        """Close the channel to a dropped peer."""

    async def close(self) -> None: ...


def unreachable(exc: KvdError) -> bool:
    """Errors that say the peer cannot be reached (as opposed to refusing a request)."""
    return isinstance(exc, PeerUnavailable) or type(exc) in (Unavailable, DeadlineExceeded)
