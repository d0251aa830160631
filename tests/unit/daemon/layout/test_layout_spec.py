"""kvd.layout.spec: a KV cache layout, validated on construction, with its sizes and placements."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.layout.spec import (
    DTYPE_SIZES,
    KvFormat,
    KvLayout,
    LayerPlacement,
    LayoutSpec,
    contiguous_placements,
)
from kvd_client.errors import InvalidArgument


def _spec(**changes: Any) -> LayoutSpec:
    fields: dict[str, Any] = dict(
        num_layers=4,
        kv_format=KvFormat.SPLIT,
        layout=KvLayout.NHD,
        block_size=16,
        num_kv_heads=8,
        head_dim=128,
        dtype="bfloat16",
        num_blocks=10,
    )
    fields.update(changes)
    return LayoutSpec(**fields)


# --- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_layers": 0}, "num_layers must be >= 1, got 0"),
        ({"block_size": -16}, "block_size must be >= 1, got -16"),
        ({"num_kv_heads": 0}, "num_kv_heads must be >= 1, got 0"),
        ({"head_dim": 0}, "head_dim must be >= 1, got 0"),
        ({"num_blocks": 0}, "num_blocks must be >= 1, got 0"),
        ({"tp_size": 0}, "tp_size must be >= 1, got 0"),
        ({"dtype": "int4"}, "dtype 'int4' is not one of"),
        ({"tp_rank": 2, "tp_size": 2, "num_kv_heads": 4, "total_num_kv_heads": 8}, "tp_rank 2 is not in 0..tp_size-1"),
        ({"tp_rank": -1}, "tp_rank -1 is not in 0..tp_size-1"),
        ({"kv_format": KvFormat.MLA, "num_kv_heads": 2}, "an MLA cache has one latent 'head', got num_kv_heads 2"),
        ({"num_kv_heads": 3, "total_num_kv_heads": 8, "tp_size": 3}, "neither divides the other"),
        ({"num_kv_heads": 8, "total_num_kv_heads": 8, "tp_size": 2}, "expected 4"),
        ({"num_kv_heads": 2, "total_num_kv_heads": 2, "tp_size": 8}, "expected 1"),
    ],
)
def test_invalid_layouts_are_refused_with_a_precise_message(changes: dict[str, Any], message: str) -> None:
    """Each bad field gives InvalidArgument naming the field and the value."""
    with pytest.raises(InvalidArgument, match=re.escape(message)) as info:
        _spec(**changes)
    assert str(info.value).startswith("invalid KV layout: ")


def test_several_problems_are_reported_together() -> None:
    """A layout with several bad fields names each of them in one error."""
    with pytest.raises(InvalidArgument) as info:
        _spec(num_layers=0, head_dim=0, dtype="int4")
    assert all(name in str(info.value) for name in ("num_layers", "head_dim", "dtype"))


def test_negative_total_heads_are_refused() -> None:
    """total_num_kv_heads < 0 is not a model's head count (0 means 'same as num_kv_heads')."""
    with pytest.raises(InvalidArgument, match="total_num_kv_heads"):
        _spec(num_kv_heads=1, total_num_kv_heads=-1)


def test_total_heads_default_to_local_heads() -> None:
    """total_num_kv_heads 0 means no TP slicing: it becomes num_kv_heads."""
    assert _spec(num_kv_heads=8).total_num_kv_heads == 8


def test_spec_is_frozen_and_hashable() -> None:
    """A spec cannot be changed after validation, and equal specs compare equal."""
    spec = _spec()
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.num_blocks = 3  # type: ignore[misc]
    assert spec == _spec() and hash(spec) == hash(_spec())


# --- sizes --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", sorted(DTYPE_SIZES))
@pytest.mark.parametrize("kv_format", list(KvFormat))
def test_block_bytes_and_stride(kv_format: KvFormat, dtype: str) -> None:
    """block_bytes is one plane of one block; JOINT blocks are twice as far apart (K then V);
    a PACKED plane holds K|V vectors, twice head_dim."""
    heads = 1 if kv_format is KvFormat.MLA else 8
    spec = _spec(kv_format=kv_format, dtype=dtype, num_kv_heads=heads, head_dim=64, block_size=16)
    elem = DTYPE_SIZES[dtype]
    vector = 2 * 64 * elem if kv_format is KvFormat.PACKED else 64 * elem
    assert spec.elem_size == elem
    assert spec.head_bytes_per_token == vector
    assert spec.token_bytes == heads * vector
    assert spec.block_bytes == 16 * heads * vector
    assert spec.block_stride == (2 * spec.block_bytes if kv_format is KvFormat.JOINT else spec.block_bytes)
    assert spec.kv_planes == (1 if kv_format in (KvFormat.MLA, KvFormat.PACKED) else 2)
    assert spec.layer_bytes == 10 * spec.block_bytes * spec.kv_planes
    assert spec.total_bytes == 4 * spec.layer_bytes


