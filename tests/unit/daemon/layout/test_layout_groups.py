"""Pulls of hybrid models' KV cache groups, checked against the oracle; the groups' refusals.

A hybrid engine here is a full-attention group, a sliding-window group and a Mamba-like state
group over one region (each group's layers in its own span), as vLLM's hybrid KV cache manager
hands them to kvd. Plans are executed by the reference executor (torch byte copies standing in for
NIXL) and every group's bytes are compared with the oracle's gather of the holder's.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.layout import oracle
from kvd.layout.groups import check_group_pair, plan_groups_pull, validate_groups, validate_hold_groups
from kvd.layout.plan import EngineView, plan_pull
from kvd.layout.spec import KvFormat, KvLayout, LayerPlacement, LayoutSpec, contiguous_placements
from kvd_client.errors import IncompatibleLayout, InvalidArgument, UnsupportedModelFeature
from kvd_client.v1.schema import KvGroupKind

BLOCKS = 12
STATE_BYTES = 40


def _attention(block_size: int, layout: KvLayout, kv_format: KvFormat, tp_size: int = 1) -> LayoutSpec:
    return LayoutSpec(
        num_layers=2,
        kv_format=kv_format,
        layout=layout,
        block_size=block_size,
        num_kv_heads=2,
        head_dim=4,
        dtype="float16",
        num_blocks=BLOCKS,
        total_num_kv_heads=2 * tp_size,
        tp_size=tp_size,
    )


def _state(tp_size: int = 1) -> LayoutSpec:
    return LayoutSpec(
        num_layers=2,
        kv_format=KvFormat.MLA,
        layout=KvLayout.NHD,
        block_size=1,
        num_kv_heads=1,
        head_dim=STATE_BYTES,
        dtype="uint8",
        num_blocks=BLOCKS,
        tp_size=tp_size,
    )


def hybrid(
    full_block: int = 4,
    window_block: int = 4,
    layout: KvLayout = KvLayout.NHD,
    kv_format: KvFormat = KvFormat.SPLIT,
    tp_size: int = 1,
) -> tuple[tuple[EngineView, ...], int]:
    """Full attention, sliding window and state groups laid out one after another in region 0."""
    specs = [
        (KvGroupKind.FULL_ATTENTION, _attention(full_block, layout, kv_format, tp_size)),
        (KvGroupKind.SLIDING_WINDOW, _attention(window_block, layout, kv_format, tp_size)),
        (KvGroupKind.STATE, _state(tp_size)),
    ]
    groups = []
    base = 0
    for kind, spec in specs:
        groups.append(EngineView(spec, tuple(contiguous_placements(spec, base=base)), kind=kind))
        base += spec.total_bytes
    return tuple(groups), base


def _pull(
    remote: tuple[EngineView, ...],
    local: tuple[EngineView, ...],
    remote_ids: tuple[list[int], ...],
    local_ids: tuple[list[int], ...],
    num_tokens: int,
    remote_size: int,
    local_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, oracle.ExecutionLog]:
    plan = plan_groups_pull({0: remote}, local, remote_ids, local_ids, num_tokens, max_run_blocks=4)
    gen = torch.Generator().manual_seed(num_tokens)
    remote_region = torch.randint(0, 256, (remote_size,), dtype=torch.uint8, generator=gen)
    local_region = torch.randint(0, 256, (local_size,), dtype=torch.uint8, generator=gen)
    before = local_region.clone()
    log = oracle.execute_plan(plan, {0: [remote_region]}, [local_region])
    return remote_region, local_region, before, log


@settings(max_examples=40, deadline=None)
@given(
    num_tokens=st.integers(1, 40),
    full_blocks=st.sampled_from([(4, 4), (4, 8), (8, 4)]),
    layout=st.sampled_from([(KvLayout.NHD, KvLayout.NHD), (KvLayout.NHD, KvLayout.HND)]),
    window=st.integers(1, 12),
    state_blocks=st.integers(1, 2),
    seed=st.integers(0, 1000),
)
def test_every_group_lands_exactly(
    num_tokens: int,
    full_blocks: tuple[int, int],
    layout: tuple[KvLayout, KvLayout],
    window: int,
    state_blocks: int,
    seed: int,
) -> None:
    """Full attention: every token (block size and layout converted); sliding window: the reader's
    tail; state: whole blocks. Nothing else of the reader's memory changes."""
    remote, r_size = hybrid(full_blocks[0], layout=layout[0])
    local, l_size = hybrid(full_blocks[1], layout=layout[1])
    rng = np.random.default_rng(seed)
    wb = 4
    need_w = -(-num_tokens // wb)
    tail = min(need_w, -(-window // wb) + 1)

    def ids(spec: LayoutSpec, count: int) -> list[int]:
        return [int(b) for b in rng.permutation(np.arange(1, BLOCKS))[:count]]

    remote_ids = (
        ids(remote[0].spec, remote[0].spec.blocks_for(num_tokens)),
        ids(remote[1].spec, tail),
        ids(remote[2].spec, state_blocks),
    )
    local_ids = (
        ids(local[0].spec, local[0].spec.blocks_for(num_tokens)),
        ids(local[1].spec, tail),
        ids(local[2].spec, state_blocks),
    )
    r_region, l_region, before, log = _pull(remote, local, remote_ids, local_ids, num_tokens, r_size, l_size)
    assert int(log.engine_writes.__getitem__(0).max()) <= 1  # every byte written at most once
    written = np.zeros(l_size, dtype=bool)
    for index in range(3):
        want = oracle.gather_group([r_region], remote[index], remote_ids[index], num_tokens)
        got = oracle.gather_group([l_region], local[index], local_ids[index], num_tokens)
        assert torch.equal(got, want), f"group {index}"
        first, last = oracle.group_tokens(local[index], local_ids[index], num_tokens)
        written |= oracle.token_mask([l_size], local[index], local_ids[index], last - first)[0]
    untouched = torch.from_numpy(~written)
    assert torch.equal(l_region[untouched], before[untouched])  # other blocks, other tokens: unchanged


def test_one_group_is_planned_as_before() -> None:
    spec = _attention(4, KvLayout.NHD, KvFormat.SPLIT)
    view = EngineView(spec, tuple(contiguous_placements(spec)))
    ids = [3, 1, 5]
    old = plan_pull({0: view}, view, ids, ids, 10)
    new = plan_groups_pull({0: (view,)}, (view,), (ids,), (ids,), 10)
    assert [r.nbytes for r in new.reads] == [r.nbytes for r in old.reads]
    assert [r.remote_indices.tolist() for r in new.reads] == [r.remote_indices.tolist() for r in old.reads]


def test_groups_sharing_a_block_table_read_the_same_ids() -> None:
    """A drafter with its own shape in the target's block table: its layers read the same blocks."""
    target = _attention(4, KvLayout.NHD, KvFormat.SPLIT)
    drafter = dataclasses.replace(target, num_layers=1, head_dim=8)
    groups = (
        EngineView(target, tuple(contiguous_placements(target))),
        EngineView(drafter, tuple(contiguous_placements(drafter, base=target.total_bytes)), block_table=0),
    )
    validate_groups(groups)
    size = target.total_bytes + drafter.total_bytes
    r_region, l_region, _, _ = _pull(groups, groups, ([2, 4, 6],), ([7, 8, 9],), 11, size, size)
    for view in groups:
        want = oracle.gather([r_region], view, [2, 4, 6], 11)
        assert torch.equal(oracle.gather([l_region], view, [7, 8, 9], 11), want)


@pytest.mark.parametrize("holder_tp,reader_tp", [(2, 1), (2, 2), (4, 2), (1, 2)])
def test_mla_reader_ranks_spread_over_holder_replicas(holder_tp: int, reader_tp: int) -> None:
    """MLA is replicated on every TP rank: a reader rank reads one holder rank's copy, and the
    reader's ranks read different holder ranks where there are enough of them."""

    def mla(rank: int, tp: int) -> tuple[EngineView, ...]:
        spec = LayoutSpec(
            num_layers=2,
            kv_format=KvFormat.MLA,
            layout=KvLayout.NHD,
            block_size=4,
            num_kv_heads=1,
            head_dim=24,
            dtype="float16",
            num_blocks=BLOCKS,
            tp_rank=rank,
            tp_size=tp,
        )
        return (EngineView(spec, tuple(contiguous_placements(spec))),)

    holder = {rank: mla(rank, holder_tp) for rank in range(holder_tp)}
    read = [
        plan_groups_pull(holder, mla(rank, reader_tp), ([1, 2],), ([3, 4],), 7).remote_ranks
        for rank in range(reader_tp)
    ]
    assert all(len(ranks) == 1 for ranks in read)  # one copy per reader rank
    assert len({ranks[0] for ranks in read}) == min(holder_tp, reader_tp)  # spread over the holder's ranks


# --- refusals ----------------------------------------------------------------------------------


def test_state_group_across_tp_degrees_is_refused_naming_it() -> None:
    remote, _ = hybrid(tp_size=1)
    local, _ = hybrid(tp_size=2)
    with pytest.raises(UnsupportedModelFeature, match="Mamba/linear-attention state is sharded by tensor parallelism"):
        check_group_pair(remote, local)


def test_group_sets_of_other_models_are_refused() -> None:
    groups, _ = hybrid()
    with pytest.raises(IncompatibleLayout, match="3 KV cache groups, this engine 2"):
        check_group_pair(groups, groups[:2])
    swapped = (groups[0], dataclasses.replace(groups[1], kind=KvGroupKind.FULL_ATTENTION), groups[2])
    with pytest.raises(IncompatibleLayout, match="group 1: the holder's is sliding_window"):
        check_group_pair(groups, swapped)


def test_a_window_the_holder_no_longer_holds_is_refused() -> None:
    remote, r_size = hybrid()
    local, l_size = hybrid()
    # 24 tokens = 6 blocks of 4; the holder kept 2 window blocks, the reader wants 3.
    with pytest.raises(UnsupportedModelFeature, match="sliding window: this engine needs tokens from 12"):
        plan_groups_pull(
            {0: remote}, local, ([1, 2, 3, 4, 5, 6], [7, 8], [9]), ([1, 2, 3, 4, 5, 6], [7, 8, 10], [9]), 24
        )


def test_invalid_group_sets_are_refused_at_registration() -> None:
    groups, _ = hybrid()
    bad_state = dataclasses.replace(groups[2], spec=dataclasses.replace(groups[2].spec, block_size=4))
    with pytest.raises(InvalidArgument, match="invalid Mamba/linear-attention state layout: block_size 4"):
        validate_groups((groups[0], groups[1], bad_state))
    with pytest.raises(UnsupportedModelFeature, match="kvd needs a full-attention group first"):
        validate_groups((groups[1], groups[0]))
    shared = dataclasses.replace(groups[2], block_table=0)
    with pytest.raises(InvalidArgument, match="shares block table 0 with a full_attention group"):
        validate_groups((groups[0], groups[1], shared))
    other_tp = dataclasses.replace(groups[1], spec=dataclasses.replace(groups[1].spec, tp_size=2, total_num_kv_heads=4))
    with pytest.raises(InvalidArgument, match="says tp 0/2, group 0 says 0/1"):
        validate_groups((groups[0], other_tp))


def test_holds_need_every_table_and_valid_ids() -> None:
    groups, _ = hybrid()
    with pytest.raises(InvalidArgument, match="needs 2 block id lists after block_ids, got 1"):
        validate_hold_groups(groups, ([1],), 8)
    with pytest.raises(InvalidArgument, match="1..2 ids"):
        validate_hold_groups(groups, ([1, 2, 3], [4]), 8)
    with pytest.raises(InvalidArgument, match="out of range"):
        validate_hold_groups(groups, ([1], [BLOCKS + 3]), 8)
    assert validate_hold_groups(groups, ([5], [4]), 8) == ((5,), (4,))


def test_placements_of_a_group_are_its_own() -> None:
    groups, size = hybrid()
    assert all(isinstance(p, LayerPlacement) for g in groups for p in g.placements)
    assert groups[2].placements[-1].k_offset + groups[2].spec.layer_bytes == size
