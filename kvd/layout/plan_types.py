"""What both pull planners share: the plan's types and the checks every pair goes through.

:mod:`kvd.layout.plan` (same layout: direct reads) and :mod:`kvd.layout.convert_plan` (any
other pair: staged reads and a conversion) both build :class:`PullPlan` objects from
:class:`EngineView` pairs after the same refusals; :mod:`kvd.layout.convert` runs the
conversions. Keeping these here lets those three modules import each other one way only:
plan -> convert_plan -> convert, all -> plan_types.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from kvd.layout.geometry import DescGeometry
from kvd.layout.spec import KvFormat, LayerPlacement, LayoutSpec
from kvd_client.errors import IncompatibleLayout, InvalidArgument
from kvd_client.v1.schema import KvGroupKind

if TYPE_CHECKING:
    import torch

__all__ = [
    "EngineView",
    "Postprocess",
    "PullPlan",
    "ReadGroup",
    "Target",
    "check_convertible",
    "same_layout",
    "validate_pull",
]


class Postprocess(Protocol):
    """A conversion run after the reads: staging bytes -> the local engine's blocks.

    ``staging`` is the pull's staging chunk (uint8, ``plan.staging_bytes`` long) and
    ``engine_regions`` the local engine's regions (uint8 tensors), both on the device the
    engine's memory lives on. Must be vectorised torch (no Python loop per block).
    """

    def run(self, staging: torch.Tensor, engine_regions: Sequence[torch.Tensor]) -> None: ...


class Target(enum.Enum):
    """Where a read lands on the local side."""

    ENGINE = "engine"  # straight into the engine's blocks
    STAGING = "staging"  # into the daemon's staging pool, converted afterwards


@dataclasses.dataclass(frozen=True)
class EngineView:
    """One engine rank (or one KV cache group of it) as a planner sees it: its layout and where
    its layers live. A single-layout engine is one FULL_ATTENTION group (kvd.layout.groups)."""

    spec: LayoutSpec
    placements: tuple[LayerPlacement, ...]
    kind: KvGroupKind = KvGroupKind.FULL_ATTENTION
    name: str = ""  # the engine's name for the group, for messages
    sliding_window: int = 0  # tokens (SLIDING_WINDOW groups; informational)
    # Which of the request's block id lists the group uses (-1: the one at the group's index);
    # groups of different shapes may share a block table (kvd.layout.groups).
    block_table: int = -1


@dataclasses.dataclass(frozen=True, eq=False)
class ReadGroup:
    """One NIXL transfer: runs of ``remote_geometry`` read into runs of ``local_geometry``."""

    remote_rank: int
    remote_geometry: DescGeometry
    remote_indices: np.ndarray
    local_target: Target
    local_geometry: DescGeometry
    local_indices: np.ndarray
    nbytes: int
    # STAGING reads: where this read's staging area starts inside the pull's staging chunk
    # (several KV cache groups stage side by side).
    staging_offset: int = 0

    @property
    def num_descriptors(self) -> int:
        return int(self.remote_indices.size)


@dataclasses.dataclass(frozen=True, eq=False)
class PullPlan:
    """Everything a pull does, decided before any byte moves."""

    reads: tuple[ReadGroup, ...]
    # Conversion run after the reads (staging -> engine blocks); None for direct reads.
    postprocess: Postprocess | None = None
    staging_bytes: int = 0

    @property
    def num_descriptors(self) -> int:
        return sum(group.num_descriptors for group in self.reads)

    @property
    def total_bytes(self) -> int:
        return sum(group.nbytes for group in self.reads)

    @property
    def direct(self) -> bool:
        return all(group.local_target is Target.ENGINE for group in self.reads)

    @functools.cached_property
    def remote_ranks(self) -> tuple[int, ...]:
        """The holder ranks read from, in order (asked several times per pull: computed once)."""
        return tuple(sorted({group.remote_rank for group in self.reads}))


def check_convertible(remote: LayoutSpec, local: LayoutSpec) -> None:
    """Refuse pairs no conversion can serve, naming both sides' values."""
    mismatches = []
    for name in ("dtype", "head_dim", "num_layers", "total_num_kv_heads"):
        if getattr(remote, name) != getattr(local, name):
            mismatches.append(f"{name}: remote {getattr(remote, name)} vs local {getattr(local, name)}")
    for special in (KvFormat.MLA, KvFormat.PACKED):  # these convert only among themselves
        if (remote.kv_format is special) != (local.kv_format is special):
            mismatches.append(f"kv_format: remote {remote.kv_format.name} vs local {local.kv_format.name}")
            break
    if mismatches:
        raise IncompatibleLayout("KV layouts cannot be converted: " + "; ".join(mismatches))


def validate_pull(
    remote: LayoutSpec,
    local: LayoutSpec,
    remote_block_ids: Sequence[int],
    local_block_ids: Sequence[int],
    num_tokens: int,
) -> None:
    """Raise InvalidArgument unless the block lists and token count agree with both layouts."""
    if num_tokens < 1:
        raise InvalidArgument(f"num_tokens must be >= 1, got {num_tokens}")
    need_local = local.blocks_for(num_tokens)
    if len(local_block_ids) != need_local:
        raise InvalidArgument(
            f"{num_tokens} tokens need {need_local} local blocks of {local.block_size} tokens, "
            f"got {len(local_block_ids)} local block ids"
        )
    need_remote = remote.blocks_for(num_tokens)
    if len(remote_block_ids) < need_remote:
        raise InvalidArgument(
            f"{num_tokens} tokens need {need_remote} remote blocks of {remote.block_size} tokens, "
            f"the holder offered {len(remote_block_ids)}"
        )
    local.validate_block_ids(local_block_ids, "local block ids")
    remote.validate_block_ids(remote_block_ids, "remote block ids")
    if len(set(local_block_ids)) != len(local_block_ids):
        raise InvalidArgument("local block ids repeat a block: two token ranges cannot land in one block")


@functools.lru_cache(maxsize=1024)
def same_layout(remote: LayoutSpec, local: LayoutSpec) -> bool:
    """True when bytes can be copied block for block (only block counts may differ).

    Cached (a spec hashes its fields in one call): every pull asks, with the same two specs."""
    return dataclasses.replace(remote, num_blocks=1, tp_rank=0) == dataclasses.replace(local, num_blocks=1, tp_rank=0)
