"""Thin servicers: validate, call the core, translate. No logic lives here.

One module per service: kvd.server.engine_servicer, kvd.server.peer_servicer and
kvd.server.router_servicer. This module names them together, as kvd.server.app mounts them.
"""

from __future__ import annotations

from kvd.server.engine_servicer import MAX_BATCH_EVENTS, EngineServicer, _event_to_pb, _messages
from kvd.server.lease_info import lease_to_pb as _lease_to_pb
from kvd.server.peer_servicer import PeerServicer
from kvd.server.pull_starts import pull_order as _pull_order
from kvd.server.router_servicer import SELFTEST_SEED_LIMIT, RouterServicer

__all__ = [
    "MAX_BATCH_EVENTS",
    "SELFTEST_SEED_LIMIT",
    "EngineServicer",
    "PeerServicer",
    "RouterServicer",
    "_event_to_pb",
    "_lease_to_pb",
    "_messages",
    "_pull_order",
]
