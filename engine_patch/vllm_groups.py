"""vLLM 0.33's ``KVCacheConfig`` groups as kvd's :class:`~kvd_engine.groups.GroupLayers`.

Imports vLLM: only the connector facade uses it. Every transfer group of the engine becomes one
kvd group; what kvd cannot serve raises :class:`~kvd_client.errors.UnsupportedModelFeature`
naming the model feature (at the connector's construction, so the engine refuses to start with
a message rather than serving a request whose KV silently does not travel).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from kvd_client.errors import UnsupportedModelFeature
from kvd_client.v1.schema import KvGroupKind

from .groups import GroupLayers

__all__ = ["GroupOrder", "groups_of_config"]

# Attention specs whose pages kvd lays out like FullAttention/SlidingWindow ones. Subclasses with
# other semantics (RSWA's evicted gaps, sinks, chunked local attention, ring buffers, encoder or
# cross attention, HiSparse, DeepSeek V4's compressed states) are refused by exact type.
_FULL = (FullAttentionSpec, MLAAttentionSpec)
_WINDOW_NAMES = ("SlidingWindowSpec", "SlidingWindowMLASpec")


class GroupOrder:
    """The engine's KV cache groups in kvd's order (a full-attention group first), and its block
    tables: one per vLLM transfer group, in the order kvd's groups first use them."""

    def __init__(self, config: KVCacheConfig, groups: Sequence[GroupLayers], tables: Sequence[int]) -> None:
        self.config = config
        self.groups = tuple(groups)
        self.tables = tuple(tables)  # kvd block table i = vLLM transfer group tables[i]
        # One group per table, for the per-table clipping (a table's groups share its kind).
        self.table_groups = tuple(next(g for g in self.groups if g.block_table == i) for i in range(len(self.tables)))

    def select(self, block_ids: Sequence[Sequence[int]]) -> tuple[list[int], ...]:
        """vLLM's per-group block lists (all kv_cache_groups) as kvd's block tables."""
        chosen = self.config.select_transfer_block_ids([list(ids) for ids in block_ids])
        return tuple(list(chosen[i]) for i in self.tables)


def _describe(index: int, group: Any) -> list[tuple[GroupLayers, bool]]:
    """One vLLM group as kvd's groups; the bool says full attention (may be group 0).

    A ``UniformTypeKVCacheSpecs`` group (layers of one attention type but different shapes,
    e.g. a drafter with its own head count, sharing one block table) becomes one kvd group per
    shape, each with the vLLM group's block ids.
    """
    spec = group.kv_cache_spec
    if type(spec).__name__ == "UniformTypeKVCacheSpecs":
        by_spec: dict[Any, list[str]] = {}
        for name in group.layer_names:
            by_spec.setdefault(spec.kv_cache_specs[name], []).append(name)
        return [_describe_one(index, layer_spec, tuple(names), group) for layer_spec, names in by_spec.items()]
    return [_describe_one(index, spec, tuple(group.layer_names), group)]


def _describe_one(index: int, spec: Any, layers: tuple[str, ...], group: Any) -> tuple[GroupLayers, bool]:
    draft = group.is_eagle_group or getattr(spec, "is_draft", False)
    name = ("drafter " if draft else "") + type(spec).__name__
    kind_name = type(spec).__name__
    if isinstance(spec, MambaSpec):
        if spec.tp_replicated:
            raise UnsupportedModelFeature(
                f"KV cache group {index} ({name}): a TP-replicated state (PLE conv state) is not served by kvd"
            )
        return (
            GroupLayers(
                KvGroupKind.STATE,
                layers,
                spec.block_size,
                name=f"{name}:{getattr(spec.mamba_type, 'name', spec.mamba_type)}",
                spec_blocks=spec.num_speculative_blocks,
            ),
            False,
        )
    if not isinstance(spec, AttentionSpec):
        raise UnsupportedModelFeature(f"KV cache group {index}: {kind_name} caches are not served by kvd")
    if spec.state_content_bytes is not None or spec.num_head_slots is not None or spec.tokens_per_state != 1:
        raise UnsupportedModelFeature(
            f"KV cache group {index} ({name}): packed attention pages (kv_quant_mode {spec.kv_quant_mode.name}, "
            f"tokens_per_state {spec.tokens_per_state}) are not served by kvd"
        )
    mla = isinstance(spec, MLAAttentionSpec) or kind_name == "SlidingWindowMLASpec"
    if type(spec) in _FULL:
        return GroupLayers(KvGroupKind.FULL_ATTENTION, layers, spec.block_size, mla=mla, name=name), True
    if kind_name in _WINDOW_NAMES:
        assert isinstance(spec, SlidingWindowSpec)
        return (
            GroupLayers(
                KvGroupKind.SLIDING_WINDOW,
                layers,
                spec.block_size,
                mla=mla,
                name=name,
                sliding_window=spec.sliding_window + spec.extra_retained_tokens,
            ),
            False,
        )
    raise UnsupportedModelFeature(
        f"KV cache group {index} ({name}): {kind_name} is not served by kvd "
        "(served: full attention, MLA, sliding window, Mamba / linear-attention state)"
    )


def groups_of_config(config: KVCacheConfig, total_num_kv_heads: int = 0) -> GroupOrder:
    """kvd's view of the engine's transfer groups; a full-attention group goes first."""
    described: list[tuple[GroupLayers, bool]] = []
    source: list[int] = []  # the vLLM transfer group of each kvd group
    for i, g in enumerate(config.transfer_groups):
        for item in _describe(i, g):
            described.append(item)
            source.append(i)
    if not described:
        raise UnsupportedModelFeature("the engine has no KV cache group to transfer")
    full = [i for i, (_, is_full) in enumerate(described) if is_full]
    if not full:
        kinds = sorted({g.kind.name.lower() for g, _ in described})
        raise UnsupportedModelFeature(
            f"a model with no full-attention layer ({', '.join(kinds)} only) is not served by kvd: its request "
            "token count travels with a full-attention group"
        )
    order = [full[0], *(i for i in range(len(described)) if i != full[0])]
    tables: list[int] = []  # vLLM transfer group of each kvd block table
    groups = []
    for i in order:
        group = described[i][0]
        if source[i] not in tables:
            tables.append(source[i])
        groups.append(dataclasses.replace(group, block_table=tables.index(source[i])))
    first = groups[0]
    if not first.mla and total_num_kv_heads:
        groups[0] = dataclasses.replace(first, total_num_kv_heads=total_num_kv_heads)
    return GroupOrder(config, groups, tables)
