"""Pulls between heterogeneous engines: every pair of issue 3, bit for bit against the oracle.

Each case builds a holder (one engine per remote TP rank, replicas holding equal bytes as real
engines do) and a local rank, both with random bytes everywhere, writes a random "truth" for
the request's tokens into the holder with the oracle, plans with ``plan_pull``, executes with
the reference executor (torch byte copies standing in for NIXL, then the postprocess) and
checks:

* the local engine equals its old bytes with the truth scattered in by the oracle: the pulled
  tokens and heads are right, every other byte is untouched;
* no byte past ``num_tokens`` of the holder's blocks was read (its tail stays poisoned);
* each byte is written once, and read once: plan bytes == pulled bytes, except that staging may
  over-read other heads of the same tokens, by at most OVERREAD_MAX_FACTOR.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvd.layout import oracle
from kvd.layout.convert_plan import OVERREAD_MAX_FACTOR, CostModel
from kvd.layout.plan import EngineView, PullPlan, Target, plan_pull
from kvd.layout.spec import DTYPE_SIZES, KvFormat, KvLayout, LayerPlacement, LayoutSpec, contiguous_placements

# --- building engines --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Side:
    """One side's layout knobs; the rank comes separately."""

    kv_format: KvFormat
    layout: KvLayout
    block_size: int
    tp_size: int
    num_blocks: int


@dataclasses.dataclass(frozen=True)
class Model:
    total_heads: int  # 1 for MLA
    head_dim: int
    dtype: str
    layers: int


