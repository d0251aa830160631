"""Conversion planner: pulls between engines whose KV caches are laid out differently.

:func:`plan_conversion` serves every pair :func:`kvd.layout.plan.plan_pull` does not copy block
for block: NHD <-> HND, SPLIT <-> JOINT, different block sizes (any power-of-two ratio, partial
last block), different tensor-parallel degrees (gather heads from several remote ranks, read a
head slice of one, read one replica when TP exceeds the head count), MLA, and any mix of those.

The idea, so that one code path serves every pair:

* The local rank's heads are split into *sources*: per remote rank, the contiguous slice of
  heads it supplies (:func:`choose_sources`).
* For a source, both sides are tiled with the largest *piece* (a run of tokens times a run of
  heads, in one axis order) that is contiguous on both sides and orders its bytes identically
  (:func:`common_shape`). A piece is one NIXL descriptor; consecutive pieces that are adjacent on
  both sides merge into power-of-two runs (:func:`kvd.layout.geometry.split_runs`).
* If the pieces between the remote cache and the local engine are at least
  ``direct_read_min_bytes`` long, NIXL reads straight into the engine's blocks: no staging, no
  extra copy. Otherwise, if the remote's own layout allows bigger pieces, NIXL reads them into
  staging (laid out like the remote's blocks, restricted to the source's heads) and
  :class:`kvd.layout.convert.ConvertPostprocess` re-lays them into the engine with torch.

Where neither helps because the remote is NHD and the source takes a head slice of it (each
token's slice is its own small piece), staging may *over-read*: whole tokens of the remote rank,
all its heads, at most :data:`OVERREAD_MAX_FACTOR` times the bytes needed, the conversion then
keeping the slice. Bytes of other heads of committed tokens may be read; never a token at or
past ``num_tokens`` (the tail of the last remote block may hold KV of rejected draft tokens).
Only the local rank's own heads are written.

Pure numpy: the planner never imports torch (the postprocess imports it only when it runs).
Descriptor tables for the engine side depend only on the two layouts, the head slice and the
length of a partial piece, never on block ids, so the daemon can prepare and cache them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence

import numpy as np

from kvd.layout.convert import BlockFrame, ConvertPostprocess, StagedSource
from kvd.layout.geometry import DescGeometry, max_run_log2_for, split_runs
from kvd.layout.head_sources import HeadSource, check_pair, choose_sources
from kvd.layout.plan_types import EngineView, PullPlan, ReadGroup, Target, validate_pull
from kvd.layout.spec import KvFormat, KvLayout, LayoutSpec, contiguous_placements

__all__ = [
    "OVERREAD_MAX_FACTOR",
    "HeadSource",
    "PieceShape",
    "choose_sources",
    "check_pair",
    "common_shape",
    "effective_layouts",
    "piece_geometry",
    "plan_conversion",
    "staging_view",
]


# Staging may read up to this many times the bytes a source needs (other heads of the same tokens)
# when that turns per-token slices into whole-block runs: TP 1 -> 2 on NHD caches reads 2x the
# bytes in 64 descriptors instead of 65536 one-KiB ones for a 1k-token Llama-8B request.
OVERREAD_MAX_FACTOR = 2


# --- pieces: the largest unit contiguous on both sides ----------------------------------------


@dataclasses.dataclass(frozen=True)
class PieceShape:
    """``tokens`` adjacent tokens of one block times ``heads`` adjacent heads.

    ``token_major``: bytes ordered (token, head) (NHD) or (head, token) (HND); the two agree
    when either count is 1. ``merge_kv``: the piece is a whole JOINT block, K and V together.
    """

    tokens: int
    heads: int
    token_major: bool
    merge_kv: bool = False

    def nbytes(self, head_bytes: int) -> int:
        return self.tokens * self.heads * head_bytes * (2 if self.merge_kv else 1)


def _degenerate(spec: LayoutSpec) -> bool:
    """One head or one token per block: NHD and HND are the same bytes."""
    return spec.num_kv_heads == 1 or spec.block_size == 1


def effective_layouts(a: LayoutSpec, b: LayoutSpec) -> tuple[KvLayout, KvLayout]:
    """Each side's layout, with degenerate sides taking the other side's (they are both)."""
    la, lb = a.layout, b.layout
    if _degenerate(a) and _degenerate(b):
        return KvLayout.NHD, KvLayout.NHD
    if _degenerate(a):
        return lb, lb
    if _degenerate(b):
        return la, la
    return la, lb


def common_shape(a: LayoutSpec, b: LayoutSpec, num_heads: int) -> PieceShape:
    """The largest piece of ``num_heads`` heads contiguous, in the same order, on both sides.

    NHD both: whole token runs when both sides hold exactly those heads (chunks of the smaller
    block size), else one token's head slice. HND both: a head slice of a whole block when
    block sizes agree, else one head's token run. Mixed layouts share only single head vectors.
    """
    la, lb = effective_layouts(a, b)
    if la is KvLayout.NHD and lb is KvLayout.NHD:
        if num_heads == a.num_kv_heads == b.num_kv_heads:
            shape = PieceShape(min(a.block_size, b.block_size), num_heads, True)
        else:
            shape = PieceShape(1, num_heads, True)
    elif la is KvLayout.HND and lb is KvLayout.HND:
        if a.block_size == b.block_size:
            shape = PieceShape(a.block_size, num_heads, False)
        else:
            shape = PieceShape(min(a.block_size, b.block_size), 1, False)
    else:
        shape = PieceShape(1, 1, True)
    whole_block = shape.tokens == a.block_size == b.block_size and shape.heads == a.num_kv_heads == b.num_kv_heads
    if whole_block and a.kv_format is KvFormat.JOINT and b.kv_format is KvFormat.JOINT:
        shape = dataclasses.replace(shape, merge_kv=True)
    return shape


def _tail_shape(shape: PieceShape) -> PieceShape:
    """Shape of a partial piece: a prefix of a head-major run of several heads is not contiguous."""
    heads = shape.heads if shape.token_major else 1
    return PieceShape(shape.tokens, heads, shape.token_major)


@dataclasses.dataclass(frozen=True)
class _PieceTable:
    """A descriptor table of pieces of one side, and how (plane, unit) follow from a piece."""

    geometry: DescGeometry
    chunks: int  # pieces per block along the token axis
    groups: int  # pieces along the head axis
    collapsed: bool  # chunks of a block are units of one plane (else: one plane per chunk)

    def locate(
        self, block_ids: np.ndarray, block_size: int, tokens: int, lp: np.ndarray, g: np.ndarray, k: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(plane, unit) of piece ``(layer-plane lp, head group g, token chunk k)``."""
        first = k * tokens
        block = block_ids[first // block_size]
        chunk = (first % block_size) // tokens
        if self.collapsed:
            return (lp * self.groups + g), block * self.chunks + chunk
        return (lp * self.groups + g) * self.chunks + chunk, block


def piece_geometry(
    view: EngineView,
    layout: KvLayout,
    head0: int,
    num_heads: int,
    shape: PieceShape,
    length: int,
    max_run_blocks: int,
) -> DescGeometry:
    """The descriptor table of ``shape`` pieces (``length`` tokens long) of one side.

    Depends only on the layout, the head slice and ``length``: cacheable per pair of engines.
    """
    return _engine_piece_table(view, layout, head0, num_heads, shape, length, max_run_blocks).geometry


def _piece_table(
    view: EngineView,
    layout: KvLayout,
    head0: int,
    num_heads: int,
    shape: PieceShape,
    length: int,
    max_run_blocks: int,
) -> _PieceTable:
    spec = view.spec
    hb, bsz, heads = spec.head_bytes_per_token, spec.block_size, spec.num_kv_heads
    pt, ph = shape.tokens, shape.heads
    chunks, groups = bsz // pt, num_heads // ph
    if layout is KvLayout.NHD:
        chunk_stride, group_stride, head_base = pt * heads * hb, ph * hb, head0 * hb
        contiguous = ph == heads or length == 1
    else:
        chunk_stride, group_stride, head_base = pt * hb, ph * bsz * hb, head0 * bsz * hb
        contiguous = length == bsz or ph == 1
    if not contiguous or bsz % pt or num_heads % ph:
        raise AssertionError(f"piece {shape} of {length} tokens is not contiguous in {spec.describe()}")
    unit_bytes = length * ph * hb
    if shape.merge_kv:
        bases = [(p.region, p.k_offset) for p in view.placements]
        unit_bytes *= 2
    else:
        bases = [(p.region, off) for p in view.placements for off in spec.plane_offsets(p)]
    collapsed = chunks == 1 or chunks * chunk_stride == spec.block_stride
    chunk_planes = 1 if collapsed else chunks
    planes = tuple(
        (region, base + head_base + g * group_stride + c * chunk_stride)
        for region, base in bases
        for g in range(groups)
        for c in range(chunk_planes)
    )
    if collapsed:
        num_units = spec.num_blocks * chunks
        stride = chunk_stride if chunks > 1 else spec.block_stride
    else:
        num_units, stride = spec.num_blocks, spec.block_stride
    runs = stride == unit_bytes
    max_log2 = max_run_log2_for(num_units, max_run_blocks * chunks, len(planes)) if runs else 0
    geometry = DescGeometry(
        planes=planes, num_units=num_units, unit_stride=stride, unit_bytes=unit_bytes, max_run_log2=max_log2
    )
    return _PieceTable(geometry, chunks, groups, collapsed)


@dataclasses.dataclass(frozen=True, eq=False)
class _Side:
    """One end of a copy: a cache (engine or staging), its blocks, and the first head used."""

    view: EngineView
    layout: KvLayout  # effective layout (see effective_layouts)
    block_ids: np.ndarray
    head0: int
    staging: bool = False  # staging tables are one-off: not worth caching

    def table(self, num_heads: int, shape: PieceShape, length: int, max_run_blocks: int) -> _PieceTable:
        build = _piece_table if self.staging else _engine_piece_table
        return build(self.view, self.layout, self.head0, num_heads, shape, length, max_run_blocks)


# Engine tables depend on layouts only: a handful per pair of engines, reused by every pull.
_engine_piece_table = functools.lru_cache(maxsize=256)(_piece_table)


def _copy_groups(
    rank: int,
    remote: _Side,
    local: _Side,
    num_heads: int,
    num_tokens: int,
    target: Target,
    max_run_blocks: int,
) -> list[ReadGroup]:
    """ReadGroups copying tokens [0, num_tokens) of ``num_heads`` heads from ``remote`` to ``local``."""
    shape = common_shape(remote.view.spec, local.view.spec, num_heads)
    full, tail = divmod(num_tokens, shape.tokens)
    groups = []
    if full:
        groups.append(
            _group(rank, remote, local, num_heads, shape, shape.tokens, np.arange(full), target, max_run_blocks)
        )
    if tail:
        tshape = _tail_shape(shape)
        groups.append(_group(rank, remote, local, num_heads, tshape, tail, np.array([full]), target, max_run_blocks))
    return groups


def _piece_sizes(remote: _Side, local: _Side, num_heads: int, max_run_blocks: int) -> tuple[int, int]:
    """(bytes of one piece, bytes of the longest run of pieces) of a copy's whole-piece reads.

    The first says whether the descriptors are big enough to read straight into the engine;
    the second whether staging would buy bigger ones (runs of whole remote blocks merge).
    """
    shape = common_shape(remote.view.spec, local.view.spec, num_heads)
    rtab = remote.table(num_heads, shape, shape.tokens, max_run_blocks)
    ltab = local.table(num_heads, shape, shape.tokens, max_run_blocks)
    k_runs = min(rtab.geometry.max_run_log2, ltab.geometry.max_run_log2)
    return rtab.geometry.unit_bytes, rtab.geometry.unit_bytes << k_runs


def _group(
    rank: int,
    remote: _Side,
    local: _Side,
    num_heads: int,
    shape: PieceShape,
    length: int,
    chunks: np.ndarray,
    target: Target,
    max_run_blocks: int,
) -> ReadGroup:
    """One ReadGroup: every (layer-plane, head group, token chunk) piece, merged into runs."""
    rtab = remote.table(num_heads, shape, length, max_run_blocks)
    ltab = local.table(num_heads, shape, length, max_run_blocks)
    # Each side keeps its own table (shared by every pull through that side's geometry); the runs
    # are cut to the shorter run limit, so each index is one both tables hold.
    k_runs = min(rtab.geometry.max_run_log2, ltab.geometry.max_run_log2)
    rgeo, lgeo = rtab.geometry, ltab.geometry
    assert rgeo.unit_bytes == lgeo.unit_bytes, (rgeo, lgeo)
    spec = local.view.spec
    lps = spec.num_layers * (1 if shape.merge_kv else spec.kv_planes)
    lp, g, k = (
        a.reshape(-1)
        for a in np.broadcast_arrays(
            np.arange(lps)[:, None, None], np.arange(num_heads // shape.heads)[None, :, None], chunks[None, None, :]
        )
    )
    r_plane, r_unit = rtab.locate(remote.block_ids, remote.view.spec.block_size, shape.tokens, lp, g, k)
    l_plane, l_unit = ltab.locate(local.block_ids, spec.block_size, shape.tokens, lp, g, k)
    # A gap of one unit between planes keeps runs from crossing a plane's end.
    r_key = r_plane * (rgeo.num_units + 1) + r_unit
    l_key = l_plane * (lgeo.num_units + 1) + l_unit
    l_start, r_start, log2_len, _ = split_runs(l_key, r_key, k_runs)
    r_idx = rgeo.index(r_start // (rgeo.num_units + 1), r_start % (rgeo.num_units + 1), log2_len)
    l_idx = lgeo.index(l_start // (lgeo.num_units + 1), l_start % (lgeo.num_units + 1), log2_len)
    return ReadGroup(rank, rgeo, r_idx, target, lgeo, l_idx, lgeo.nbytes_of(log2_len))


# --- staging ------------------------------------------------------------------------------------


def staging_view(remote: LayoutSpec, num_heads: int, num_tokens: int, offset: int) -> EngineView:
    """How one source's bytes sit in the staging chunk: the remote's blocks, only its heads.

    Keeping the remote's own block size, layout and K/V format lets NIXL read the biggest
    pieces the remote allows (whole blocks, or runs of them); the conversion re-lays them.
    """
    spec = LayoutSpec(
        num_layers=remote.num_layers,
        kv_format=remote.kv_format,
        layout=remote.layout,
        block_size=remote.block_size,
        num_kv_heads=num_heads,
        head_dim=remote.head_dim,
        dtype=remote.dtype,
        num_blocks=remote.blocks_for(num_tokens),
    )
    return EngineView(spec, tuple(contiguous_placements(spec, region=0, base=offset)))


def _staging_choice(
    remote: _Side, source: HeadSource, num_tokens: int, offset: int, direct_most: int, max_run_blocks: int
) -> tuple[_Side, _Side, int] | None:
    """(remote side, staging side, heads read) when staging buys longer reads than ``direct_most``.

    First the source's own heads; failing that, all the remote rank's heads (an over-read of at
    most OVERREAD_MAX_FACTOR); None when neither reads longer pieces than a direct read.
    """
    rspec = remote.view.spec
    options = [(remote.head0, source.num_heads)]
    if rspec.num_kv_heads > source.num_heads and rspec.num_kv_heads <= OVERREAD_MAX_FACTOR * source.num_heads:
        options.append((0, rspec.num_kv_heads))
    for head0, heads in options:
        sview = staging_view(rspec, heads, num_tokens, offset)
        r_eff, s_eff = effective_layouts(rspec, sview.spec)
        rside = dataclasses.replace(remote, layout=r_eff, head0=head0)
        sside = _Side(sview, s_eff, np.arange(sview.spec.num_blocks, dtype=np.int64), 0, staging=True)
        _, most = _piece_sizes(rside, sside, heads, max_run_blocks)
        if most > direct_most:
            return rside, sside, heads
    return None


# --- the planner --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CostModel:
    """What a pull costs, to choose between reading straight into the engine and staging.

    Direct reads avoid a copy but may need many small descriptors (e.g. block 16 -> 64 in HND:
    one 4 KiB piece per head per block); staging reads few long runs and then converts every
    byte once. Measured on loopback (``kvd bench``): ~10 us per posted descriptor, conversions
    ~1 GB/s on a loaded 2-core host. Both are configurable (``read_descriptor_cost_s``,
    ``convert_bytes_per_s``); a network changes the first, a GPU the second.
    """

    descriptor_s: float = 10e-6
    convert_bytes_per_s: float = 1e9
    staging_limit_bytes: int = 0  # the staging pool's size (0: unlimited): a pull that direct
    # reads can serve is never made to wait for, or fail on, staging it cannot get

    def staging_pays(
        self, direct: Sequence[ReadGroup], staged: Sequence[ReadGroup], converted_bytes: int, staging_total: int
    ) -> bool:
        """Whether staging + conversion is expected to be faster than the direct reads (and fits)."""
        if self.staging_limit_bytes and staging_total > self.staging_limit_bytes:
            return False
        direct_s = sum(g.num_descriptors for g in direct) * self.descriptor_s
        staged_s = sum(g.num_descriptors for g in staged) * self.descriptor_s
        return staged_s + converted_bytes / self.convert_bytes_per_s < direct_s


DEFAULT_COSTS = CostModel()


def plan_conversion(
    remote: Mapping[int, EngineView],
    local: EngineView,
    remote_block_ids: Sequence[int],
    local_block_ids: Sequence[int],
    num_tokens: int,
    *,
    max_run_blocks: int = 64,
    direct_read_min_bytes: int = 4096,
    costs: CostModel = DEFAULT_COSTS,
) -> PullPlan:
    """Plan a pull between engines whose layouts differ (same arguments as ``plan_pull``).

    Pieces shorter than ``direct_read_min_bytes`` are never read straight into the engine; above
    it, ``costs`` picks between the direct reads and staging + conversion (see :class:`CostModel`).

    Raises IncompatibleLayout for pairs no conversion serves, InvalidArgument for block lists
    that disagree with the layouts.
    """
    check_pair(remote, local.spec)
    sources = choose_sources(remote, local.spec)
    local_ids = np.asarray(local_block_ids, dtype=np.int64)
    for source in sources:
        validate_pull(remote[source.remote_rank].spec, local.spec, remote_block_ids, local_block_ids, num_tokens)
    reads: list[ReadGroup] = []
    staged: list[StagedSource] = []
    staging_bytes = 0
    for source in sources:
        rview = remote[source.remote_rank]
        rspec = rview.spec
        remote_ids = np.asarray(remote_block_ids, dtype=np.int64)[: rspec.blocks_for(num_tokens)]
        rlay, llay = effective_layouts(rspec, local.spec)
        rside = _Side(rview, rlay, remote_ids, source.remote_head0)
        lside = _Side(local, llay, local_ids, source.local_head0)
        direct_piece, direct_most = _piece_sizes(rside, lside, source.num_heads, max_run_blocks)
        choice = _staging_choice(rside, source, num_tokens, staging_bytes, direct_most, max_run_blocks)
        direct = None
        if direct_piece >= direct_read_min_bytes or choice is None:
            direct = _copy_groups(
                source.remote_rank, rside, lside, source.num_heads, num_tokens, Target.ENGINE, max_run_blocks
            )
        staged_reads = None
        if choice is not None:
            srside, sside, read_heads = choice
            staged_reads = _copy_groups(
                source.remote_rank, srside, sside, read_heads, num_tokens, Target.STAGING, max_run_blocks
            )
        if direct is not None and (
            staged_reads is None
            or not costs.staging_pays(
                direct, staged_reads, sside.view.spec.total_bytes, staging_bytes + sside.view.spec.total_bytes
            )
        ):
            reads += direct
            continue
        assert choice is not None and staged_reads is not None
        rside, sside, read_heads = choice
        reads += staged_reads
        staged.append(
            StagedSource(
                BlockFrame.of(sside.view),
                local_head0=source.local_head0,
                staged_head0=source.remote_head0 - rside.head0,
                num_heads=source.num_heads,
            )
        )
        staging_bytes += sside.view.spec.total_bytes
    postprocess = None
    if staged:
        postprocess = ConvertPostprocess(tuple(staged), BlockFrame.of(local), local_ids, num_tokens)
    return PullPlan(reads=tuple(reads), postprocess=postprocess, staging_bytes=staging_bytes)
