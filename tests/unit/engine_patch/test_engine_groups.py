"""kvd_engine.groups: block id clipping per group kind, and layouts read off vLLM 0.33 views."""

from __future__ import annotations

import pytest
import torch

from kvd_client.errors import UnsupportedModelFeature
from kvd_client.v1.schema import KvFormat, KvGroupKind
from kvd_engine.groups import GroupLayers, clip_group_blocks, resolve_groups


def test_clipping_keeps_what_each_kind_transfers() -> None:
    full = GroupLayers(KvGroupKind.FULL_ATTENTION, ("a",), 16)
    window = GroupLayers(KvGroupKind.SLIDING_WINDOW, ("b",), 16, sliding_window=20)  # spans <= 3 blocks
    state = GroupLayers(KvGroupKind.STATE, ("c",), 16, spec_blocks=2)
    clipped = clip_group_blocks([full, window, state], [[5, 6, 7, 8], [0, 0, 9, 10], [0, 11, 12, 13]])
    assert clipped == ((5, 6, 7, 8), (9, 10), (11,))  # nulls dropped; scratch blocks dropped
    assert clip_group_blocks([window], [[1, 2, 3, 4, 5]]) == ((3, 4, 5),)
    assert clip_group_blocks([state], [[7]]) == ((7,),)  # the running state even before scratch


def _buffer_views(shape: tuple[int, ...], layers: int, dtype: torch.dtype, block_stride: int = 0) -> list[torch.Tensor]:
    b, h, n, c = shape
    elem = torch.empty((), dtype=dtype).element_size()
    page = block_stride or h * n * c * elem
    raw = torch.zeros(layers * b * page, dtype=torch.int8)
    views = []
    for layer in range(layers):
        view = torch.as_strided(
            raw, (b, h, n, c * elem), (page, n * c * elem, c * elem, 1), storage_offset=layer * b * page
        )
        views.append(view.view(dtype))
    return views


def test_mla_and_state_layouts_from_views() -> None:
    mla = _buffer_views((8, 1, 16, 48), 2, torch.float16)
    state = _buffer_views((8, 1, 1, 100), 2, torch.int8, block_stride=128)  # padded page
    caches = {"m0": mla[0], "m1": mla[1], "s0": state[0], "s1": state[1]}
    groups = [
        GroupLayers(KvGroupKind.FULL_ATTENTION, ("m0", "m1"), 16, mla=True),
        GroupLayers(KvGroupKind.STATE, ("s0", "s1"), 16, block_table=1),
    ]
    rank = resolve_groups(caches, groups, tp_rank=1, tp_size=2)
    latent, states = rank.groups[0].spec_fields, rank.groups[1].spec_fields
    assert latent["kv_format"] == KvFormat.MLA and latent["head_dim"] == 48 and latent["num_kv_heads"] == 1
    assert latent["total_num_kv_heads"] == 1 and latent["tp_rank"] == 1 and latent["tp_size"] == 2
    assert states["block_size"] == 1 and states["head_dim"] == 128  # the whole page, padding included
    assert rank.geometry is None  # no PACKED attention group 0


def test_a_latent_with_several_heads_is_refused() -> None:
    views = _buffer_views((8, 2, 16, 48), 1, torch.float16)
    with pytest.raises(UnsupportedModelFeature, match="2 latent heads per block"):
        resolve_groups(
            {"m": views[0]}, [GroupLayers(KvGroupKind.FULL_ATTENTION, ("m",), 16, mla=True)], tp_rank=0, tp_size=1
        )


def test_missing_layers_are_refused() -> None:
    with pytest.raises(UnsupportedModelFeature, match="no KV cache for layers"):
        resolve_groups({}, [GroupLayers(KvGroupKind.FULL_ATTENTION, ("x",), 16)], tp_rank=0, tp_size=1)