def test_llama_8b_block_bytes() -> None:
    """Llama-3-8B per rank, bf16, block 16: a K block is 16*8*128*2 = 32 KiB."""
    spec = _spec(num_layers=32, num_blocks=1000)
    assert spec.block_bytes == 32768
    assert spec.total_bytes == 32 * 2 * 1000 * 32768


@settings(deadline=None)
@given(tokens=st.integers(1, 100_000), block=st.sampled_from([1, 8, 16, 32, 128]))
def test_blocks_for_is_ceiling(tokens: int, block: int) -> None:
    """blocks_for(n) is the fewest blocks holding n tokens."""
    n = _spec(block_size=block).blocks_for(tokens)
    assert (n - 1) * block < tokens <= n * block


# --- head_range ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("total", "tp", "expected"),
    [
        (8, 1, [(0, 8)]),
        (8, 2, [(0, 4), (4, 8)]),
        (8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)]),
        (8, 8, [(i, i + 1) for i in range(8)]),
        (2, 8, [(0, 1)] * 4 + [(1, 2)] * 4),  # replicas: 4 ranks per head
        (1, 4, [(0, 1)] * 4),
    ],
)
def test_head_range_for_tp_slices_and_replicas(total: int, tp: int, expected: list[tuple[int, int]]) -> None:
    """Each rank holds its slice of the model's heads; with TP > heads, ranks share (replicate) a head."""
    ranges = [
        _spec(num_kv_heads=max(1, total // tp), total_num_kv_heads=total, tp_size=tp, tp_rank=rank).head_range()
        for rank in range(tp)
    ]
    assert ranges == expected


@settings(deadline=None)
@given(total=st.sampled_from([1, 2, 4, 8, 16]), tp=st.sampled_from([1, 2, 4, 8, 16, 32]))
def test_head_ranges_cover_every_head(total: int, tp: int) -> None:
    """Across all ranks the head ranges cover 0..total-1; each rank holds num_kv_heads heads."""
    covered: set[int] = set()
    for rank in range(tp):
        spec = _spec(num_kv_heads=max(1, total // tp), total_num_kv_heads=total, tp_size=tp, tp_rank=rank)
        start, stop = spec.head_range()
        assert stop - start == spec.num_kv_heads
        covered |= set(range(start, stop))
    assert covered == set(range(total))


def test_mla_head_range_is_the_latent() -> None:
    """An MLA cache (any TP) holds the one latent 'head'."""
    spec = _spec(kv_format=KvFormat.MLA, num_kv_heads=1, tp_size=4, tp_rank=3)
    assert spec.head_range() == (0, 1)


# --- placements ---------------------------------------------------------------------------------


def _span(spec: LayoutSpec) -> int:
    return spec.num_blocks * spec.block_bytes * (2 if spec.kv_format is KvFormat.JOINT else 1)


@pytest.mark.parametrize("kv_format", list(KvFormat))
@pytest.mark.parametrize("base", [0, 4096])
def test_contiguous_placements_fit_exactly(kv_format: KvFormat, base: int) -> None:
    """Layers back to back fill exactly base + total_bytes; one byte less does not fit."""
    spec = _spec(kv_format=kv_format, num_kv_heads=1 if kv_format is KvFormat.MLA else 8)
    placements = contiguous_placements(spec, region=1, base=base)
    assert len(placements) == spec.num_layers
    assert [p.k_offset for p in placements] == [base + i * spec.layer_bytes for i in range(spec.num_layers)]
    spec.validate_placements(placements, [0, base + spec.total_bytes])
    with pytest.raises(InvalidArgument, match="fall outside region 1"):
        spec.validate_placements(placements, [0, base + spec.total_bytes - 1])


def test_contiguous_split_placements_put_v_after_k() -> None:
    """For SPLIT, each layer's V blocks follow its K blocks."""
    spec = _spec()
    for p in contiguous_placements(spec):
        assert p.v_offset == p.k_offset + spec.num_blocks * spec.block_bytes
        assert spec.plane_offsets(p) == (p.k_offset, p.v_offset)


def test_plane_offsets_per_format() -> None:
    """JOINT's V plane starts one block after K inside each block pair; MLA has one plane."""
    joint = _spec(kv_format=KvFormat.JOINT)
    assert joint.plane_offsets(LayerPlacement(0, 100)) == (100, 100 + joint.block_bytes)
    mla = _spec(kv_format=KvFormat.MLA, num_kv_heads=1)
    assert mla.plane_offsets(LayerPlacement(0, 100, 999)) == (100,)


def test_validate_placements_needs_one_per_layer() -> None:
    """Fewer or more placements than layers are refused."""
    spec = _spec()
    with pytest.raises(InvalidArgument, match="3 layer placements for a 4-layer cache"):
        spec.validate_placements(contiguous_placements(spec)[:3], [spec.total_bytes])


def test_validate_placements_region_out_of_range() -> None:
    """A placement naming a region that was not given is refused."""
    spec = _spec(num_layers=1)
    with pytest.raises(InvalidArgument, match="layer 0 names region 2, but 2 regions were given"):
        spec.validate_placements([LayerPlacement(2, 0, _span(spec))], [1 << 30, 1 << 30])
    with pytest.raises(InvalidArgument, match="names region -1"):
        spec.validate_placements([LayerPlacement(-1, 0, _span(spec))], [1 << 30])


@pytest.mark.parametrize("kv_format", list(KvFormat))
def test_validate_placements_out_of_region(kv_format: KvFormat) -> None:
    """A layer whose blocks run past the region's end, or start before it, is refused."""
    spec = _spec(num_layers=1, kv_format=kv_format, num_kv_heads=1 if kv_format is KvFormat.MLA else 8)
    span = _span(spec)
    size = 3 * span
    v = span if kv_format is KvFormat.SPLIT else 0
    spec.validate_placements([LayerPlacement(0, size - span if kv_format is not KvFormat.SPLIT else 0, v)], [size])
    with pytest.raises(InvalidArgument, match=r"layer 0: bytes \[.*\) fall outside region 0"):
        spec.validate_placements([LayerPlacement(0, size - span + 1, v)], [size])
    with pytest.raises(InvalidArgument, match="fall outside"):
        spec.validate_placements([LayerPlacement(0, -1, v)], [size])


def test_validate_placements_v_out_of_region() -> None:
    """For SPLIT, the V plane is checked against the region too."""
    spec = _spec(num_layers=1)
    span = _span(spec)
    with pytest.raises(InvalidArgument, match="fall outside"):
        spec.validate_placements([LayerPlacement(0, 0, span + 1)], [2 * span])


def test_validate_placements_overlapping_k_and_v() -> None:
    """For SPLIT, K and V planes that share a byte are refused; adjacent planes are fine."""
    spec = _spec(num_layers=1)
    span = _span(spec)
    spec.validate_placements([LayerPlacement(0, 0, span)], [2 * span])  # adjacent
    spec.validate_placements([LayerPlacement(0, span, 0)], [2 * span])  # V first
    for v in (span - 1, 0, 1):
        with pytest.raises(InvalidArgument, match="K at 0 and V at .* overlap"):
            spec.validate_placements([LayerPlacement(0, 0, v)], [4 * span])
    with pytest.raises(InvalidArgument, match="overlap"):
        spec.validate_placements([LayerPlacement(0, span - 1, 0)], [4 * span])


def test_validate_block_ids() -> None:
    """Block ids outside 0..num_blocks-1 are refused, naming them and the valid range."""
    spec = _spec(num_blocks=10)
    spec.validate_block_ids([0, 9], "local block ids")
    with pytest.raises(InvalidArgument, match=r"local block ids: block ids \[10, -1\] out of range 0..9"):
        spec.validate_block_ids([0, 10, -1], "local block ids")


def test_describe_names_the_layout() -> None:
    """describe() is a short human summary used in error messages."""
    text = _spec(num_kv_heads=4, total_num_kv_heads=8, tp_size=2, tp_rank=1).describe()
    assert text == "SPLIT/NHD layers=4 block_size=16 heads=4/8 head_dim=128 dtype=bfloat16 tp=1/2"
