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

    def index(self, plane: np.ndarray, start: np.ndarray, log2_len: np.ndarray) -> np.ndarray:
        """Table indices of the runs ``(plane, first unit, log2 of length)`` (int32 for NIXL)."""
        idx = (plane.astype(np.int64) * self.run_classes + log2_len) * self.num_units + start
        return idx.astype(np.int32)

    def descriptors(self, region_addresses: Sequence[int], device_id: int = 0) -> np.ndarray:
        """The table's (address, length, device) rows, in :meth:`index` order."""
        region_of_plane = np.array([region for region, _ in self.planes], dtype=np.int64)
        plane_base = np.asarray(region_addresses, dtype=np.int64)[region_of_plane] + np.array(
            [offset for _, offset in self.planes], dtype=np.int64
        )
        units = np.arange(self.num_units, dtype=np.int64)
        run_len = np.minimum(
            (np.int64(1) << np.arange(self.run_classes, dtype=np.int64))[:, None], self.num_units - units[None, :]
        )  # [classes, units]: a run may not cross the end of the plane
        addr = plane_base[:, None, None] + (units * self.unit_stride)[None, None, :]
        addr = np.broadcast_to(addr, (len(self.planes), self.run_classes, self.num_units))
        length = np.broadcast_to((run_len * self.unit_bytes)[None], addr.shape)
        rows = np.empty((self.table_size, 3), dtype=np.int64)
        rows[:, 0] = addr.reshape(-1)
        rows[:, 1] = length.reshape(-1)
        rows[:, 2] = device_id
        return rows

    def rows_for(self, indices: np.ndarray, region_addresses: Sequence[int], device_id: int = 0) -> np.ndarray:
        """The (address, length, device) rows of just these table indices (for one-off lists)."""
        idx = np.asarray(indices, dtype=np.int64)
        start = idx % self.num_units
        rest = idx // self.num_units
        log2_len = rest % self.run_classes
        plane = rest // self.run_classes
        region_of_plane = np.array([region for region, _ in self.planes], dtype=np.int64)
        plane_offset = np.array([offset for _, offset in self.planes], dtype=np.int64)
        base = np.asarray(region_addresses, dtype=np.int64)[region_of_plane[plane]] + plane_offset[plane]
        length = np.minimum(np.int64(1) << log2_len, self.num_units - start) * self.unit_bytes
        rows = np.empty((idx.size, 3), dtype=np.int64)
        rows[:, 0] = base + start * self.unit_stride
        rows[:, 1] = length
        rows[:, 2] = device_id
        return rows

    def nbytes_of(self, log2_len: np.ndarray) -> int:
        """Bytes moved by runs of these lengths."""
        return int(((np.int64(1) << log2_len.astype(np.int64)) * self.unit_bytes).sum())


# A run table holds planes * (k + 1) * units descriptors; NIXL keeps each one in memory per
# backend, so long runs are given up (smaller k) before a table outgrows this.
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
