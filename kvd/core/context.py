"""What every part of the daemon shares: :class:`CoreContext`.

:class:`kvd.core.daemon.Daemon` builds one and hands it to each part it composes (engines, holds,
holder, restarts, puller), so that a part's constructor names only what is its own. The tables are
created once and live as long as the daemon; what a data-plane restart replaces (the worker, the
memories bound to it) and what exists only once the daemon runs (the event loop) are getters,
read at the moment of use, never cached by a part.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from collections.abc import Callable

from kvd.config import KvdConfig
from kvd.core.commits import CommitTracker
from kvd.core.dataplane import DataPlane
from kvd.core.holdchecks import HoldChecks
from kvd.core.leases import LeaseTable
from kvd.core.local_memory import Memories
from kvd.core.metrics import Metrics
from kvd.core.registry import Registry
from kvd.core.transfers import TransferTable


@dataclasses.dataclass(frozen=True)
class CoreContext:
    """The daemon's shared tables and getters (module docstring). Event-loop only, as the parts."""

    config: KvdConfig
    metrics: Metrics
    incarnation: str  # this daemon's: peers tell a restarted daemon from the one they knew
    registry: Registry  # the engine ranks registered here
    leases: LeaseTable  # the blocks this daemon holds for readers
    commits: CommitTracker  # speculative decoding's committed tokens per request
    holdchecks: HoldChecks  # the scheduler streams that confirm soft holds
    transfers: TransferTable  # the pulls this daemon runs as a reader
    executor: concurrent.futures.Executor  # blocking work: NIXL table preparation, conversion
    dataplane: Callable[[], DataPlane | None]  # the worker now serving (a restart replaces it)
    memories: Callable[[], Memories]  # the engines' mapped memory (raises Unavailable while starting)
    loop: Callable[[], asyncio.AbstractEventLoop | None]  # the loop every table belongs to, once started
    require_serving: Callable[[], None]  # raises Unavailable once the daemon shuts down
    require_dataplane: Callable[[], None]  # raises Unavailable while a worker restarts
