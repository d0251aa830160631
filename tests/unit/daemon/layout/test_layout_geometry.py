"""kvd.layout.geometry: descriptor tables and the power-of-two run splitter."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.layout.geometry import DescGeometry, expand_strided, max_run_log2_for, split_runs

# --- split_runs ---------------------------------------------------------------------------------


@st.composite
def _unit_sequences(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    """Two equally long sequences built from segments that advance together (runs), plus noise."""
    local: list[int] = []
    remote: list[int] = []
    for _ in range(draw(st.integers(0, 8))):
        length = draw(st.integers(1, 40))
        lo = draw(st.integers(0, 500))
        ro = draw(st.integers(0, 500))
        local += range(lo, lo + length)
        remote += range(ro, ro + length)
    return np.array(local, dtype=np.int64), np.array(remote, dtype=np.int64)


def _maximal_runs(local: np.ndarray, remote: np.ndarray) -> list[int]:
    """Lengths of the maximal stretches where both sides advance by one (reference, plain Python)."""
    runs: list[int] = []
    for i in range(local.size):
        if i and local[i] == local[i - 1] + 1 and remote[i] == remote[i - 1] + 1:
            runs[-1] += 1
        else:
            runs.append(1)
    return runs


def _pieces_for(length: int, k: int) -> int:
    """Fewest power-of-two pieces of at most 2**k covering ``length``."""
    return (length >> k) + bin(length & ((1 << k) - 1)).count("1")


@settings(max_examples=300, deadline=None)
@given(seqs=_unit_sequences(), k=st.integers(0, 7))
def test_split_runs_pieces_tile_both_sequences(seqs: tuple[np.ndarray, np.ndarray], k: int) -> None:
    """The pieces, in order, exactly tile both inputs: same cuts on both sides, powers of two <= 2**k."""
    local, remote = seqs
    local_start, remote_start, log2_len, offset = split_runs(local, remote, k)
    assert local_start.shape == remote_start.shape == log2_len.shape == offset.shape
    assert np.all((log2_len >= 0) & (log2_len <= k))
    sizes = np.int64(1) << log2_len
    assert int(sizes.sum()) == local.size
    assert np.array_equal(offset, np.cumsum(sizes) - sizes)  # pieces follow each other without gap
    for ls, rs, size, off in zip(local_start, remote_start, sizes, offset, strict=True):
        assert np.array_equal(local[off : off + size], np.arange(ls, ls + size))
        assert np.array_equal(remote[off : off + size], np.arange(rs, rs + size))


@settings(max_examples=300, deadline=None)
@given(seqs=_unit_sequences(), k=st.integers(0, 7))
def test_split_runs_merges_maximal_runs(seqs: tuple[np.ndarray, np.ndarray], k: int) -> None:
    """Each maximal run of length L costs exactly (L >> k) + popcount(L mod 2**k) pieces."""
    local, remote = seqs
    _, _, log2_len, _ = split_runs(local, remote, k)
    assert log2_len.size == sum(_pieces_for(length, k) for length in _maximal_runs(local, remote))


@settings(deadline=None)
@given(n=st.integers(1, 5000), k=st.integers(0, 10), lo=st.integers(0, 100), ro=st.integers(0, 100))
def test_contiguous_input_gives_popcount_pieces_largest_first(n: int, k: int, lo: int, ro: int) -> None:
    """n contiguous units split into n >> k pieces of 2**k then one piece per set low bit, largest first."""
    local_start, remote_start, log2_len, offset = split_runs(np.arange(lo, lo + n), np.arange(ro, ro + n), k)
    assert log2_len.size == _pieces_for(n, k)
    assert np.all(np.diff(log2_len) <= 0)
    assert np.array_equal(local_start - lo, offset) and np.array_equal(remote_start - ro, offset)


def test_split_runs_small_examples() -> None:
    """Hand-checked cuts: 7 adjacent units with k=2 are 4+2+1; a break on one side splits the run."""
    ls, rs, lg, off = split_runs(np.arange(7), np.arange(10, 17), 2)
    assert ls.tolist() == [0, 4, 6] and rs.tolist() == [10, 14, 16] and lg.tolist() == [2, 1, 0]
    assert off.tolist() == [0, 4, 6]
    # Local is contiguous but remote jumps after 2 units: two runs (2, 1).
    ls, rs, lg, off = split_runs(np.array([5, 6, 7]), np.array([0, 1, 9]), 3)
    assert ls.tolist() == [5, 7] and rs.tolist() == [0, 9] and lg.tolist() == [1, 0] and off.tolist() == [0, 2]
    # k = 0: one piece per unit, even when adjacent.
    assert split_runs(np.arange(3), np.arange(3), 0)[2].tolist() == [0, 0, 0]


def test_split_runs_empty_and_mismatched() -> None:
    """Empty input gives no pieces; inputs of different shape are refused."""
    assert all(a.size == 0 for a in split_runs(np.array([], dtype=np.int64), np.array([], dtype=np.int64), 3))
    with pytest.raises(ValueError, match="differ in shape"):
        split_runs(np.arange(3), np.arange(4), 2)
    with pytest.raises(ValueError):
        split_runs(np.zeros((2, 2)), np.zeros((2, 2)), 2)


@settings(deadline=None)
@given(n=st.integers(1, 10_000), m=st.integers(1, 4096))
def test_max_run_log2_for(n: int, m: int) -> None:
    """max_run_log2_for(n, m) is the largest k with 2**k <= min(n, m)."""
    k = max_run_log2_for(n, m)
    assert (1 << k) <= min(n, m) < (1 << (k + 1))


# --- DescGeometry -------------------------------------------------------------------------------

REGIONS = (0x7F00_0000_0000, 0x1_0000_0000, 0x5000)


@st.composite
def _geometries(draw: st.DrawFn) -> DescGeometry:
    num_units = draw(st.integers(1, 40))
    unit_bytes = draw(st.integers(1, 64))
    runs = draw(st.booleans())
    planes = tuple(
        (draw(st.integers(0, len(REGIONS) - 1)), draw(st.integers(0, 1 << 20))) for _ in range(draw(st.integers(1, 4)))
    )
    if runs:
        return DescGeometry(
            planes, num_units, unit_bytes, unit_bytes, draw(st.integers(0, max_run_log2_for(num_units, 64)))
        )
    return DescGeometry(planes, num_units, unit_bytes + draw(st.integers(0, 100)), unit_bytes, 0)


@settings(max_examples=200, deadline=None)
@given(geo=_geometries(), device=st.integers(0, 7))
def test_rows_for_matches_descriptors(geo: DescGeometry, device: int) -> None:
    """rows_for(idx) is row idx of descriptors(), for every index of the table."""
    table = geo.descriptors(REGIONS, device)
    assert table.shape == (geo.table_size, 3)
    assert np.array_equal(geo.rows_for(np.arange(geo.table_size), REGIONS, device), table)
    assert np.all(table[:, 2] == device)


@settings(max_examples=200, deadline=None)
@given(geo=_geometries())
def test_index_names_the_row_of_each_run(geo: DescGeometry) -> None:
    """index(plane, start, log2) is a bijection onto the table, and its row is that run's bytes."""
    p, c, s = np.meshgrid(
        np.arange(len(geo.planes)), np.arange(geo.run_classes), np.arange(geo.num_units), indexing="ij"
    )
    idx = geo.index(p.ravel(), s.ravel(), c.ravel())
    assert idx.dtype == np.int32
    assert sorted(idx.tolist()) == list(range(geo.table_size))
    rows = geo.descriptors(REGIONS)[idx]
    region = np.array([geo.planes[i][0] for i in p.ravel()])
    offset = np.array([geo.planes[i][1] for i in p.ravel()])
    expected_addr = np.array(REGIONS, dtype=np.int64)[region] + offset + s.ravel() * geo.unit_stride
    expected_len = np.minimum(1 << c.ravel(), geo.num_units - s.ravel()) * geo.unit_bytes
    assert np.array_equal(rows[:, 0], expected_addr)
    assert np.array_equal(rows[:, 1], expected_len)


