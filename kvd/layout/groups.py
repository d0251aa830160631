"""KV cache groups: an engine rank as a set of groups, and pulls planned per group.

A hybrid model (vLLM's hybrid KV cache manager) keeps one block table per *KV cache group*:
full attention (MLA included), sliding-window attention, Mamba / linear-attention state, and a
drafter whose layers differ from the target's. kvd models an engine rank as a tuple of groups,
each an :class:`~kvd.layout.plan_types.EngineView` with its own spec, placements, kind and
block ids. Group 0 is what a single-layout engine registers; a single-group engine is one group,
and its pulls are planned exactly as before (:func:`kvd.layout.plan.plan_pull`).

Per kind, a request's block list in a group means:

* ``FULL_ATTENTION``: the blocks of tokens ``[0, num_tokens)``;
* ``SLIDING_WINDOW``: the *tail* of those blocks that the window still needs (vLLM frees the
  others before the request finishes); a pull reads only the tokens of the reader's tail;
* ``STATE``: opaque per-request state blocks (Mamba conv + SSM state), the state after exactly
  the held tokens: copied whole, block for block, between ranks of the same TP degree.

Pulls of several groups are one :class:`PullPlan`: the groups' reads concatenated, their staging
areas side by side (:attr:`ReadGroup.staging_offset`), their conversions run one after another.
Pure numpy, no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from kvd.layout import convert_plan
from kvd.layout import plan as same_plan
from kvd.layout.plan_types import EngineView, Postprocess, PullPlan, ReadGroup
from kvd.layout.spec import KvFormat, LayoutSpec
from kvd_client.errors import IncompatibleLayout, InvalidArgument, UnsupportedModelFeature
from kvd_client.v1.schema import KvGroupKind

if TYPE_CHECKING:
    import torch

__all__ = [
    "STAGING_ALIGN",
    "GroupsPostprocess",
    "KvGroupKind",
    "check_group_pair",
    "describe_group",
    "num_tables",
    "plan_groups_pull",
    "state_spec_problems",
    "table_of",
    "validate_groups",
    "validate_hold_groups",
]

STAGING_ALIGN = 256  # each group's staging area starts on this many bytes (word-sized conversions)


def table_of(index: int, view: EngineView) -> int:
    """The block id list group ``index`` uses."""
    return index if view.block_table < 0 else view.block_table


def num_tables(groups: Sequence[EngineView]) -> int:
    """How many block id lists a request of these groups has."""
    return max(table_of(i, g) for i, g in enumerate(groups)) + 1


def describe_group(index: int, view: EngineView) -> str:
    name = f" {view.name!r}" if view.name else ""
    return f"group {index}{name} ({view.kind.name.lower()})"


def state_spec_problems(spec: LayoutSpec) -> list[str]:
    """Why ``spec`` is not a STATE group's layout (empty when it is)."""
    problems = []
    if spec.kv_format is not KvFormat.MLA:
        problems.append(f"kv_format {spec.kv_format.name} (a state group is KV_FORMAT_MLA)")
    if spec.block_size != 1:
        problems.append(f"block_size {spec.block_size} (a state group has one state per block: 1)")
    if spec.dtype != "uint8":
        problems.append(f"dtype {spec.dtype} (a state group is opaque bytes: uint8)")
    return problems


def validate_groups(groups: Sequence[EngineView]) -> None:
    """Raise unless ``groups`` (group 0 first) can describe one engine rank."""
    if not groups:
        raise InvalidArgument("an engine rank needs at least one KV cache group")
    first = groups[0].spec
    for index, view in enumerate(groups):
        what = describe_group(index, view)
        if view.spec.tp_rank != first.tp_rank or view.spec.tp_size != first.tp_size:
            raise InvalidArgument(
                f"{what} says tp {view.spec.tp_rank}/{view.spec.tp_size}, group 0 says {first.tp_rank}/{first.tp_size}"
            )
        if view.kind is KvGroupKind.STATE:
            problems = state_spec_problems(view.spec)
            if problems:
                raise InvalidArgument(f"{what}: invalid Mamba/linear-attention state layout: " + "; ".join(problems))
        elif view.kind not in (KvGroupKind.FULL_ATTENTION, KvGroupKind.SLIDING_WINDOW):
            raise UnsupportedModelFeature(f"{what}: KV cache group kind {view.kind!r} is not served by kvd")
    tables = [table_of(i, g) for i, g in enumerate(groups)]
    if tables[0] != 0:
        raise InvalidArgument(f"group 0 must use block table 0 (block_ids), not {tables[0]}")
    if sorted(set(tables)) != list(range(max(tables) + 1)):
        raise InvalidArgument(f"the groups' block tables {tables} leave a table unused")
    for index, (view, table) in enumerate(zip(groups, tables, strict=True)):
        owner = groups[tables.index(table)]
        if view.kind is not owner.kind or view.spec.num_blocks != owner.spec.num_blocks:
            raise InvalidArgument(
                f"{describe_group(index, view)} shares block table {table} with a "
                f"{owner.kind.name.lower()} group of {owner.spec.num_blocks} blocks: one table, one kind and pool"
            )
    if groups[0].kind is not KvGroupKind.FULL_ATTENTION:
        raise UnsupportedModelFeature(
            f"group 0 is {groups[0].kind.name.lower()}: kvd needs a full-attention group first (its block ids "
            "carry the request's token count); a model with no full-attention layer is not served"
        )


