"""Pull plans: which bytes NIXL reads where, and what conversion runs after.

:func:`plan_pull` is a pure function of the two engines' layouts, the block ids on both
sides and the token count. The daemon executes the plan: one NIXL transfer per
:class:`ReadGroup` (a pair of descriptor tables), then the plan's ``postprocess`` if any.

Only committed tokens are read: a partial last block is read token-exact (its tail may hold
KV of rejected draft tokens, which must never leave the holder).
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from kvd.layout import convert_plan
from kvd.layout.geometry import DescGeometry, max_run_log2_for, split_runs
from kvd.layout.plan_types import (
    EngineView,
    Postprocess,
    PullPlan,
    ReadGroup,
    Target,
    check_convertible,
    same_layout,
    validate_pull,
)
from kvd.layout.spec import KvFormat, KvLayout
from kvd_client.errors import IncompatibleLayout

# The plan types are defined in kvd.layout.plan_types and re-exported: callers plan and read
# plans through this module.
__all__ = [
    "EngineView",
    "Postprocess",
    "PullPlan",
    "ReadGroup",
    "Target",
    "block_geometry",
    "check_convertible",
    "partial_block_geometry",
    "plan_pull",
    "same_layout",
    "validate_pull",
]


VIEW_CACHE_SIZE = 1024  # views remembered by identity (engine ranks and groups, local and peers')


def _by_view_identity(
    function: Callable[[EngineView, int], DescGeometry],
) -> Callable[[EngineView, int], DescGeometry]:
    """Look ``function(view, n)`` up by the view's identity before its value.

    Every pull asks for its two engines' geometries, and the views it passes are the same
    objects pull after pull (the registry's, the cached handshake's). Looking an EngineView up by
    value hashes each layer's placement in Python (2 lookups per plan were about half of a small
    pull's planning); by identity it costs a dict lookup. Each entry holds its view, so an id is
    never reused while its entry lives; a view not seen before (a re-registration, a fresh
    handshake) goes to ``function``, which is cached by value. Thread-safe: large pulls plan in
    the daemon's pool."""
    entries: collections.OrderedDict[tuple[int, int], tuple[EngineView, DescGeometry]] = collections.OrderedDict()
    lock = threading.Lock()

    @functools.wraps(function)
    def cached(view: EngineView, n: int) -> DescGeometry:
        key = (id(view), n)
        with lock:
            entry = entries.get(key)
            if entry is not None and entry[0] is view:
                entries.move_to_end(key)
                return entry[1]
        geometry = function(view, n)
        with lock:
            entries[key] = (view, geometry)
            entries.move_to_end(key)
            while len(entries) > VIEW_CACHE_SIZE:
                entries.popitem(last=False)
        return geometry

    return cached


@_by_view_identity
@functools.lru_cache(maxsize=256)
def block_geometry(view: EngineView, max_run_blocks: int) -> DescGeometry:
    """Whole blocks of every plane of every layer, with runs up to ``max_run_blocks``.

    Cached: every pull of an engine pair asks for the same geometry (a pure function of the
    view), and building it walks every layer's planes in Python."""
    spec = view.spec
    if spec.kv_format is KvFormat.JOINT:
        planes = tuple((p.region, p.k_offset) for p in view.placements)
        unit = 2 * spec.block_bytes  # K and V of a block are adjacent: one descriptor
    else:
        planes = tuple((p.region, off) for p in view.placements for off in spec.plane_offsets(p))
        unit = spec.block_bytes
    return DescGeometry(
        planes=planes,
        num_units=spec.num_blocks,
        unit_stride=unit,
        unit_bytes=unit,
        max_run_log2=max_run_log2_for(spec.num_blocks, max_run_blocks, len(planes)),
    )


@_by_view_identity
@functools.lru_cache(maxsize=1024)
def partial_block_geometry(view: EngineView, tokens: int) -> DescGeometry:
    """The first ``tokens`` tokens of any block, every plane (and every head for HND); cached
    like :func:`block_geometry`."""
    spec = view.spec
    if spec.layout is KvLayout.NHD or spec.kv_format is KvFormat.MLA:
        planes = tuple((p.region, off) for p in view.placements for off in spec.plane_offsets(p))
        unit = tokens * spec.token_bytes
    else:
        head_stride = spec.block_size * spec.head_bytes_per_token
        planes = tuple(
            (p.region, off + head * head_stride)
            for p in view.placements
            for off in spec.plane_offsets(p)
            for head in range(spec.num_kv_heads)
        )
        unit = tokens * spec.head_bytes_per_token
    return DescGeometry(planes=planes, num_units=spec.num_blocks, unit_stride=spec.block_stride, unit_bytes=unit)