@settings(max_examples=200, deadline=None)
@given(geo=_geometries(), data=st.data())
def test_index_every_plane_is_index_of_each_plane_in_turn(geo: DescGeometry, data: st.DataObject) -> None:
    """index_every_plane(start, log2) is index() with the runs tiled over the planes, plane by
    plane (what a same-layout plan reads: every plane's runs at the same units)."""
    log2 = np.array(data.draw(st.lists(st.integers(0, geo.max_run_log2), max_size=8)), dtype=np.int64)
    start = np.array([data.draw(st.integers(0, geo.num_units - 1)) for _ in log2], dtype=np.int64)
    planes = len(geo.planes)
    expected = geo.index(np.repeat(np.arange(planes), log2.size), np.tile(start, planes), np.tile(log2, planes))
    got = geo.index_every_plane(start, log2)
    assert got.dtype == np.int32
    assert np.array_equal(got, expected)


@settings(max_examples=200, deadline=None)
@given(geo=_geometries(), device=st.integers(0, 7))
def test_the_compressed_table_is_the_table_in_a_few_rows_none_overlapping(geo: DescGeometry, device: int) -> None:
    """strided() (NIXL's Nx5 form) expands to exactly descriptors(); each row's descriptors are
    at least their length apart (NIXL refuses overlapping ones), and a plane takes at most two
    rows per residue of each run class, whatever its number of units."""
    rows = geo.strided(REGIONS, device)
    assert rows.shape[1] == 5 and np.all(rows[:, 4] >= 1)
    assert np.array_equal(expand_strided(rows), geo.descriptors(REGIONS, device))
    assert np.all(rows[:, 3] >= rows[:, 1])
    assert rows.shape[0] <= len(geo.planes) * 2 * ((1 << geo.run_classes) - 1)


