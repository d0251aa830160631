"""What GetStatus and ``kvd status`` show of a daemon: :class:`DaemonStatus`, built by
:meth:`kvd.core.daemon.Daemon.status` from its parts."""

from __future__ import annotations

import dataclasses

from kvd.core.peers import PeerSession
from kvd.core.registry import EngineRank


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