def _same_layout_group(
    remote_rank: int,
    remote_geo: DescGeometry,
    remote_units: np.ndarray,
    local_geo: DescGeometry,
    local_units: np.ndarray,
) -> ReadGroup:
    """Read units to units across all planes, merging runs of adjacent units.

    Each side keeps its own geometry (its table is the one prepared for its engine, shared by
    every pull from or into it); the runs are cut to the shorter of the two run limits, so each
    index is one both tables hold. (Cutting the geometries instead made a third table per engine
    pair whose limits differ, prepared on that pair's first pull.)"""
    max_run_log2 = min(local_geo.max_run_log2, remote_geo.max_run_log2)
    local_start, remote_start, log2_len, _ = split_runs(local_units, remote_units, max_run_log2)
    # Plane by plane, each plane's runs at the same positions: the first plane's indices offset
    # by each plane's base (no per-plane arrays built per pull).
    local_idx = local_geo.index_every_plane(local_start, log2_len)
    remote_idx = remote_geo.index_every_plane(remote_start, log2_len)
    nbytes = local_geo.nbytes_of(log2_len) * len(local_geo.planes)
    return ReadGroup(remote_rank, remote_geo, remote_idx, Target.ENGINE, local_geo, local_idx, nbytes)


def plan_pull(
    remote: Mapping[int, EngineView],
    local: EngineView,
    remote_block_ids: Sequence[int],
    local_block_ids: Sequence[int],
    num_tokens: int,
    *,
    max_run_blocks: int = 64,
    direct_read_min_bytes: int = 4096,
    costs: convert_plan.CostModel = convert_plan.DEFAULT_COSTS,
) -> PullPlan:
    """Plan reading ``num_tokens`` tokens held in ``remote_block_ids`` into ``local_block_ids``.

    ``remote`` maps the holder's TP ranks to their views (all ranks the holder registered).
    Same layout, block size and TP on both sides: direct reads, whole blocks merged into runs,
    the last partial block token-exact. Other pairs go to the conversion planner.
    """
    if not remote:
        raise IncompatibleLayout("the holder has no engine ranks registered")
    any_remote = next(iter(remote.values())).spec
    check_convertible(any_remote, local.spec)
    validate_pull(any_remote, local.spec, remote_block_ids, local_block_ids, num_tokens)
    local_rank = local.spec.tp_rank
    if same_layout(any_remote, local.spec) and local_rank in remote:
        return _plan_same_layout(
            remote[local_rank], local, remote_block_ids, local_block_ids, num_tokens, max_run_blocks
        )
    return convert_plan.plan_conversion(
        remote,
        local,
        remote_block_ids,
        local_block_ids,
        num_tokens,
        max_run_blocks=max_run_blocks,
        direct_read_min_bytes=direct_read_min_bytes,
        costs=costs,
    )


def _plan_same_layout(
    remote: EngineView,
    local: EngineView,
    remote_block_ids: Sequence[int],
    local_block_ids: Sequence[int],
    num_tokens: int,
    max_run_blocks: int,
) -> PullPlan:
    spec = local.spec
    full_blocks, tail_tokens = divmod(num_tokens, spec.block_size)
    local_ids = np.asarray(local_block_ids, dtype=np.int64)
    remote_ids = np.asarray(remote_block_ids, dtype=np.int64)[: local_ids.size]
    rank = remote.spec.tp_rank
    groups = []
    if full_blocks:
        remote_geo, local_geo = block_geometry(remote, max_run_blocks), block_geometry(local, max_run_blocks)
        groups.append(
            _same_layout_group(rank, remote_geo, remote_ids[:full_blocks], local_geo, local_ids[:full_blocks])
        )
    if tail_tokens:
        remote_geo = partial_block_geometry(remote, tail_tokens)
        local_geo = partial_block_geometry(local, tail_tokens)
        groups.append(
            _same_layout_group(rank, remote_geo, remote_ids[full_blocks:], local_geo, local_ids[full_blocks:])
        )
    return PullPlan(reads=tuple(groups))
