"""Descriptor tables: how kvd turns "read these blocks" into a few NIXL descriptors.

NIXL reads byte ranges named by descriptors. kvd prepares, once per engine (and once per
remote engine it reads from), a *table* of descriptors with ``prep_xfer_dlist``; a transfer is
then just two numpy index arrays into two tables (``make_prepped_xfer``). A
:class:`DescGeometry` is the shape of one such table:

* ``planes``: independent byte arrays (e.g. layer 3's K blocks), each ``(region, offset)``;
* ``num_units`` units per plane, unit ``i`` at ``offset + i * unit_stride``, ``unit_bytes`` long;
* when units are adjacent (``unit_stride == unit_bytes``), the table also holds *runs* of
  ``2**k`` units for every ``k <= max_run_log2``, so that a run of adjacent blocks costs one
  descriptor per power of two in its length instead of one per block.

Everything here is pure numpy: the same functions build the tables and the index arrays.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class DescGeometry:
    """Shape of one prepared descriptor table (hashable: used as the table's cache key)."""

    planes: tuple[tuple[int, int], ...]  # (region index, byte offset of unit 0)
    num_units: int
    unit_stride: int
    unit_bytes: int
    max_run_log2: int = 0

    def __hash__(self) -> int:
        """Computed once: a geometry keys the table caches and a step's READs on every pull,
        and hashing its planes (64 for a 32-layer model) each time showed in the profile."""
        cached: int | None = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.planes, self.num_units, self.unit_stride, self.unit_bytes, self.max_run_log2))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __post_init__(self) -> None:
        if self.max_run_log2 and self.unit_stride != self.unit_bytes:
            raise ValueError("runs of units need adjacent units (unit_stride == unit_bytes)")
        if self.num_units < 1 or self.unit_bytes < 1 or not self.planes:
            raise ValueError(f"empty descriptor geometry: {self}")

    @property
    def run_classes(self) -> int:
        return self.max_run_log2 + 1

    @property
    def table_size(self) -> int:
        return len(self.planes) * self.run_classes * self.num_units

    # --- where each run sits in the table ------------------------------------------------------
    #
    # Within one (plane, run class 2**c) block of ``num_units`` descriptors, the runs are ordered by
    # residue ``j = unit mod 2**c``, then by ``unit div 2**c``: the runs of one residue do not
    # overlap (they start 2**c units apart), so each residue is one strided row of NIXL's
    # compressed (Nx5) list form, plus one row for its last run when that is cut short by the end
    # of the plane. A table is then a few rows per plane instead of one per descriptor.

    def _residue_offsets(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(first position, runs, run class) of each residue of each class, flat: class c's
        residue j at ``2**c - 1 + j``; positions count from the start of the class's block."""
        return _residue_offsets(self.num_units, self.max_run_log2)

    def index(self, plane: np.ndarray, start: np.ndarray, log2_len: np.ndarray) -> np.ndarray:
        """Table indices of the runs ``(plane, first unit, log2 of length)`` (int32 for NIXL)."""
        first, _, _ = self._residue_offsets()
        log2 = np.asarray(log2_len, dtype=np.int64)
        units = np.asarray(start, dtype=np.int64)
        residue = units & ((np.int64(1) << log2) - 1)
        position = first[(np.int64(1) << log2) - 1 + residue] + (units >> log2)
        idx = (np.asarray(plane, dtype=np.int64) * self.run_classes + log2) * self.num_units + position
        return idx.astype(np.int32)

    def index_every_plane(self, start: np.ndarray, log2_len: np.ndarray) -> np.ndarray:
        """Table indices of the runs ``(first unit, log2 of length)`` in every plane, plane by plane:
        :meth:`index` of each plane repeated over the runs, each run tiled over the planes, without
        building those arrays. A run sits at the same position of every plane's block, so each
        plane's indices are the first plane's offset by the plane's base (int32 for NIXL)."""
        first, _, _ = self._residue_offsets()
        base = _plane_bases(len(self.planes), self.run_classes * self.num_units)
        log2 = np.asarray(log2_len, dtype=np.int64)
        units = np.asarray(start, dtype=np.int64)
        if units.size == 1:  # one run (a one-block pull): its offset in Python ints, one numpy add
            unit, c = int(units[0]), int(log2[0])
            return (
                base + (c * self.num_units + int(first[(1 << c) - 1 + (unit & ((1 << c) - 1))]) + (unit >> c))
            ).astype(np.int32)
        residue = units & ((np.int64(1) << log2) - 1)
        offset = log2 * self.num_units + first[(np.int64(1) << log2) - 1 + residue] + (units >> log2)
        return (base[:, None] + offset[None, :]).reshape(-1).astype(np.int32)

    def runs_at(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(plane, first unit, log2 of length) of table indices: the inverse of :meth:`index`."""
        idx = np.asarray(indices, dtype=np.int64)
        position = idx % self.num_units
        rest = idx // self.num_units
        log2 = rest % self.run_classes
        plane = rest // self.run_classes
        first, _, classes = self._residue_offsets()
        keys = classes * self.num_units + first  # increasing: classes in order, positions within
        flat = np.searchsorted(keys, log2 * self.num_units + position, side="right") - 1
        residue = flat - ((np.int64(1) << log2) - 1)
        units = residue + ((position - first[flat]) << log2)
        return plane, units, log2

    def strided(self, region_addresses: Sequence[int], device_id: int = 0) -> np.ndarray:
        """The whole table in NIXL's compressed form: rows (address, length, device, stride, count),
        each ``count`` descriptors ``stride`` bytes apart, in :meth:`index` order."""
        first, runs, classes = self._residue_offsets()
        run = np.int64(1) << classes
        residue = np.arange(first.size, dtype=np.int64) - (run - 1)
        last_unit = residue + (runs - 1) * run
        cut = last_unit + run > self.num_units  # the residue's last run ends past the plane
        # Per residue: its whole runs as one row, then its cut run (if any) as a row of one.
        whole = runs - cut
        lengths = np.stack([run * self.unit_bytes, (self.num_units - last_unit) * self.unit_bytes], axis=1)
        starts = np.stack([residue, last_unit], axis=1) * self.unit_stride
        counts = np.stack([whole, cut.astype(np.int64)], axis=1)
        keep = counts.reshape(-1) > 0
        template = np.empty((keep.sum(), 4), dtype=np.int64)  # offset in plane, length, stride, count
        template[:, 0] = starts.reshape(-1)[keep]
        template[:, 1] = lengths.reshape(-1)[keep]
        template[:, 2] = np.repeat(run * self.unit_stride, 2)[keep]
        template[:, 3] = counts.reshape(-1)[keep]
        # Row order within a plane: classes in order, residues in order (``first`` is increasing).
        region_of_plane = np.array([region for region, _ in self.planes], dtype=np.int64)
        plane_base = np.asarray(region_addresses, dtype=np.int64)[region_of_plane] + np.array(
            [offset for _, offset in self.planes], dtype=np.int64
        )
        rows = np.empty((len(self.planes) * template.shape[0], 5), dtype=np.int64)
        rows[:, 0] = (plane_base[:, None] + template[None, :, 0]).reshape(-1)
        rows[:, 1] = np.tile(template[:, 1], len(self.planes))
        rows[:, 2] = device_id
        rows[:, 3] = np.tile(template[:, 2], len(self.planes))
        rows[:, 4] = np.tile(template[:, 3], len(self.planes))
        return rows

    def descriptors(self, region_addresses: Sequence[int], device_id: int = 0) -> np.ndarray:
        """The table's (address, length, device) rows, in :meth:`index` order (:meth:`strided`, expanded)."""
        return expand_strided(self.strided(region_addresses, device_id))

    def rows_for(self, indices: np.ndarray, region_addresses: Sequence[int], device_id: int = 0) -> np.ndarray:
        """The (address, length, device) rows of just these table indices (for one-off lists)."""
        plane, start, log2_len = self.runs_at(indices)
        region_of_plane = np.array([region for region, _ in self.planes], dtype=np.int64)
        plane_offset = np.array([offset for _, offset in self.planes], dtype=np.int64)
        base = np.asarray(region_addresses, dtype=np.int64)[region_of_plane[plane]] + plane_offset[plane]
        length = np.minimum(np.int64(1) << log2_len, self.num_units - start) * self.unit_bytes
        rows = np.empty((start.size, 3), dtype=np.int64)
        rows[:, 0] = base + start * self.unit_stride
        rows[:, 1] = length
        rows[:, 2] = device_id
        return rows

    def nbytes_of(self, log2_len: np.ndarray) -> int:
        """Bytes moved by runs of these lengths."""
        return int(((np.int64(1) << log2_len.astype(np.int64)) * self.unit_bytes).sum())


@functools.lru_cache(maxsize=256)
def _plane_bases(planes: int, plane_size: int) -> np.ndarray:
    """The first table index of each plane (cached: every pull of a geometry offsets the same ones)."""
    bases = np.arange(planes, dtype=np.int64) * plane_size
    bases.flags.writeable = False
    return bases


@functools.lru_cache(maxsize=256)
def _residue_offsets(num_units: int, max_run_log2: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """See :meth:`DescGeometry._residue_offsets` (cached: a pure function of two ints)."""
    firsts, runs = [], []
    for c in range(max_run_log2 + 1):
        run = 1 << c
        count = (num_units - np.arange(run, dtype=np.int64) + run - 1) // run  # units of each residue
        firsts.append(np.cumsum(count) - count)
        runs.append(count)
    first, count = np.concatenate(firsts), np.concatenate(runs)
    classes = np.repeat(np.arange(max_run_log2 + 1, dtype=np.int64), np.int64(1) << np.arange(max_run_log2 + 1))
    for array in (first, count, classes):
        array.flags.writeable = False
    return first, count, classes


def expand_strided(rows: np.ndarray) -> np.ndarray:
    """NIXL's compressed rows (address, length, device, stride, count) as one (address, length,
    device) row per descriptor: for a NIXL without the compressed form, and for tests."""
    counts = rows[:, 4]
    which = np.repeat(np.arange(rows.shape[0]), counts)
    step = np.arange(which.size, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    out = np.empty((which.size, 3), dtype=np.int64)
    out[:, 0] = rows[which, 0] + step * rows[which, 3]
    out[:, 1] = rows[which, 1]
    out[:, 2] = rows[which, 2]
    return out


# A run table holds planes * (k + 1) * units descriptors; a NIXL that takes lists only one
# descriptor per row keeps each one in memory per backend, so long runs are given up (smaller k)
# before a table outgrows this. (Compressed, as kvd sends them now, 13.4 million descriptors were
# 15,808 rows, +3 MiB and 1.4 ms to prepare: the budget could count rows once every supported
# NIXL takes the compressed form, giving large engines their longest runs back.)
TABLE_DESCRIPTOR_BUDGET = 1 << 22


def max_run_log2_for(num_units: int, max_run_units: int, planes: int = 1) -> int:
    """Largest k with 2**k <= min(num_units, max_run_units), within the table budget."""
    limit = max(1, min(num_units, max_run_units))
    k = int(limit).bit_length() - 1
    while k and planes * (k + 1) * num_units > TABLE_DESCRIPTOR_BUDGET:
        k -= 1
    return k


def split_runs(
    local_units: np.ndarray, remote_units: np.ndarray, max_run_log2: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Cut two equally long unit sequences into matching power-of-two runs.

    A run is a stretch where both sequences advance by one; it is then cut into pieces of
    ``2**k`` units, largest first, ``k <= max_run_log2``. Both sides get identical cuts, so
    piece ``j`` of the local side is read from piece ``j`` of the remote side.

    Returns ``(local_start, remote_start, log2_len, offset)``: per piece its first unit on each
    side, log2 of its length, and its position (in units) inside the input sequences.
    """
    local_units = np.asarray(local_units, dtype=np.int64)
    remote_units = np.asarray(remote_units, dtype=np.int64)
    if local_units.shape != remote_units.shape or local_units.ndim != 1:
        raise ValueError(f"unit sequences differ in shape: {local_units.shape} vs {remote_units.shape}")
    n = local_units.size
    if 0 < n <= SMALL_SPLIT:
        return _split_runs_small(local_units.tolist(), remote_units.tolist(), max_run_log2)
    if n == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty, empty
    if max_run_log2 == 0:
        zeros = np.zeros(n, dtype=np.int64)
        return local_units, remote_units, zeros, np.arange(n, dtype=np.int64)
    breaks = np.flatnonzero((np.diff(local_units) != 1) | (np.diff(remote_units) != 1)) + 1
    run_start = np.concatenate(([0], breaks))
    run_len = np.diff(np.concatenate((run_start, [n])))
    classes = np.arange(max_run_log2, -1, -1, dtype=np.int64)  # largest first
    counts = (run_len[:, None] >> classes[None, :]) & 1
    counts[:, 0] = run_len >> max_run_log2  # any number of the largest pieces
    piece_log2 = np.repeat(np.tile(classes, run_start.size), counts.reshape(-1))
    piece_run = np.repeat(np.repeat(np.arange(run_start.size), classes.size), counts.reshape(-1))
    sizes = np.int64(1) << piece_log2
    offset = np.cumsum(sizes) - sizes  # position of each piece in the whole sequence
    return (
        local_units[run_start[piece_run]] + (offset - run_start[piece_run]),
        remote_units[run_start[piece_run]] + (offset - run_start[piece_run]),
        piece_log2,
        offset,
    )


SMALL_SPLIT = 16
"""Sequences this short are cut in plain Python (:func:`_split_runs_small`): numpy's per-call
cost was most of a small pull's planning (32 of 53 us for one block, timeit on the 2-core VM)."""


def _split_runs_small(
    local: list[int], remote: list[int], max_run_log2: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`split_runs` of short sequences, the same pieces in the same order."""
    out_local: list[int] = []
    out_remote: list[int] = []
    out_log2: list[int] = []
    out_offset: list[int] = []
    n = len(local)
    start = 0
    while start < n:
        end = start + 1
        if max_run_log2:
            while end < n and local[end] - local[end - 1] == 1 and remote[end] - remote[end - 1] == 1:
                end += 1
        position = start
        length = end - start
        for k in range(max_run_log2, -1, -1):  # largest first; any number of the largest pieces
            size = 1 << k
            count = length // size if k == max_run_log2 else (length >> k) & 1
            for _ in range(count):
                out_local.append(local[start] + position - start)
                out_remote.append(remote[start] + position - start)
                out_log2.append(k)
                out_offset.append(position)
                position += size
            if k == max_run_log2:
                length -= count * size
        start = end
    return (
        np.array(out_local, dtype=np.int64),
        np.array(out_remote, dtype=np.int64),
        np.array(out_log2, dtype=np.int64),
        np.array(out_offset, dtype=np.int64),
    )
