"""An engine rank's KV cache groups (hybrid models, MLA, drafters) as kvd registers them.

vLLM's hybrid KV cache manager gives each *KV cache group* its own block table: full attention,
sliding-window attention, Mamba / linear-attention state, a drafter whose layers differ from the
target's. vLLM 0.33 hands the connector one ``[B, H, N, C]`` view per layer, every group over
one backing allocation (groups overlay it; a block id belongs to one group at a time).

:class:`GroupLayers` says, free of vLLM types, which layers form a group and what they hold (the
connector builds them from vLLM's ``KVCacheConfig``); :func:`build_group_registration` turns the
views into one ``RegisterKvCacheRequest``: group 0 in ``layout``/``layers`` (what a single-group
engine sends), the others in ``groups``. Per kind:

* attention (full or sliding window): the PACKED ``[B, H, N, 2D]`` views (K|V per token and head),
  as :func:`~kvd_engine.registration.geometry_from_vllm_views` reads them;
* MLA (``mla``): ``[B, 1, N, L]``, one latent of ``kv_lora_rank + rope_dim`` per token, the same
  on every TP rank: ``KV_FORMAT_MLA``, one "head";
* state (Mamba conv + SSM state): ``[B, 1, 1, C]`` bytes per block: ``KV_FORMAT_MLA``, block
  size 1, uint8, one "head" of the block's whole page (padding included).

Also the per-group block id clipping both sides do before a hold or a pull (as vLLM's NIXL
connector's ``get_exchange_clipped_blocks``): a sliding-window group keeps the tail the window
needs, a state group its running-state block.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvd_client.dtypes import DTYPE_OF_NAME
from kvd_client.errors import UnsupportedModelFeature
from kvd_client.v1.schema import KvFormat, KvGroupKind, KvLayout

from .cache_layout import CacheGeometry, dtype_name
from .registration import geometry_from_vllm_views, region_of

logger = logging.getLogger(__name__)

__all__ = ["GroupLayers", "RankGroups", "build_group_registration", "clip_group_blocks", "resolve_groups"]

NULL_BLOCK = 0  # vLLM's null block: a freed (sliding window) or unused slot in a block table


@dataclasses.dataclass(frozen=True)
class GroupLayers:
    """One KV cache group as the connector sees it (vLLM-free)."""

    kind: KvGroupKind
    layer_names: tuple[str, ...]
    block_size: int
    mla: bool = False
    name: str = ""
    sliding_window: int = 0  # tokens; SLIDING_WINDOW only
    spec_blocks: int = 0  # STATE: trailing speculative scratch blocks vLLM co-allocates per request
    total_num_kv_heads: int = 0  # attention: the model's KV heads of this group (0: heads * tp_size)
    block_table: int = 0  # which of the request's block id lists (vLLM block tables) the group uses

    @property
    def window_blocks(self) -> int:
        """Blocks a sliding window may span (vLLM's NIXL connector's bound: one more for alignment)."""
        return math.ceil(self.sliding_window / self.block_size) + 1 if self.sliding_window else 0


@dataclasses.dataclass(frozen=True)
class ResolvedGroup:
    """One group's layout spec fields and its layers' views (group order)."""

    group: GroupLayers
    spec_fields: dict[str, Any]
    views: tuple[torch.Tensor, ...]
    geometry: CacheGeometry | None  # attention groups (PACKED): what NWOR's writers use


@dataclasses.dataclass(frozen=True)
class RankGroups:
    """Every group of one rank, group 0 first."""

    groups: tuple[ResolvedGroup, ...]

    @property
    def geometry(self) -> CacheGeometry | None:
        return self.groups[0].geometry


def clip_group_blocks(groups: Sequence[GroupLayers], block_ids: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """Each block table's transferable blocks: sliding window -> its in-window tail (null blocks
    dropped), state -> the running-state block (speculative scratch blocks dropped), full
    attention -> all. ``groups``: one group per table (any group using it: one table, one kind)."""
    if len(block_ids) != len(groups):
        raise ValueError(f"{len(block_ids)} block lists for {len(groups)} block tables")
    out = []
    for group, ids in zip(groups, block_ids, strict=True):
        blocks = [int(b) for b in ids]
        if group.kind is KvGroupKind.SLIDING_WINDOW:
            blocks = blocks[-group.window_blocks :] if blocks else blocks
            while blocks and blocks[0] == NULL_BLOCK:
                blocks = blocks[1:]
        elif group.kind is KvGroupKind.STATE and blocks:
            scratch = min(group.spec_blocks, len(blocks) - 1)
            if scratch:
                blocks = blocks[:-scratch]
            blocks = blocks[-1:]
        out.append(tuple(blocks))
    return tuple(out)


def _dense_views(group: GroupLayers, views: Sequence[torch.Tensor]) -> tuple[int, int, int, int, tuple[int, ...]]:
    first = views[0]
    if first.dim() != 4:
        raise UnsupportedModelFeature(
            f"KV cache group {group.name or group.kind.name}: layer views of shape {tuple(first.shape)} "
            "are not vLLM 0.33's [blocks, heads, tokens, content]"
        )
    for t in views:
        if t.shape != first.shape or t.stride() != first.stride() or t.dtype != first.dtype:
            raise UnsupportedModelFeature(
                f"KV cache group {group.name or group.kind.name}: its layers differ in shape, strides or dtype"
            )
    b, h, n, c = first.shape
    return b, h, n, c, tuple(first.stride())


def _mla_fields(group: GroupLayers, views: Sequence[torch.Tensor], tp_rank: int, tp_size: int) -> dict[str, Any]:
    blocks, heads, block_size, latent, stride = _dense_views(group, views)
    if heads != 1:
        raise UnsupportedModelFeature(f"MLA group {group.name!r}: {heads} latent heads per block (kvd expects 1)")
    if stride[3] != 1 or stride[2] != latent or stride[0] != block_size * latent:
        raise UnsupportedModelFeature(
            f"MLA group {group.name!r}: latent blocks are not dense (strides {stride}): padded MLA pages "
            "(DeepSeek V4 alignment) are not served by kvd"
        )
    return {
        "num_layers": len(views),
        "kv_format": int(KvFormat.MLA),
        "layout": int(KvLayout.NHD),
        "block_size": block_size,
        "num_kv_heads": 1,
        "total_num_kv_heads": 1,
        "head_dim": latent,
        "dtype": int(DTYPE_OF_NAME[dtype_name(views[0].dtype)]),
        "num_blocks": blocks,
        "tp_rank": tp_rank,
        "tp_size": tp_size,
    }


def _state_fields(group: GroupLayers, views: Sequence[torch.Tensor], tp_rank: int, tp_size: int) -> dict[str, Any]:
    blocks, heads, states, content, stride = _dense_views(group, views)
    elem = views[0].element_size()
    if heads != 1 or states != 1 or stride[3] != 1:
        raise UnsupportedModelFeature(
            f"state group {group.name!r}: views of shape {tuple(views[0].shape)} (strides {stride}) are not "
            "one dense state per block"
        )
    page = stride[0] * elem  # the whole page, padding included: a block is copied whole
    if page < content * elem:
        raise UnsupportedModelFeature(f"state group {group.name!r}: block stride {page} < state size {content * elem}")
    return {
        "num_layers": len(views),
        "kv_format": int(KvFormat.MLA),
        "layout": int(KvLayout.NHD),
        "block_size": 1,
        "num_kv_heads": 1,
        "total_num_kv_heads": 1,
        "head_dim": page,
        "dtype": int(DTYPE_OF_NAME["uint8"]),
        "num_blocks": blocks,
        "tp_rank": tp_rank,
        "tp_size": tp_size,
    }


def resolve_groups(
    kv_caches: Mapping[str, torch.Tensor], groups: Sequence[GroupLayers], *, tp_rank: int, tp_size: int
) -> RankGroups:
    """Each group's layout from its layers' views; raises UnsupportedModelFeature naming the feature."""
    resolved = []
    for group in groups:
        missing = [name for name in group.layer_names if name not in kv_caches]
        if missing:
            raise UnsupportedModelFeature(f"KV cache group {group.name!r}: no KV cache for layers {missing[:4]}")
        views = tuple(kv_caches[name] for name in group.layer_names)
        geometry = None
        if group.kind is KvGroupKind.STATE:
            fields = _state_fields(group, views, tp_rank, tp_size)
        elif group.mla:
            fields = _mla_fields(group, views, tp_rank, tp_size)
        else:
            try:
                geometry = geometry_from_vllm_views(
                    dict(zip(group.layer_names, views, strict=True)),
                    tp_rank=tp_rank,
                    tp_size=tp_size,
                    total_num_kv_heads=group.total_num_kv_heads,
                )
            except ValueError as exc:
                raise UnsupportedModelFeature(f"attention group {group.name!r}: {exc}") from None
            fields = geometry.layout_spec_fields()
        resolved.append(ResolvedGroup(group, fields, views, geometry))
    return RankGroups(tuple(resolved))


def build_group_registration(
    engine_id: str,
    kv_caches: Mapping[str, torch.Tensor],
    rank: RankGroups,
    *,
    require_commits: bool = True,
    engine_pid: int | None = None,
) -> Any:
    """The ``kvd.v1.RegisterKvCacheRequest`` of every group of one rank (one shared region)."""
    from kvd_client.v1 import common_pb2, engine_pb2  # noqa: PLC0415 - protobuf loads with registration

    tensors = [t for g in rank.groups for t in g.views]
    region, base = region_of(tensors)
    messages = []
    for resolved in rank.groups:
        elem = resolved.views[0].element_size()
        placements = [
            common_pb2.LayerPlacement(region=0, k_offset=base + int(t.storage_offset()) * elem, v_offset=0)
            for t in resolved.views
        ]
        messages.append((common_pb2.KvLayoutSpec(**resolved.spec_fields), placements, resolved.group))
    first_layout, first_layers, _ = messages[0]
    return engine_pb2.RegisterKvCacheRequest(
        engine_id=engine_id,
        layout=first_layout,
        regions=[region],
        layers=first_layers,
        require_commits=require_commits,
        engine_pid=os.getpid() if engine_pid is None else engine_pid,
        groups=[
            common_pb2.KvCacheGroup(
                kind=int(group.kind),  # type: ignore[arg-type]
                layout=layout,
                layers=layers,
                sliding_window=group.sliding_window,
                name=group.name,
                block_table=group.block_table + 1,
            )
            for layout, layers, group in messages[1:]
        ],
    )
