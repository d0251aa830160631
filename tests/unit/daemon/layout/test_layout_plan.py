"""kvd.layout.plan between identical layouts: direct reads, merged runs, token-exact tails, validation."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvd.layout.plan import (
    EngineView,
    PullPlan,
    Target,
    block_geometry,
    partial_block_geometry,
    plan_pull,
    validate_pull,
)
from kvd.layout.spec import KvFormat, KvLayout, LayoutSpec, contiguous_placements
from kvd_client.errors import IncompatibleLayout, InvalidArgument

LLAMA_TOKEN_BYTES = 8 * 128 * 2  # one token of one plane: 8 KV heads x 128 dims x bf16
LLAMA_PLANES = 32 * 2  # 32 layers x (K, V)


def _view(
    kv_format: KvFormat = KvFormat.SPLIT,
    layout: KvLayout = KvLayout.NHD,
    *,
    layers: int = 32,
    heads: int = 8,
    head_dim: int = 128,
    block_size: int = 16,
    num_blocks: int = 128,
    dtype: str = "bfloat16",
) -> EngineView:
    spec = LayoutSpec(
        num_layers=layers,
        kv_format=kv_format,
        layout=layout,
        block_size=block_size,
        num_kv_heads=1 if kv_format is KvFormat.MLA else heads,
        head_dim=head_dim,
        dtype=dtype,
        num_blocks=num_blocks,
    )
    return EngineView(spec, tuple(contiguous_placements(spec)))


def _rows(plan: PullPlan) -> list[tuple[np.ndarray, np.ndarray]]:
    """(remote rows, local rows) per read group, addresses relative to region 0 at 0."""
    return [
        (g.remote_geometry.rows_for(g.remote_indices, [0]), g.local_geometry.rows_for(g.local_indices, [0]))
        for g in plan.reads
    ]


# --- the design's numbers: Llama-8B, 1k tokens --------------------------------------------------


def test_1k_tokens_contiguous_blocks_are_64_descriptors() -> None:
    """1024 tokens in 64 adjacent blocks on both sides: one run per plane, 64 descriptors, exact bytes."""
    view = _view()
    plan = plan_pull({0: view}, view, list(range(64)), list(range(32, 96)), 1024)
    assert plan.direct and plan.postprocess is None and plan.staging_bytes == 0
    assert plan.num_descriptors == 64
    assert plan.total_bytes == 1024 * LLAMA_TOKEN_BYTES * LLAMA_PLANES == 32 * 2 * 64 * 32768
    assert plan.remote_ranks == (0,)
    (group,) = plan.reads
    assert group.local_target is Target.ENGINE
    assert group.remote_indices.size == group.local_indices.size == 64
    remote, local = _rows(plan)[0]
    assert np.array_equal(remote[:, 1], local[:, 1])
    assert int(local[:, 1].sum()) == plan.total_bytes


def test_1k_tokens_shuffled_blocks_are_one_descriptor_per_block_per_plane() -> None:
    """When no two neighbouring blocks are adjacent on both sides, each block is its own descriptor per plane."""
    view = _view()
    rng = np.random.default_rng(7)
    local_ids = list(range(127, 63, -1))  # descending: never adjacent
    remote_ids = rng.permutation(64).tolist()
    plan = plan_pull({0: view}, view, remote_ids, local_ids, 1024)
    assert plan.num_descriptors == 64 * LLAMA_PLANES
    assert plan.total_bytes == 1024 * LLAMA_TOKEN_BYTES * LLAMA_PLANES
    remote, local = _rows(plan)[0]
    assert np.all(remote[:, 1] == 32768) and np.all(local[:, 1] == 32768)


def test_1k_tokens_joint_contiguous_is_one_descriptor_per_layer() -> None:
    """JOINT blocks carry K and V together: 32 descriptors, the same bytes."""
    view = _view(KvFormat.JOINT)
    plan = plan_pull({0: view}, view, list(range(64)), list(range(64)), 1024)
    assert plan.num_descriptors == 32
    assert plan.total_bytes == 1024 * LLAMA_TOKEN_BYTES * LLAMA_PLANES


@pytest.mark.parametrize("layout", list(KvLayout))
def test_partial_last_block_is_read_token_exact(layout: KvLayout) -> None:
    """1000 tokens = 62 full blocks + 8 tokens: bytes == num_tokens * token_bytes * planes * layers."""
    view = _view(layout=layout)
    plan = plan_pull({0: view}, view, list(range(63)), list(range(63)), 1000)
    assert plan.total_bytes == 1000 * LLAMA_TOKEN_BYTES * 2 * 32
    tail = plan.reads[-1]
    per_piece = 8 * (LLAMA_TOKEN_BYTES if layout is KvLayout.NHD else 128 * 2)
    assert np.all(_rows(plan)[-1][0][:, 1] == per_piece)
    assert tail.nbytes == 8 * LLAMA_TOKEN_BYTES * LLAMA_PLANES


def test_engines_of_different_sizes_read_through_the_tables_prepared_for_each() -> None:
    """A holder of 4096 blocks and a reader of 16 have different run limits in their whole-block
    tables: each read group still names each engine's own table (the one registration and the
    peer warm-up prepared), and runs are cut to the shorter limit, so no pair needs a table of its
    own."""
    holder, reader = _view(num_blocks=4096), _view(num_blocks=16)
    plan = plan_pull({0: holder}, reader, list(range(100, 116)), list(range(16)), 256)
    (group,) = plan.reads
    assert group.remote_geometry == block_geometry(holder, 64)
    assert group.local_geometry == block_geometry(reader, 64)
    assert group.remote_geometry.max_run_log2 == 6 and group.local_geometry.max_run_log2 == 4
    assert plan.num_descriptors == LLAMA_PLANES  # one run of 16 blocks per plane
    remote, local = _rows(plan)[0]
    assert np.array_equal(remote[:, 1], local[:, 1]) and set(local[:, 1]) == {16 * 16 * LLAMA_TOKEN_BYTES}


def test_max_run_blocks_caps_runs() -> None:
    """With max_run_blocks 16, 64 adjacent blocks are 4 runs per plane."""
    view = _view()
    plan = plan_pull({0: view}, view, list(range(64)), list(range(64)), 1024, max_run_blocks=16)
    assert plan.num_descriptors == 4 * LLAMA_PLANES


# --- byte-exact simulation (small shapes) -------------------------------------------------------


def _token_slices(spec: LayoutSpec, view: EngineView, block_ids: list[int], num_tokens: int) -> list[slice]:
    """Byte ranges of tokens 0..num_tokens-1 (every plane, every layer, every head), sequence order."""
    out = []
    hb = spec.head_bytes_per_token
    for placement in view.placements:
        for plane in spec.plane_offsets(placement):
            for t in range(num_tokens):
                base = plane + block_ids[t // spec.block_size] * spec.block_stride
                pos = t % spec.block_size
                if spec.layout is KvLayout.NHD or spec.kv_format is KvFormat.MLA:
                    start = base + pos * spec.token_bytes
                    out.append(slice(start, start + spec.token_bytes))
                else:
                    for h in range(spec.num_kv_heads):
                        start = base + h * spec.block_size * hb + pos * hb
                        out.append(slice(start, start + hb))
    return out


@settings(max_examples=60, deadline=None)
@given(
    kv_format=st.sampled_from(list(KvFormat)),
    layout=st.sampled_from(list(KvLayout)),
    block_size=st.sampled_from([1, 2, 4]),
    num_tokens=st.integers(1, 24),
    max_run=st.sampled_from([1, 2, 4, 64]),
    data=st.data(),
)
def test_same_layout_plan_moves_exactly_the_committed_tokens(
    kv_format: KvFormat, layout: KvLayout, block_size: int, num_tokens: int, max_run: int, data: Any
) -> None:
    """Executing the plan copies every committed token's bytes to the right place, and nothing else.

    Bytes past num_tokens in the last remote block (rejected draft tokens) are never read, and the
    local engine's other bytes are never written. The two engines may have different numbers of
    blocks, so different run limits in their tables.
    """
    kw = dict(layers=2, heads=2, head_dim=4, block_size=block_size, dtype="float16")
    remote_blocks, local_blocks = (data.draw(st.sampled_from([8, 32]), label=side) for side in ("remote", "local"))
    remote_view = _view(kv_format, layout, num_blocks=remote_blocks, **kw)  # type: ignore[arg-type]
    local_view = _view(kv_format, layout, num_blocks=local_blocks, **kw)  # type: ignore[arg-type]
    spec, remote_spec = local_view.spec, remote_view.spec
    need = spec.blocks_for(num_tokens)
    assume(need <= min(remote_blocks, local_blocks))

    def block_ids(blocks: int) -> list[int]:
        # Adjacent runs (merged into power-of-two pieces) or scattered blocks.
        if data.draw(st.booleans(), label="adjacent"):
            first = data.draw(st.integers(0, blocks - need), label="first")
            return list(range(first, first + need))
        return data.draw(st.permutations(range(blocks)), label="scattered")[:need]

    local_ids = block_ids(local_blocks)
    remote_ids = block_ids(remote_blocks)
    plan = plan_pull({0: remote_view}, local_view, remote_ids, local_ids, num_tokens, max_run_blocks=max_run)
    assert plan.direct

    rng = np.random.default_rng(0)
    remote_mem = rng.integers(1, 256, remote_spec.total_bytes, dtype=np.uint8)
    local_mem = np.zeros(spec.total_bytes, dtype=np.uint8)
    read = np.zeros(remote_spec.total_bytes, dtype=bool)
    written = np.zeros(spec.total_bytes, dtype=bool)
    for remote_rows, local_rows in _rows(plan):
        assert np.array_equal(remote_rows[:, 1], local_rows[:, 1])  # each pair moves equal lengths
        for (ra, length, _), (la, _, _) in zip(remote_rows, local_rows, strict=True):
            assert not written[la : la + length].any()  # no byte written twice
            local_mem[la : la + length] = remote_mem[ra : ra + length]
            read[ra : ra + length] = True
            written[la : la + length] = True

    remote_slices = _token_slices(remote_spec, remote_view, remote_ids, num_tokens)
    local_slices = _token_slices(spec, local_view, local_ids, num_tokens)
    expected_read = np.zeros_like(read)
    expected_written = np.zeros_like(written)
    for rs, ls in zip(remote_slices, local_slices, strict=True):
        assert np.array_equal(local_mem[ls], remote_mem[rs])
        expected_read[rs] = True
        expected_written[ls] = True
    assert np.array_equal(read, expected_read), "read bytes outside the committed tokens"
    assert np.array_equal(written, expected_written), "wrote bytes outside the committed tokens"
    assert plan.total_bytes == int(written.sum()) == num_tokens * spec.token_bytes * spec.kv_planes * spec.num_layers


# --- plan_pull refusals -------------------------------------------------------------------------


def test_plan_pull_without_remote_ranks_is_refused() -> None:
    """A holder with no registered ranks cannot be read."""
    with pytest.raises(IncompatibleLayout, match="no engine ranks"):
        plan_pull({}, _view(), [0], [0], 1)


def test_plan_pull_of_unconvertible_layouts_names_both_sides() -> None:
    """Different dtype or head_dim cannot be converted: FAILED_PRECONDITION with both values."""
    with pytest.raises(IncompatibleLayout, match="dtype: remote bfloat16 vs local float16"):
        plan_pull({0: _view()}, _view(dtype="float16"), [0], [0], 1)
    with pytest.raises(IncompatibleLayout, match="head_dim: remote 128 vs local 64"):
        plan_pull({0: _view()}, _view(head_dim=64), [0], [0], 1)


# --- validate_pull ------------------------------------------------------------------------------

SPEC = _view(num_blocks=10, block_size=16).spec


def test_validate_pull_accepts_a_consistent_request() -> None:
    """Lengths matching the token count, ids in range: no error (extra remote ids are allowed)."""
    validate_pull(SPEC, SPEC, [0, 1, 2], [3, 4], 20)
    validate_pull(SPEC, SPEC, [9], [0], 16)


@pytest.mark.parametrize(
    ("remote_ids", "local_ids", "tokens", "message"),
    [
        ([0, 1], [0, 1], 0, "num_tokens must be >= 1, got 0"),
        ([0, 1], [0], 20, "20 tokens need 2 local blocks of 16 tokens, got 1 local block ids"),
        ([0, 1], [0, 1, 2], 20, "20 tokens need 2 local blocks of 16 tokens, got 3 local block ids"),
        ([0], [0, 1], 20, "20 tokens need 2 remote blocks of 16 tokens, the holder offered 1"),
        ([0, 1], [0, 10], 20, r"local block ids: block ids [10] out of range 0..9"),
        ([0, 1], [-1, 1], 20, r"local block ids: block ids [-1] out of range 0..9"),
        ([0, 12], [0, 1], 20, r"remote block ids: block ids [12] out of range 0..9"),
        ([0, 1], [4, 4], 20, "local block ids repeat a block"),
    ],
)
def test_validate_pull_refusals(remote_ids: list[int], local_ids: list[int], tokens: int, message: str) -> None:
    """Each inconsistency is INVALID_ARGUMENT with a message naming the numbers involved."""
    with pytest.raises(InvalidArgument) as info:
        validate_pull(SPEC, SPEC, remote_ids, local_ids, tokens)
    assert message in str(info.value)


def test_plan_pull_validates_before_planning() -> None:
    """plan_pull refuses a request validate_pull refuses (nothing is planned)."""
    view = _view(num_blocks=10)
    with pytest.raises(InvalidArgument, match="repeat a block"):
        plan_pull({0: view}, view, [0, 1], [3, 3], 20)


def test_a_view_is_looked_up_by_identity_and_a_new_view_never_gets_an_old_views_geometry() -> None:
    """block_geometry answers the same view object from its identity cache (no hashing of every
    layer's placement per pull), an equal view built anew gets an equal geometry, and a view made
    after another one was dropped (so possibly at the same address) gets its own geometry: each
    entry keeps its view alive, so an id is never reused under it."""
    view = _view(num_blocks=64)
    first = block_geometry(view, 64)
    assert block_geometry(view, 64) is first
    assert block_geometry(view, 8) != first and block_geometry(view, 8).max_run_log2 == 3
    assert block_geometry(_view(num_blocks=64), 64) == first
    assert partial_block_geometry(view, 5) is partial_block_geometry(view, 5)
    for blocks in (32, 48, 96, 200):
        del view
        gc.collect()
        view = _view(num_blocks=blocks)
        geometry = block_geometry(view, 64)
        assert geometry.num_units == blocks
        assert partial_block_geometry(view, 3).num_units == blocks