def make_spec(model: Model, side: Side, rank: int) -> LayoutSpec:
    mla = side.kv_format is KvFormat.MLA
    heads = 1 if mla else max(1, model.total_heads // side.tp_size)
    return LayoutSpec(
        num_layers=model.layers,
        kv_format=side.kv_format,
        layout=side.layout,
        block_size=side.block_size,
        num_kv_heads=heads,
        head_dim=model.head_dim,
        dtype=model.dtype,
        num_blocks=side.num_blocks,
        total_num_kv_heads=1 if mla else model.total_heads,
        tp_rank=rank,
        tp_size=side.tp_size,
    )


def place(spec: LayoutSpec, rng: np.random.Generator, scattered: bool, align: int) -> tuple[EngineView, list[int]]:
    """Contiguous placements, or layers (and K, V) shuffled over 1-3 regions with gaps."""
    if not scattered:
        return EngineView(spec, tuple(contiguous_placements(spec))), [spec.total_bytes]
    unit = 2 * spec.block_bytes if spec.kv_format is KvFormat.JOINT else spec.block_bytes
    span = (spec.num_blocks - 1) * spec.block_stride + unit
    spans = [
        (layer, plane)
        for layer in range(spec.num_layers)
        for plane in range(2 if spec.kv_format is KvFormat.SPLIT else 1)
    ]
    order = rng.permutation(len(spans))
    regions = int(rng.integers(1, 4))
    cursor = [0] * regions
    where: dict[tuple[int, int], tuple[int, int]] = {}
    for i in order:
        region = int(rng.integers(regions))
        cursor[region] += int(rng.integers(0, 3)) * align
        where[spans[i]] = (region, cursor[region])
        cursor[region] += span
    placements = []
    for layer in range(spec.num_layers):
        region, k = where[(layer, 0)]
        v = 0
        if spec.kv_format is KvFormat.SPLIT:
            v_region, v = where[(layer, 1)]
            if v_region != region:  # K and V of a layer share a region: move V next to K's region end
                v = cursor[region]
                cursor[region] += span
        placements.append(LayerPlacement(region, k, v))
    sizes = [c + int(rng.integers(0, 2)) * align for c in cursor]
    spec.validate_placements(placements, sizes)
    return EngineView(spec, tuple(placements)), sizes


def random_regions(sizes: list[int], gen: torch.Generator) -> list[torch.Tensor]:
    return [torch.randint(0, 256, (max(size, 1),), dtype=torch.uint8, generator=gen) for size in sizes]


@dataclasses.dataclass(frozen=True)
class Case:
    model: Model
    remote: Side
    local: Side
    local_rank: int
    num_tokens: int
    seed: int
    scattered: bool = False
    align: int = 16
    max_run_blocks: int = 64
    direct_read_min_bytes: int = 4096
    registered: tuple[int, ...] | None = None  # remote ranks the holder registered (default all)
    extra_remote_blocks: int = 0  # block ids the holder offers beyond what the tokens fill


@dataclasses.dataclass
class Outcome:
    plan: PullPlan
    log: oracle.ExecutionLog
    local_view: EngineView
    remote_views: dict[int, EngineView]


def run_case(case: Case) -> Outcome:
    """Build both sides, pull, and assert everything the module docstring promises."""
    rng = np.random.default_rng(case.seed)
    gen = torch.Generator().manual_seed(case.seed)
    model = case.model
    local_spec = make_spec(model, case.local, case.local_rank)
    planes = local_spec.kv_planes
    heads = 1 if case.local.kv_format is KvFormat.MLA else model.total_heads
    head_bytes = local_spec.head_bytes_per_token
    truth = torch.randint(
        0, 256, (model.layers, planes, case.num_tokens, heads, head_bytes), dtype=torch.uint8, generator=gen
    )

    offered = case.extra_remote_blocks - (-case.num_tokens // case.remote.block_size)
    remote_ids = rng.permutation(case.remote.num_blocks)[:offered].tolist()
    local_ids = rng.permutation(case.local.num_blocks)[: -(-case.num_tokens // case.local.block_size)].tolist()
    remote_views: dict[int, EngineView] = {}
    remote_regions: dict[int, list[torch.Tensor]] = {}
    allowed: dict[int, list[np.ndarray]] = {}
    ranks = range(case.remote.tp_size) if case.registered is None else case.registered
    for rank in ranks:
        view, sizes = place(make_spec(model, case.remote, rank), rng, case.scattered, case.align)
        regions = random_regions(sizes, gen)  # the tail past num_tokens keeps these random bytes
        first, last = view.spec.head_range()
        oracle.scatter(regions, view, remote_ids, truth[:, :, :, first:last].contiguous())
        remote_views[rank], remote_regions[rank] = view, regions
        allowed[rank] = oracle.token_mask(sizes, view, remote_ids, case.num_tokens)

    local_view, sizes = place(make_spec(model, case.local, case.local_rank), rng, case.scattered, case.align)
    local_regions = random_regions(sizes, gen)
    expected = [region.clone() for region in local_regions]
    first, last = local_view.spec.head_range()
    oracle.scatter(expected, local_view, local_ids, truth[:, :, :, first:last].contiguous())

    plan = plan_pull(
        remote_views,
        local_view,
        remote_ids,
        local_ids,
        case.num_tokens,
        max_run_blocks=case.max_run_blocks,
        direct_read_min_bytes=case.direct_read_min_bytes,
    )
    log = oracle.execute_plan(plan, remote_regions, local_regions)

    for got, want in zip(local_regions, expected, strict=True):
        if not torch.equal(got, want):
            wrong = torch.nonzero(got != want).reshape(-1)
            pytest.fail(f"{wrong.numel()} local bytes differ from the oracle, first at {wrong[:8].tolist()}")
    for rank, masks in log.remote_read.items():
        for region, (read, ok) in enumerate(zip(masks, allowed[rank], strict=True)):
            assert not (read & ~ok).any(), f"rank {rank} region {region}: read bytes outside tokens < num_tokens"
    pulled = model.layers * planes * case.num_tokens * local_view.spec.num_kv_heads * head_bytes
    if plan.direct:
        assert plan.total_bytes == pulled, "each pulled byte is read exactly once"
    else:
        assert pulled <= plan.total_bytes <= OVERREAD_MAX_FACTOR * pulled, "staging over-read too much"
    assert all(int(w.max(initial=0)) <= 1 for w in log.engine_writes), "an engine byte was written twice"
    assert int(log.staging_writes.max(initial=0)) <= 1, "a staging byte was written twice"
    assert (plan.postprocess is None) == plan.direct
    assert log.descriptors == plan.num_descriptors
    return Outcome(plan, log, local_view, remote_views)


# --- named pairs: the list, each checked and with its descriptor count -------------------

SMALL = Model(total_heads=4, head_dim=8, dtype="bfloat16", layers=2)
SPLIT, JOINT, MLA = KvFormat.SPLIT, KvFormat.JOINT, KvFormat.MLA
NHD, HND = KvLayout.NHD, KvLayout.HND

NAMED = {
    "NHD->HND split": (Side(SPLIT, NHD, 16, 1, 20), Side(SPLIT, HND, 16, 1, 20)),
    "HND->NHD joint": (Side(JOINT, HND, 16, 1, 20), Side(JOINT, NHD, 16, 1, 20)),
    "split->joint": (Side(SPLIT, NHD, 16, 1, 20), Side(JOINT, NHD, 16, 1, 20)),
    "block 16->64": (Side(SPLIT, NHD, 16, 1, 20), Side(SPLIT, NHD, 64, 1, 8)),
    "block 64->16": (Side(SPLIT, NHD, 64, 1, 8), Side(SPLIT, NHD, 16, 1, 20)),
    "block 1->32 HND": (Side(SPLIT, HND, 1, 1, 300), Side(SPLIT, HND, 32, 1, 10)),
    "tp 2->1": (Side(SPLIT, NHD, 16, 2, 20), Side(SPLIT, NHD, 16, 1, 20)),
    "tp 1->2": (Side(SPLIT, HND, 16, 1, 20), Side(SPLIT, HND, 16, 2, 20)),
    "tp 1->2 NHD (over-read)": (Side(SPLIT, NHD, 16, 1, 20), Side(SPLIT, NHD, 16, 2, 20)),
    "tp 8->2 replicated": (Side(SPLIT, NHD, 16, 8, 20), Side(SPLIT, NHD, 16, 2, 20)),
    "tp 2->8 replicated": (Side(SPLIT, HND, 16, 2, 20), Side(JOINT, NHD, 16, 8, 20)),
    "MLA 16->64 tp 4->1": (Side(MLA, NHD, 16, 4, 20), Side(MLA, HND, 64, 1, 8)),
    "all at once": (Side(JOINT, HND, 64, 4, 8), Side(SPLIT, NHD, 8, 2, 40)),
}


@pytest.mark.parametrize("name", sorted(NAMED))
@pytest.mark.parametrize("num_tokens", [1, 16, 130, 255])
@pytest.mark.parametrize("threshold", [0, 4096, 1 << 30])
def test_named_pair_matches_oracle(name: str, num_tokens: int, threshold: int) -> None:
    remote, local = NAMED[name]
    for local_rank in {0, local.tp_size - 1}:
        run_case(Case(SMALL, remote, local, local_rank, num_tokens, seed=num_tokens, direct_read_min_bytes=threshold))


# Llama-3-8B's KV: 32 layers, 8 KV heads, head_dim 128, bf16; a 1k-token request, contiguous blocks.
LLAMA = Model(total_heads=8, head_dim=128, dtype="bfloat16", layers=32)


def _llama_plan(
    remote: Side,
    local: Side,
    num_tokens: int = 1024,
    local_rank: int = 0,
    remote_offset: int = 0,
    local_offset: int = 0,
    **kw: Any,
) -> PullPlan:
    remote_views = {}
    for rank in range(remote.tp_size):
        spec = make_spec(LLAMA, remote, rank)
        remote_views[rank] = EngineView(spec, tuple(contiguous_placements(spec)))
    spec = make_spec(LLAMA, local, local_rank)
    local_view = EngineView(spec, tuple(contiguous_placements(spec)))
    return plan_pull(
        remote_views,
        local_view,
        list(range(remote_offset, remote_offset - (-num_tokens // remote.block_size))),
        list(range(local_offset, local_offset - (-num_tokens // local.block_size))),
        num_tokens,
        **kw,
    )


@pytest.mark.parametrize(
    ("remote", "local", "direct", "descriptors", "read_factor"),
    [
        # NHD with a block-size ratio: whole token runs straight into the engine, merged into runs.
        (Side(SPLIT, NHD, 16, 1, 100), Side(SPLIT, NHD, 64, 1, 100), True, 64, 1),
        (Side(SPLIT, NHD, 64, 1, 100), Side(SPLIT, NHD, 16, 1, 100), True, 64, 1),
        # HND with a TP head slice: whole head runs of each block straight into the engine.
        (Side(SPLIT, HND, 16, 1, 100), Side(SPLIT, HND, 16, 2, 100), True, 64 * 64, 1),
        # NHD head slice: 1 KiB per token either way; over-read whole tokens (2x bytes) in runs.
        (Side(SPLIT, NHD, 16, 1, 100), Side(SPLIT, NHD, 16, 2, 100), False, 64, 2),
        # ... but never more than OVERREAD_MAX_FACTOR: TP 1 -> 4 stays per-token slices.
        (Side(SPLIT, NHD, 16, 1, 100), Side(SPLIT, NHD, 16, 4, 100), True, 64 * 1024, 1),
        # NHD gathering heads: 1 KiB per token into the engine would be tiny: stage whole blocks.
        (Side(SPLIT, NHD, 16, 2, 100), Side(SPLIT, NHD, 16, 1, 100), False, 2 * 64, 1),
        # Layout change: stage whole remote blocks (runs), permute in torch.
        (Side(SPLIT, NHD, 16, 1, 100), Side(SPLIT, HND, 16, 1, 100), False, 64, 1),
        (Side(JOINT, HND, 16, 1, 100), Side(JOINT, NHD, 16, 1, 100), False, 32, 1),
        # Replicated heads (TP 16 > 8 heads): one replica, whole blocks, like a same-layout pull.
        (Side(SPLIT, NHD, 16, 16, 100), Side(SPLIT, NHD, 16, 8, 100), True, 64, 1),
    ],
)
def test_llama_1k_descriptor_counts(
    remote: Side, local: Side, direct: bool, descriptors: int, read_factor: int
) -> None:
    plan = _llama_plan(remote, local)
    assert plan.direct is direct
    assert plan.num_descriptors == descriptors
    heads = LLAMA.total_heads // min(local.tp_size, LLAMA.total_heads)
    assert plan.total_bytes == read_factor * 32 * 2 * 1024 * heads * 256


def test_mla_block_ratio_is_direct() -> None:
    mla = Model(total_heads=1, head_dim=576, dtype="bfloat16", layers=61)  # DeepSeek-V3's latent
    remote_views = {}
    for rank in range(8):
        spec = make_spec(mla, Side(MLA, NHD, 64, 8, 40), rank)
        remote_views[rank] = EngineView(spec, tuple(contiguous_placements(spec)))
    spec = make_spec(mla, Side(MLA, NHD, 16, 2, 100), 1)
    local = EngineView(spec, tuple(contiguous_placements(spec)))
    plan = plan_pull(remote_views, local, list(range(16)), list(range(64)), 1024)
    assert plan.direct and plan.num_descriptors == 61
    assert plan.remote_ranks == (1,), "a local rank reads the latent from the replica of its own rank"


def test_threshold_is_the_descriptor_size_that_decides() -> None:
    """HND tp 2->1: 16 KiB head runs go direct under 4 KiB, staged (bigger reads) above 16 KiB."""
    remote, local = Side(SPLIT, HND, 16, 2, 100), Side(SPLIT, HND, 16, 1, 100)
    assert _llama_plan(remote, local, direct_read_min_bytes=16384).direct
    staged = _llama_plan(remote, local, direct_read_min_bytes=16385)
    assert not staged.direct and staged.num_descriptors == 2 * 64
    assert staged.staging_bytes == 32 * 2 * 1024 * 8 * 256


def test_cost_model_stages_when_descriptors_cost_more_than_the_conversion() -> None:
    """block 16 -> 64 in HND: 4 KiB head pieces may go direct (32,768 descriptors per 1k tokens),
    but at 10 us a descriptor staging (64 runs and one conversion) is cheaper; with descriptors
    free, or no staging to spare, the same pull reads direct. Bytes agree either way (oracle tests)."""
    remote, local = Side(SPLIT, HND, 16, 1, 100), Side(SPLIT, HND, 64, 1, 100)
    staged = _llama_plan(remote, local)
    assert not staged.direct and staged.num_descriptors == 64
    free = _llama_plan(remote, local, costs=CostModel(descriptor_s=0.0))
    assert free.direct and free.num_descriptors == 32 * 2 * 8 * 64
    no_room = _llama_plan(remote, local, costs=CostModel(staging_limit_bytes=staged.staging_bytes - 1))
    assert no_room.direct and no_room.num_descriptors == free.num_descriptors
    assert _llama_plan(remote, local, costs=CostModel(staging_limit_bytes=staged.staging_bytes)).staging_bytes


def test_cost_model_keeps_cheap_direct_reads_direct() -> None:
    """HND TP 1 -> 2: 4,096 head-run descriptors straight into the engine cost less than staging
    64 MiB and converting it, so they stay direct under the default costs."""
    plan = _llama_plan(Side(SPLIT, HND, 16, 1, 100), Side(SPLIT, HND, 16, 2, 100))
    assert plan.direct and plan.num_descriptors == 64 * 64
    slow_reads = _llama_plan(
        Side(SPLIT, HND, 16, 1, 100), Side(SPLIT, HND, 16, 2, 100), costs=CostModel(descriptor_s=1e-3)
    )
    assert not slow_reads.direct


def test_engine_tables_do_not_depend_on_block_ids() -> None:
    """Direct reads name the same prepared tables whatever the blocks, so the daemon caches them."""
    remote, local = Side(SPLIT, NHD, 64, 1, 100), Side(SPLIT, NHD, 16, 1, 100)
    tables = set()
    for shift in range(5):
        plan = _llama_plan(remote, local, num_tokens=1000, remote_offset=3 * shift, local_offset=7 * shift)
        for group in plan.reads:
            assert group.local_target is Target.ENGINE
            tables.add((group.remote_geometry, group.local_geometry))
    assert len(tables) == 2  # whole 16-token chunks, and the 8-token tail


def test_engine_tables_are_shared_across_block_tables() -> None:
    rng = np.random.default_rng(0)
    remote = {0: EngineView(make_spec(SMALL, Side(SPLIT, NHD, 4, 1, 50), 0), ())}
    remote[0] = EngineView(remote[0].spec, tuple(contiguous_placements(remote[0].spec)))
    spec = make_spec(SMALL, Side(JOINT, NHD, 16, 1, 50), 0)
    local = EngineView(spec, tuple(contiguous_placements(spec)))
    geometries = set()
    for _ in range(10):
        plan = plan_pull(remote, local, rng.permutation(50)[:10].tolist(), rng.permutation(50)[:3].tolist(), 40)
        geometries |= {(g.remote_geometry, g.local_geometry) for g in plan.reads}
    assert len(geometries) == 1


def test_the_planner_never_imports_torch() -> None:
    code = (
        "import sys; import kvd.layout.plan, kvd.layout.convert_plan, kvd.layout.convert; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_gathered_sources_convert_alike_stacked_or_one_by_one() -> None:
    """A TP gather converts all sources in one op; source by source must give the same bytes."""
    remote, local = Side(SPLIT, HND, 8, 4, 20), Side(JOINT, NHD, 4, 1, 40)
    views = {}
    for rank in range(4):
        spec = make_spec(SMALL, remote, rank)
        views[rank] = EngineView(spec, tuple(contiguous_placements(spec)))
    spec = make_spec(SMALL, local, 0)
    local_view = EngineView(spec, tuple(contiguous_placements(spec)))
    plan = plan_pull(views, local_view, [3, 1, 4, 0, 2], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0], 37)
    assert plan.postprocess is not None and len(plan.postprocess.sources) == 4  # type: ignore[attr-defined]
    one_by_one = dataclasses.replace(plan.postprocess, sources=plan.postprocess.sources[::-1])  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(5)
    staging = torch.randint(0, 256, (plan.staging_bytes,), dtype=torch.uint8, generator=gen)
    engine = torch.randint(0, 256, (spec.total_bytes,), dtype=torch.uint8, generator=gen)
    stacked_out, single_out = engine.clone(), engine.clone()
    plan.postprocess.run(staging, [stacked_out])
    one_by_one.run(staging, [single_out])
    assert torch.equal(stacked_out, single_out) and not torch.equal(stacked_out, engine)


def test_holder_missing_a_replica_uses_another() -> None:
    """TP 8 over 4 heads: ranks 2k, 2k+1 hold head k. With only odd ranks registered, read those."""
    case = Case(SMALL, Side(SPLIT, NHD, 16, 8, 20), Side(SPLIT, NHD, 16, 1, 20), 0, 40, seed=3, registered=(1, 3, 5, 7))
    out = run_case(case)
    assert out.plan.remote_ranks == (1, 3, 5, 7)


# --- properties over random pairs ------------------------------------------------------------------

POW2 = [1, 2, 4, 8, 16, 32, 64]


@st.composite
def cases(draw: st.DrawFn) -> Case:
    family = draw(st.sampled_from(["kv"] * 5 + ["mla", "packed"]))  # MLA and PACKED convert among themselves
    mla = family == "mla"
    heads = 1 if mla else draw(st.sampled_from([1, 2, 4, 8]))
    model = Model(
        total_heads=heads,
        head_dim=draw(st.sampled_from([1, 2, 4, 8, 16])),
        dtype=draw(st.sampled_from(sorted(DTYPE_SIZES))),
        layers=draw(st.integers(1, 3)),
    )
    num_tokens = draw(st.integers(1, 150))

    def side() -> Side:
        kv_format = MLA if mla else (KvFormat.PACKED if family == "packed" else draw(st.sampled_from([SPLIT, JOINT])))
        block_size = draw(st.sampled_from(POW2))
        need = -(-num_tokens // block_size)
        return Side(
            kv_format=kv_format,
            layout=draw(st.sampled_from([NHD, HND])),
            block_size=block_size,
            tp_size=draw(st.sampled_from([1, 2, 4, 8])),
            num_blocks=need + draw(st.integers(0, 6)),
        )

    remote, local = side(), side()
    return Case(
        model=model,
        remote=remote,
        local=local,
        local_rank=draw(st.integers(0, local.tp_size - 1)),
        num_tokens=num_tokens,
        seed=draw(st.integers(0, 2**31)),
        scattered=draw(st.booleans()),
        align=draw(st.sampled_from([1, 2, 16, 64])),
        max_run_blocks=draw(st.sampled_from([1, 2, 8, 64])),
        direct_read_min_bytes=draw(st.sampled_from([0, 64, 4096, 1 << 30])),
    )


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_any_pair_matches_oracle_bit_for_bit(case: Case) -> None:
    out = run_case(case)
    remote, local = case.remote, case.local
    event("direct" if out.plan.direct else "staged")
    event(f"layout {remote.layout.name}->{local.layout.name}, format {remote.kv_format.name}->{local.kv_format.name}")
    ratio = "=" if remote.block_size == local.block_size else ("<" if remote.block_size < local.block_size else ">")
    partial = case.num_tokens % max(remote.block_size, local.block_size) != 0
    event(f"block remote {ratio} local, partial last block: {partial}")
    tp = "=" if remote.tp_size == local.tp_size else ("<" if remote.tp_size < local.tp_size else ">")
    replicated = (
        max(remote.tp_size, local.tp_size) > case.model.total_heads and case.local.kv_format is not KvFormat.MLA
    )
    event(f"tp remote {tp} local, replicated heads: {replicated}, remote ranks read: {len(out.plan.remote_ranks)}")


@settings(max_examples=60, deadline=None)
@given(case=cases(), extra=st.integers(1, 3))
def test_extra_block_ids_offered_by_the_holder_are_never_read(case: Case, extra: int) -> None:
    """The holder may offer more blocks than the tokens fill: the extra ones are never read."""
    remote = dataclasses.replace(case.remote, num_blocks=case.remote.num_blocks + extra)
    run_case(dataclasses.replace(case, remote=remote, extra_remote_blocks=extra))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", sorted(NAMED))
def test_named_pair_on_cuda(name: str) -> None:
    """The postprocess runs on the device the engine's memory lives on."""
    remote, local = NAMED[name]
    case = Case(SMALL, remote, local, 0, 130, seed=1, direct_read_min_bytes=1 << 30)
    spec = make_spec(SMALL, local, 0)
    view = EngineView(spec, tuple(contiguous_placements(spec)))
    remote_views, remote_regions = {}, {}
    gen = torch.Generator().manual_seed(0)
    remote_ids = list(range(-(-case.num_tokens // remote.block_size)))
    local_ids = list(range(-(-case.num_tokens // local.block_size)))[::-1]
    for rank in range(remote.tp_size):
        rspec = make_spec(SMALL, remote, rank)
        remote_views[rank] = EngineView(rspec, tuple(contiguous_placements(rspec)))
        remote_regions[rank] = random_regions([rspec.total_bytes], gen)
    plan = plan_pull(remote_views, view, remote_ids, local_ids, case.num_tokens, direct_read_min_bytes=1 << 30)
    cpu_local = random_regions([spec.total_bytes], gen)
    gpu_local = [r.cuda() for r in cpu_local]
    staging = torch.randint(0, 256, (plan.staging_bytes,), dtype=torch.uint8, generator=gen)
    oracle.execute_plan(plan, remote_regions, cpu_local, staging.clone())
    oracle.execute_plan(plan, remote_regions, gpu_local, staging.cuda())
    assert torch.equal(gpu_local[0].cpu(), cpu_local[0])