def validate_hold_groups(
    groups: Sequence[EngineView], extra_block_ids: Sequence[Sequence[int]], num_tokens: int
) -> tuple[tuple[int, ...], ...]:
    """The block id lists after the first a hold keeps (clipped to what ``num_tokens`` needs), checked."""
    tables = num_tables(groups)
    if len(extra_block_ids) != tables - 1:
        raise InvalidArgument(
            f"the engine registered {len(groups)} KV cache groups over {tables} block tables: a hold needs "
            f"{tables - 1} block id lists after block_ids, got {len(extra_block_ids)}"
        )
    kept: dict[int, tuple[int, ...]] = {}
    for index, view in enumerate(groups):
        table = table_of(index, view)
        if table == 0:
            continue
        ids = extra_block_ids[table - 1]
        what = describe_group(index, view)
        spec = view.spec
        if view.kind is KvGroupKind.STATE:
            if not ids:
                raise InvalidArgument(f"{what}: a hold needs the request's state block ids")
            clipped = tuple(ids)
        else:
            need = spec.blocks_for(num_tokens)
            if view.kind is KvGroupKind.FULL_ATTENTION and len(ids) < need:
                raise InvalidArgument(
                    f"{what}: {num_tokens} tokens need {need} blocks of {spec.block_size} tokens, got {len(ids)}"
                )
            if view.kind is KvGroupKind.SLIDING_WINDOW and not 1 <= len(ids) <= need:
                raise InvalidArgument(
                    f"{what}: a sliding-window group's ids are the tail of the {need} blocks of {num_tokens} "
                    f"tokens (1..{need} ids), got {len(ids)}"
                )
            clipped = tuple(ids[:need])
        spec.validate_block_ids(clipped, f"{what} held block ids")
        kept[table] = clipped
    return tuple(kept[table] for table in range(1, tables))


def check_group_pair(remote: Sequence[EngineView], local: Sequence[EngineView]) -> None:
    """Refuse pairs of group sets that cannot be pulled, naming the model feature."""
    if len(remote) != len(local):
        raise IncompatibleLayout(
            f"the holder has {len(remote)} KV cache groups, this engine {len(local)}: "
            "hybrid models must be the same model on both sides"
        )
    for index, (r, loc) in enumerate(zip(remote, local, strict=True)):
        if r.kind is not loc.kind:
            raise IncompatibleLayout(
                f"KV cache group {index}: the holder's is {r.kind.name.lower()}, this engine's {loc.kind.name.lower()}"
            )
        if loc.kind is KvGroupKind.STATE:
            if r.spec.tp_size != loc.spec.tp_size:
                raise UnsupportedModelFeature(
                    f"{describe_group(index, loc)}: Mamba/linear-attention state is sharded by tensor parallelism; "
                    f"kvd pulls it only between equal TP degrees (holder TP {r.spec.tp_size}, reader TP "
                    f"{loc.spec.tp_size}): use the same TP on both sides or recompute"
                )
            if r.spec.head_dim != loc.spec.head_dim:
                raise IncompatibleLayout(
                    f"{describe_group(index, loc)}: state blocks of {r.spec.head_dim} bytes (holder) vs "
                    f"{loc.spec.head_dim} bytes (reader): not the same model or state dtype"
                )


@dataclasses.dataclass(frozen=True, eq=False)
class GroupsPostprocess:
    """The conversions of several groups, each on its own slice of the pull's staging chunk."""

    parts: tuple[tuple[int, int, Postprocess], ...]  # (staging offset, staging bytes, conversion)

    def run(self, staging: torch.Tensor, engine_regions: Sequence[torch.Tensor]) -> None:
        for offset, size, postprocess in self.parts:
            postprocess.run(staging[offset : offset + size], engine_regions)


