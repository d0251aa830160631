"""Pairs no conversion can serve are refused before any byte moves, naming both sides' values.

IncompatibleLayout travels as FAILED_PRECONDITION: the request is fine, the two engines are not.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.layout.convert_plan import plan_conversion
from kvd.layout.plan import EngineView, plan_pull
from kvd.layout.spec import KvFormat, KvLayout, LayoutSpec, contiguous_placements
from kvd_client.errors import ErrorCode, IncompatibleLayout, InvalidArgument


def _spec(**kw: object) -> LayoutSpec:
    base: dict[str, object] = dict(
        num_layers=2,
        kv_format=KvFormat.SPLIT,
        layout=KvLayout.NHD,
        block_size=16,
        num_kv_heads=4,
        head_dim=8,
        dtype="bfloat16",
        num_blocks=8,
        total_num_kv_heads=4,
    )
    base.update(kw)
    return LayoutSpec(**base)  # type: ignore[arg-type]


def _view(spec: LayoutSpec) -> EngineView:
    return EngineView(spec, tuple(contiguous_placements(spec)))


def _holder(spec: LayoutSpec) -> dict[int, EngineView]:
    return {rank: _view(dataclasses.replace(spec, tp_rank=rank)) for rank in range(spec.tp_size)}


def _pull(remote: LayoutSpec, local: LayoutSpec) -> None:
    plan_pull(_holder(remote), _view(local), [0, 1], [0, 1], 20)


@pytest.mark.parametrize(
    ("remote", "local", "words"),
    [
        (dict(dtype="bfloat16"), dict(dtype="float16"), ["dtype", "bfloat16", "float16"]),
        (dict(head_dim=8), dict(head_dim=16), ["head_dim", "8", "16"]),
        (dict(num_layers=2), dict(num_layers=3), ["num_layers", "2", "3"]),
        (dict(num_kv_heads=4), dict(num_kv_heads=2, total_num_kv_heads=2), ["total_num_kv_heads", "4", "2"]),
        (dict(), dict(kv_format=KvFormat.MLA, num_kv_heads=1, total_num_kv_heads=1), ["kv_format", "SPLIT", "MLA"]),
        # 12 heads: 3 per rank at TP 4, 4 per rank at TP 3: neither divides the other.
        (
            dict(num_kv_heads=3, total_num_kv_heads=12, tp_size=4),
            dict(num_kv_heads=4, total_num_kv_heads=12, tp_size=3),
            ["heads per rank", "remote 3", "local 4", "12"],
        ),
    ],
)
def test_refused_pairs_name_both_sides(remote: dict[str, object], local: dict[str, object], words: list[str]) -> None:
    with pytest.raises(IncompatibleLayout) as caught:
        _pull(_spec(**remote), _spec(**local))
    for word in words:
        assert word in caught.value.message
    assert caught.value.code is ErrorCode.FAILED_PRECONDITION


def test_a_holder_without_the_needed_rank_is_refused() -> None:
    remote = _spec(num_kv_heads=2, tp_size=2)
    holder = {0: _view(remote)}  # rank 1 (heads 2..3) never registered
    with pytest.raises(IncompatibleLayout, match="KV head 2"):
        plan_pull(holder, _view(_spec()), [0, 1], [0, 1], 20)


def test_a_holder_whose_ranks_disagree_is_refused() -> None:
    remote = _spec(num_kv_heads=2, tp_size=2)
    holder = {0: _view(remote), 1: _view(dataclasses.replace(remote, tp_rank=1, layout=KvLayout.HND))}
    with pytest.raises(IncompatibleLayout, match="disagree"):
        plan_conversion(holder, _view(_spec()), [0, 1], [0, 1], 20)


def test_block_lists_that_disagree_with_the_tokens_are_invalid() -> None:
    with pytest.raises(InvalidArgument, match="local blocks"):
        plan_pull(_holder(_spec()), _view(_spec(layout=KvLayout.HND)), [0, 1], [0], 20)
    with pytest.raises(InvalidArgument, match="out of range"):
        plan_pull(_holder(_spec()), _view(_spec(layout=KvLayout.HND)), [0, 99], [0, 1], 20)


@settings(max_examples=50, deadline=None)
@given(
    field=st.sampled_from(["dtype", "head_dim", "num_layers"]),
    layout=st.sampled_from(list(KvLayout)),
    block_size=st.sampled_from([1, 4, 16, 64]),
)
def test_any_mismatch_is_refused_whatever_else_differs(field: str, layout: KvLayout, block_size: int) -> None:
    other = {"dtype": "float32", "head_dim": 4, "num_layers": 1}[field]
    with pytest.raises(IncompatibleLayout, match=field):
        _pull(_spec(), _spec(**{field: other, "layout": layout, "block_size": block_size, "num_blocks": 64}))