def test_a_large_engine_table_is_compressed_to_rows_per_plane() -> None:
    """Llama-8B-shaped, 10,000 blocks, runs up to 32 blocks: 3.84 million descriptors in 7,680 rows
    (per plane and run class of 2**c blocks: one row per residue, and one for each of the 2**c - 1
    residues whose last run the end of the plane cuts short)."""
    geo = DescGeometry(tuple((0, i * (10_000 << 15)) for i in range(64)), 10_000, 1 << 15, 1 << 15, 5)
    rows = geo.strided([1 << 40])
    assert geo.table_size == 64 * 6 * 10_000 and int(rows[:, 4].sum()) == geo.table_size
    assert rows.shape[0] == 64 * sum((1 << c) + (1 << c) - 1 for c in range(6)) == 7680


@settings(max_examples=200, deadline=None)
@given(geo=_geometries())
def test_runs_never_cross_the_end_of_a_plane(geo: DescGeometry) -> None:
    """Every descriptor, run or not, ends at or before the last unit of its plane."""
    rows = geo.descriptors(REGIONS)
    plane_of_row = np.arange(geo.table_size) // (geo.run_classes * geo.num_units)
    base = np.array([REGIONS[r] + o for r, o in geo.planes], dtype=np.int64)[plane_of_row]
    plane_end = base + (geo.num_units - 1) * geo.unit_stride + geo.unit_bytes
    assert np.all(rows[:, 0] >= base)
    assert np.all(rows[:, 0] + rows[:, 1] <= plane_end)
    assert np.all(rows[:, 1] >= geo.unit_bytes)


