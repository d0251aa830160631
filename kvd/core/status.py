"""What GetStatus and ``kvd status`` show of a daemon: :class:`DaemonStatus`, built by
:func:`daemon_status` from the daemon's parts (:meth:`kvd.core.daemon.Daemon.status`)."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from kvd.core.peers import PeerSession
from kvd.core.registry import EngineRank

if TYPE_CHECKING:  # the daemon imports this module
    from kvd.core.daemon import Daemon


@dataclasses.dataclass(frozen=True)
class DaemonStatus:
    """What GetStatus and ``kvd status`` show (a snapshot, built on the event loop)."""

    incarnation: str
    agent_name: str
    peer_address: str
    engines: tuple[EngineRank, ...]
    peers: tuple[PeerSession, ...]
    transfers_in_flight: int
    leases_held: int
    leases_draining: int
    admitted_reads: int
    quarantined_bytes: int
    remote_agents: int
    serving: bool
    uptime_s: float
    # (engine_id, tp_rank) -> (hard-held, soft-held, draining) bytes of that rank's blocks
    held_bytes: dict[tuple[str, int], tuple[int, int, int]] = dataclasses.field(default_factory=dict)
    holds_ended: dict[str, int] = dataclasses.field(default_factory=dict)
    dataplane_pid: int = 0
    dataplane_restarts: int = 0
    dataplane_last_restart: str = ""  # why the last worker was replaced ("" if never)
    # Registrations, scratch holds and mapping releases still running (a call cut short runs to its end).
    finishing_calls: int = 0


def daemon_status(daemon: Daemon) -> DaemonStatus:
    """A snapshot of ``daemon`` from its parts, taken on its event loop."""
    peers, memories, plane, restarts = daemon.peers, daemon.memories, daemon.dataplane, daemon.restarts
    return DaemonStatus(
        incarnation=daemon.incarnation,
        agent_name=daemon.agent_name,
        peer_address=daemon.advertise_address,
        engines=tuple(daemon.registry),
        peers=tuple(peers.sessions()) if peers else (),
        transfers_in_flight=len(daemon.transfers.in_flight()),
        leases_held=len(daemon.leases),
        leases_draining=daemon.leases.draining,
        admitted_reads=daemon.leases.open_admissions,
        quarantined_bytes=memories.quarantined_bytes if memories else 0,
        remote_agents=len(peers.agents()) if peers else 0,
        serving=daemon.serving,
        uptime_s=time.monotonic() - daemon.started_at,
        held_bytes=daemon.holds.held_bytes(),
        holds_ended=dict(daemon.holds.ended),
        dataplane_pid=plane.pid if plane is not None else 0,
        dataplane_restarts=restarts.restarts,
        dataplane_last_restart=restarts.last_restart,
        finishing_calls=len(daemon.engines.finishing)
        + len(daemon.selftest.finishing)
        + (len(memories.finishing) if memories else 0),
    )