def _window_range(
    kind: KvGroupKind, spec_r: LayoutSpec, spec_l: LayoutSpec, n_remote: int, n_local: int, num_tokens: int
) -> tuple[int, int, int]:
    """``(first remote id, first local id, first token)`` of an attention group's pull."""
    need_l = spec_l.blocks_for(num_tokens)
    need_r = spec_r.blocks_for(num_tokens)
    if kind is KvGroupKind.FULL_ATTENTION:
        return 0, 0, 0
    if not 1 <= n_local <= need_l:
        raise InvalidArgument(f"a sliding-window group's local ids are 1..{need_l} tail blocks, got {n_local}")
    if n_remote > need_r:
        n_remote = need_r
    first_local = need_l - n_local
    start = first_local * spec_l.block_size
    remote_first = need_r - n_remote
    if remote_first * spec_r.block_size > start:
        raise UnsupportedModelFeature(
            f"sliding window: this engine needs tokens from {start} on, the holder kept its window's blocks from "
            f"token {remote_first * spec_r.block_size} only (window or block size differs): recompute"
        )
    if start % spec_r.block_size:
        raise UnsupportedModelFeature(
            f"sliding window: this engine's window starts at token {start}, inside a holder block of "
            f"{spec_r.block_size} tokens: block sizes {spec_r.block_size} -> {spec_l.block_size} are not pulled "
            "for sliding-window groups"
        )
    return start // spec_r.block_size - remote_first, 0, start


def plan_groups_pull(
    remote: Mapping[int, Sequence[EngineView]],
    local: Sequence[EngineView],
    remote_block_ids: Sequence[Sequence[int]],
    local_block_ids: Sequence[Sequence[int]],
    num_tokens: int,
    *,
    max_run_blocks: int = 64,
    direct_read_min_bytes: int = 4096,
    costs: convert_plan.CostModel = convert_plan.DEFAULT_COSTS,
) -> PullPlan:
    """Plan a pull of every group: ``remote`` maps holder ranks to their groups (group 0 first).

    ``remote_block_ids``/``local_block_ids`` hold one list per block table (usually one per
    group). One group: exactly :func:`kvd.layout.plan.plan_pull`.
    """
    if not remote:
        raise IncompatibleLayout("the holder has no engine ranks registered")
    if len(local) == 1 and all(len(groups) == 1 for groups in remote.values()):
        return same_plan.plan_pull(
            {rank: groups[0] for rank, groups in remote.items()},
            local[0],
            remote_block_ids[0],
            local_block_ids[0],
            num_tokens,
            max_run_blocks=max_run_blocks,
            direct_read_min_bytes=direct_read_min_bytes,
            costs=costs,
        )
    any_remote = next(iter(remote.values()))
    check_group_pair(any_remote, local)
    tables = num_tables(local)
    if len(remote_block_ids) != tables or len(local_block_ids) != tables:
        raise InvalidArgument(
            f"{len(local)} KV cache groups over {tables} block tables, but {len(remote_block_ids)} remote and "
            f"{len(local_block_ids)} local block id lists"
        )
    reads: list[ReadGroup] = []
    parts: list[tuple[int, int, Postprocess]] = []
    staging = 0
    for index, view in enumerate(local):
        if table_of(index, view) != table_of(index, any_remote[index]):
            raise IncompatibleLayout(
                f"{describe_group(index, view)}: block table {table_of(index, view)} here, "
                f"{table_of(index, any_remote[index])} at the holder: not the same model"
            )
        r_ids = list(remote_block_ids[table_of(index, view)])
        l_ids = list(local_block_ids[table_of(index, view)])
        views = {rank: groups[index] for rank, groups in remote.items()}
        if view.kind is KvGroupKind.STATE:
            if len(r_ids) != len(l_ids):
                raise InvalidArgument(
                    f"{describe_group(index, view)}: the holder offers {len(r_ids)} state blocks, "
                    f"this engine gave {len(l_ids)}"
                )
            if view.spec.tp_rank not in views:
                raise IncompatibleLayout(
                    f"{describe_group(index, view)}: the holder has no rank {view.spec.tp_rank} for this rank's state"
                )
            views = {view.spec.tp_rank: views[view.spec.tp_rank]}  # state is sharded: same rank only
            group_plan = same_plan.plan_pull(
                views,
                view,
                r_ids,
                l_ids,
                len(l_ids),
                max_run_blocks=max_run_blocks,
                direct_read_min_bytes=0,
                costs=costs,
            )
        else:
            spec_r = next(iter(views.values())).spec
            r_first, _, start = _window_range(view.kind, spec_r, view.spec, len(r_ids), len(l_ids), num_tokens)
            group_plan = same_plan.plan_pull(
                views,
                view,
                r_ids[r_first:],
                l_ids,
                num_tokens - start,
                max_run_blocks=max_run_blocks,
                direct_read_min_bytes=direct_read_min_bytes,
                costs=costs,
            )
        offset = -(-staging // STAGING_ALIGN) * STAGING_ALIGN
        for read in group_plan.reads:
            reads.append(dataclasses.replace(read, staging_offset=offset) if group_plan.staging_bytes else read)
        if group_plan.postprocess is not None:
            parts.append((offset, group_plan.staging_bytes, group_plan.postprocess))
        if group_plan.staging_bytes:
            staging = offset + group_plan.staging_bytes
    postprocess = GroupsPostprocess(tuple(parts)) if parts else None
    return PullPlan(reads=tuple(reads), postprocess=postprocess, staging_bytes=staging)