@settings(max_examples=200, deadline=None)
@given(seqs=_unit_sequences(), k=st.integers(0, 6))
def test_split_runs_on_valid_units_index_whole_runs(seqs: tuple[np.ndarray, np.ndarray], k: int) -> None:
    """Pieces of valid unit ids fit in the plane, so their descriptors are never truncated and nbytes_of is exact."""
    local, remote = seqs
    if local.size == 0:
        return
    num_units = int(max(local.max(), remote.max())) + 1
    k = min(k, max_run_log2_for(num_units, 64))
    geo = DescGeometry(((0, 0),), num_units, 8, 8, k)
    ls, _, lg, _ = split_runs(local, remote, k)
    assert np.all(ls + (1 << lg) <= num_units)
    rows = geo.rows_for(geo.index(np.zeros_like(ls), ls, lg), [0])
    assert int(rows[:, 1].sum()) == geo.nbytes_of(lg) == local.size * 8


def test_geometry_constructor_refusals() -> None:
    """Runs need adjacent units; an empty geometry (no units, no bytes, no planes) is refused."""
    with pytest.raises(ValueError, match="adjacent units"):
        DescGeometry(((0, 0),), 8, 32, 16, 2)
    with pytest.raises(ValueError, match="empty"):
        DescGeometry(((0, 0),), 0, 16, 16)
    with pytest.raises(ValueError, match="empty"):
        DescGeometry(((0, 0),), 4, 16, 0)
    with pytest.raises(ValueError, match="empty"):
        DescGeometry((), 4, 16, 16)


def test_geometry_is_hashable_and_sized() -> None:
    """Geometries key the prepared-table cache: equal geometries hash equal; table_size counts every row."""
    a = DescGeometry(((0, 0), (0, 4096)), 16, 256, 256, 3)
    b = DescGeometry(((0, 0), (0, 4096)), 16, 256, 256, 3)
    assert a == b and hash(a) == hash(b)
    assert a.run_classes == 4
    assert a.table_size == 2 * 4 * 16
    assert a.nbytes_of(np.array([3, 0, 1])) == (8 + 1 + 2) * 256


def test_run_tables_give_up_long_runs_before_outgrowing_the_budget() -> None:
    """A huge engine gets shorter runs (smaller k) rather than a table of tens of millions of rows."""
    from kvd.layout.geometry import TABLE_DESCRIPTOR_BUDGET, max_run_log2_for

    assert max_run_log2_for(1000, 64, planes=64) == 6  # 64 * 7 * 1000 rows: within the budget
    k = max_run_log2_for(50_000, 64, planes=64)
    assert k < 6 and 64 * (k + 1) * 50_000 <= TABLE_DESCRIPTOR_BUDGET
    assert max_run_log2_for(10**7, 64, planes=64) == 0  # nothing smaller than one row per block


@pytest.mark.parametrize("seed", range(8))
def test_short_sequences_are_cut_in_python_exactly_as_numpy_cuts_them(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """split_runs cuts sequences of up to SMALL_SPLIT units in plain Python (a small pull's
    planning): the same pieces, in the same order and dtype, as the vectorised path."""
    from kvd.layout import geometry

    rng = np.random.default_rng(seed)
    cases = []
    for trial in range(500):
        n = int(rng.integers(1, geometry.SMALL_SPLIT + 1))
        if trial % 2:
            local = np.sort(rng.choice(100, n, replace=False))
            remote = np.sort(rng.choice(100, n, replace=False))
        else:  # mostly adjacent, with breaks on either side
            local = int(rng.integers(0, 50)) + np.cumsum(1 + (rng.random(n) < 0.2) * rng.integers(1, 4, n))
            remote = int(rng.integers(0, 50)) + np.cumsum(1 + (rng.random(n) < 0.1))
        cases.append((local, remote, int(rng.integers(0, 7))))
    small = [geometry.split_runs(local, remote, k) for local, remote, k in cases]
    monkeypatch.setattr(geometry, "SMALL_SPLIT", 0)
    for (local, remote, k), got in zip(cases, small, strict=True):
        want = geometry.split_runs(local, remote, k)
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b), (local, remote, k)
