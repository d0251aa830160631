"""An engine's links to its node's daemon, by role (the names this module always offered).

* :mod:`kvd_engine.worker_link`: :class:`DaemonLink`, one engine rank's registration, engine
  stream and pull starts, kept alive by a background thread;
* :mod:`kvd_engine.scheduler_link`: :class:`SchedulerLink`, the scheduler process's holds and
  scheduler stream;
* :mod:`kvd_engine.link_events`: what the worker's link reports (:data:`LinkEvent`) and takes
  (:class:`PullOrder`);
* :mod:`kvd_engine.link_client`: how both make their client (:data:`ClientFactory`).

Import from those modules; this one re-exports their public names for existing callers.
"""

from __future__ import annotations

from .link_client import ClientFactory
from .link_events import (
    Connected,
    DaemonGone,
    DaemonMessage,
    Disconnected,
    LinkEvent,
    PullFailed,
    PullInDoubt,
    PullOrder,
    PullStarted,
)
from .scheduler_link import SchedulerLink, held_fields
from .worker_link import MAX_PULLS_PER_CALL, START_ATTEMPTS, DaemonLink

__all__ = [
    "MAX_PULLS_PER_CALL",
    "START_ATTEMPTS",
    "ClientFactory",
    "Connected",
    "DaemonGone",
    "DaemonLink",
    "DaemonMessage",
    "Disconnected",
    "LinkEvent",
    "PullFailed",
    "PullInDoubt",
    "PullOrder",
    "PullStarted",
    "SchedulerLink",
    "held_fields",
]
