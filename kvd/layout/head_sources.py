"""Which remote rank supplies which of the local rank's KV heads, and which pairs no conversion
serves: the first question of every conversion plan (kvd.layout.convert_plan), asked once per
pair of layouts, never per block.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from kvd.layout.plan_types import EngineView, check_convertible
from kvd.layout.spec import KvFormat, LayoutSpec
from kvd_client.errors import IncompatibleLayout

__all__ = ["HeadSource", "check_pair", "choose_sources"]


@dataclasses.dataclass(frozen=True)
class HeadSource:
    """One remote rank's share of the local rank's heads: ``num_heads`` adjacent heads."""

    remote_rank: int
    remote_head0: int  # first head, counted among the remote rank's own heads
    local_head0: int  # where it lands, counted among the local rank's own heads
    num_heads: int


def check_pair(remote: Mapping[int, EngineView], local: LayoutSpec) -> None:
    """Refuse pairs no conversion serves, with a message naming both sides' values.

    On top of :func:`kvd.layout.plan.check_convertible` (dtype, head_dim, layers, total heads,
    MLA vs not): per-rank head counts must divide one another (so a local rank's heads map onto
    whole remote ranks or a slice of one), and the holder's ranks must agree on their layout.
    """
    if not remote:
        raise IncompatibleLayout("the holder has no engine ranks registered")
    first = next(iter(remote.values())).spec
    for rank, view in remote.items():
        if view.spec.tp_rank != rank:
            raise IncompatibleLayout(f"the holder's rank {rank} describes itself as tp_rank {view.spec.tp_rank}")
        if dataclasses.replace(view.spec, num_blocks=1, tp_rank=0) != dataclasses.replace(
            first, num_blocks=1, tp_rank=0
        ):
            raise IncompatibleLayout(
                f"the holder's ranks disagree on their KV layout: {first.describe()} vs {view.spec.describe()}"
            )
    check_convertible(first, local)
    if first.kv_format is not KvFormat.MLA:
        theirs, ours = first.num_kv_heads, local.num_kv_heads
        if theirs % ours and ours % theirs:
            raise IncompatibleLayout(
                "KV layouts cannot be converted: heads per rank do not divide: "
                f"remote {theirs} (tp_size {first.tp_size}) vs local {ours} (tp_size {local.tp_size}) "
                f"of {local.total_num_kv_heads} KV heads"
            )


def choose_sources(remote: Mapping[int, EngineView], local: LayoutSpec) -> list[HeadSource]:
    """Cover the local rank's heads with slices of the holder's ranks.

    Where several remote ranks hold a head (replicas: TP above the head count, or MLA), the
    replica is picked by the local rank so that local ranks spread their reads over replicas.
    """
    if local.kv_format is KvFormat.MLA:
        ranks = sorted(remote)
        rank = local.tp_rank if local.tp_rank in remote else ranks[local.tp_rank % len(ranks)]
        return [HeadSource(rank, 0, 0, 1)]
    ranges = {rank: view.spec.head_range() for rank, view in remote.items()}
    first, last = local.head_range()
    sources: list[HeadSource] = []
    head = first
    while head < last:  # one step per remote rank used: a handful, never per block
        holders = sorted(rank for rank, (start, end) in ranges.items() if start <= head < end)
        if not holders:
            held = ", ".join(f"rank {rank}: heads {start}..{end - 1}" for rank, (start, end) in sorted(ranges.items()))
            raise IncompatibleLayout(
                f"no registered rank of the holder holds KV head {head}, which local rank {local.tp_rank} "
                f"(heads {first}..{last - 1}) needs; the holder registered {held}"
            )
        rank = holders[local.tp_rank % len(holders)]
        start, end = ranges[rank]
        stop = min(last, end)
        sources.append(HeadSource(rank, head - start, head - first, stop - head))
        head = stop
    return sources
