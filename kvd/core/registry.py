"""Engines registered with this daemon: their layouts, their mapped memory, their event queues."""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
from collections.abc import Iterator
from typing import Any

from kvd.core.events import EngineEvent
from kvd.core.local_memory import LocalMemory
from kvd.core.memory import OpenedRegion
from kvd.layout.plan import EngineView
from kvd.layout.spec import LayerPlacement, LayoutSpec
from kvd_client.errors import AlreadyExists, InvalidArgument, UnknownEngine

logger = logging.getLogger(__name__)

# Events kept for an engine whose stream is not connected (delivered when it reconnects).
MAX_PENDING_EVENTS = 65536

_registration_ids = itertools.count(1)


def next_registration_id() -> int:
    return next(_registration_ids)


@dataclasses.dataclass(eq=False)
class EngineRank:
    """One registered engine rank. ``registration_id`` changes on every (re-)registration."""

    engine_id: str
    spec: LayoutSpec
    placements: tuple[LayerPlacement, ...]
    # The rank's current mapping; a re-map (see Puller) replaces it, so read it where it is used
    # and pin it (kvd.core.local_memory) for as long as a NIXL call may touch it.
    memory: LocalMemory
    require_commits: bool
    engine_pid: int
    # KV cache groups after group 0 (spec + placements): a hybrid model's other groups.
    extra_groups: tuple[EngineView, ...] = ()
    stream_connected: bool = False
    stream_generation: int = 0  # bumped by every attach: a newer stream supersedes an older one
    pending: collections.deque[EngineEvent] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=MAX_PENDING_EVENTS)
    )
    # Set while a stream is attached: the stream's sender awaits it.
    wakeup: Any = None

    @property
    def tp_rank(self) -> int:
        return self.spec.tp_rank

    @property
    def key(self) -> tuple[str, int]:
        return (self.engine_id, self.spec.tp_rank)

    @functools.cached_property
    def view(self) -> EngineView:
        """Group 0 as the planner sees it: one object for the rank's life (its spec, placements and
        groups never change; a re-registration is a new rank), so the planner's caches find it by
        identity. A new view per pull was hashed whole, every placement, on each of its lookups."""
        return EngineView(self.spec, self.placements)

    @functools.cached_property
    def groups(self) -> tuple[EngineView, ...]:
        """Every KV cache group, group 0 (``view``) first (kvd.layout.groups)."""
        return (self.view, *self.extra_groups)

    @property
    def registration_id(self) -> int:
        return self.memory.registration_id

    @property
    def regions(self) -> list[OpenedRegion]:
        return self.memory.regions

    @property
    def region_addresses(self) -> list[int]:
        return self.memory.addresses

    @property
    def device_index(self) -> int:
        return self.memory.device_index

    @property
    def mem_type(self) -> str:
        return self.memory.mem_type

    @property
    def registered_bytes(self) -> int:
        return self.memory.size_bytes

    def post(self, event: EngineEvent) -> None:
        """Queue an event for the engine's stream (kept until a stream takes it)."""
        if len(self.pending) == self.pending.maxlen:
            logger.warning("engine %s rank %d: event queue full, dropping the oldest", self.engine_id, self.tp_rank)
        self.pending.append(event)
        if self.wakeup is not None:
            self.wakeup.set()

    def drain(self) -> list[EngineEvent]:
        events = list(self.pending)
        self.pending.clear()
        return events


class Registry:
    """Engine ranks by (engine_id, tp_rank). Event-loop only."""

    def __init__(self) -> None:
        self._ranks: dict[tuple[str, int], EngineRank] = {}

    def check_can_add(self, engine_id: str, spec: LayoutSpec, groups: tuple[EngineView, ...] = ()) -> None:
        """Raise unless a rank with this id and layout may register (before mapping memory)."""
        if not engine_id:
            raise InvalidArgument("engine_id must not be empty")
        if (engine_id, spec.tp_rank) in self._ranks:
            raise AlreadyExists(f"engine {engine_id!r} rank {spec.tp_rank} is already registered: unregister it first")
        for other in self.ranks_of(engine_id).values():
            for name in ("tp_size", "num_layers", "kv_format", "layout", "block_size", "head_dim", "dtype"):
                if getattr(other.spec, name) != getattr(spec, name):
                    raise InvalidArgument(
                        f"engine {engine_id!r} rank {spec.tp_rank} has {name}={getattr(spec, name)} but rank "
                        f"{other.tp_rank} registered {name}={getattr(other.spec, name)}: ranks of one engine must agree"
                    )
            theirs = tuple(g.kind for g in other.extra_groups)
            if groups and tuple(g.kind for g in groups) != theirs:
                raise InvalidArgument(
                    f"engine {engine_id!r} rank {spec.tp_rank} has KV cache groups {[g.kind.name for g in groups]} "
                    f"after group 0 but rank {other.tp_rank} registered {[k.name for k in theirs]}"
                )

    def add(self, rank: EngineRank) -> None:
        self.check_can_add(rank.engine_id, rank.spec, rank.extra_groups)
        self._ranks[rank.key] = rank

    def remove(self, engine_id: str, tp_rank: int) -> EngineRank:
        rank = self._ranks.pop((engine_id, tp_rank), None)
        if rank is None:
            raise UnknownEngine(f"engine {engine_id!r} rank {tp_rank} is not registered here")
        return rank

    def get(self, engine_id: str, tp_rank: int) -> EngineRank:
        rank = self._ranks.get((engine_id, tp_rank))
        if rank is None:
            known = sorted(self._ranks)
            raise UnknownEngine(f"engine {engine_id!r} rank {tp_rank} is not registered here (registered: {known[:8]})")
        return rank

    def current(self, rank: EngineRank) -> EngineRank | None:
        """``rank`` if it is still the registered one for its key (not unregistered or replaced)."""
        return rank if self._ranks.get(rank.key) is rank else None

    def ranks_of(self, engine_id: str) -> dict[int, EngineRank]:
        return {rank.tp_rank: rank for key, rank in self._ranks.items() if key[0] == engine_id}

    def require_engine(self, engine_id: str) -> dict[int, EngineRank]:
        ranks = self.ranks_of(engine_id)
        if not ranks:
            raise UnknownEngine(f"engine {engine_id!r} is not registered here")
        return ranks

    def __iter__(self) -> Iterator[EngineRank]:
        return iter(list(self._ranks.values()))

    def __len__(self) -> int:
        return len(self._ranks)
