"""A step's READs as one NIXL transfer (kvd.core.step_reads, kvd.core.read_batches.ReadBatcher).

The merged index arrays must read exactly the byte pairs the pulls' own arrays read (checked
unit pair by unit pair, against the geometries' own rows), adjacent blocks across pulls must
become one descriptor per plane, and every READ a step READ carries must get its outcome while
the book forgets the step READ exactly when no SETTLED will follow.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import numpy as np
import pytest

from kvd.core import notif
from kvd.core.read_batches import ReadBatcher, StepReadBook
from kvd.core.step_reads import Queued, StepPart, combine, merge_indices
from kvd.dataplane_protocol import ReadOrder
from kvd.layout.geometry import DescGeometry, split_runs

UNIT = 4096


def geometry(planes: int, units: int, max_run_log2: int) -> DescGeometry:
    plane_bytes = units * UNIT
    return DescGeometry(
        planes=tuple((0, p * plane_bytes) for p in range(planes)),
        num_units=units,
        unit_stride=UNIT,
        unit_bytes=UNIT,
        max_run_log2=max_run_log2,
    )


def pull_indices(
    local: DescGeometry, remote: DescGeometry, local_blocks: np.ndarray, remote_blocks: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """A same-layout pull's arrays, as kvd.layout.plan cuts them."""
    max_log2 = min(local.max_run_log2, remote.max_run_log2)
    l_start, r_start, log2, _ = split_runs(local_blocks, remote_blocks, max_log2)
    return local.index_every_plane(l_start, log2), remote.index_every_plane(r_start, log2)


def unit_pairs(local: DescGeometry, remote: DescGeometry, l_idx: np.ndarray, r_idx: np.ndarray) -> list[tuple]:
    """Every (local address, remote address) of UNIT bytes the arrays read, sorted."""
    l_rows = local.rows_for(l_idx, [1 << 40])
    r_rows = remote.rows_for(r_idx, [1 << 41])
    assert np.array_equal(l_rows[:, 1], r_rows[:, 1]), "a descriptor pair of unequal lengths"
    pairs = []
    for (la, length, _), (ra, _, _) in zip(l_rows.tolist(), r_rows.tolist(), strict=True):
        pairs += [(la + k, ra + k) for k in range(0, length, UNIT)]
    return sorted(pairs)


@pytest.mark.parametrize("seed", range(40))
def test_a_merged_step_reads_exactly_the_pulls_bytes(seed: int) -> None:
    rng = np.random.default_rng(seed)
    planes, units = int(rng.integers(1, 5)), int(rng.integers(8, 80))
    local = geometry(planes, units, int(rng.integers(0, 5)))
    remote = geometry(planes, units, int(rng.integers(0, 5)))
    free_local, free_remote = rng.permutation(units), rng.permutation(units)
    if seed % 3 == 0:  # an engine that hands out blocks in order: most of them adjacent
        free_local, free_remote = np.arange(units), np.arange(units)
    local_parts, remote_parts, expected = [], [], []
    taken = 0
    for _ in range(int(rng.integers(2, 9))):
        n = int(rng.integers(1, 6))
        if taken + n > units:
            break
        lb, rb = np.sort(free_local[taken : taken + n]), free_remote[taken : taken + n]
        taken += n
        l_idx, r_idx = pull_indices(local, remote, lb, rb)
        local_parts.append(l_idx)
        remote_parts.append(r_idx)
        expected += unit_pairs(local, remote, l_idx, r_idx)
    merged_l, merged_r = merge_indices(local, remote, local_parts, remote_parts)
    assert merged_l.dtype == np.int32 and merged_r.dtype == np.int32
    assert unit_pairs(local, remote, merged_l, merged_r) == sorted(expected)
    assert merged_l.size <= sum(p.size for p in local_parts)


def test_adjacent_one_block_pulls_become_one_descriptor_per_plane() -> None:
    """32 one-block pulls of consecutive blocks on both sides, 64 planes (a 32-layer model's K
    and V): 2,048 descriptors as 32 transfers, 64 as one step READ."""
    local, remote = geometry(64, 256, 6), geometry(64, 256, 6)
    parts = [pull_indices(local, remote, np.array([100 + i]), np.array([7 + i])) for i in range(32)]
    assert sum(p[0].size for p in parts) == 2048
    merged_l, merged_r = merge_indices(local, remote, [p[0] for p in parts], [p[1] for p in parts])
    assert merged_l.size == merged_r.size == 64
    _, units, log2 = local.runs_at(merged_l)
    assert set(units.tolist()) == {100} and set(log2.tolist()) == {5}


def test_units_of_other_sizes_are_concatenated_not_merged() -> None:
    local = geometry(2, 16, 3)
    remote = DescGeometry(planes=((0, 0), (0, 16 * 2 * UNIT)), num_units=16, unit_stride=2 * UNIT, unit_bytes=2 * UNIT)
    parts_l = [np.array([0, 16 * 4], dtype=np.int32), np.array([1, 16 * 4 + 1], dtype=np.int32)]
    parts_r = [np.array([0, 16], dtype=np.int32), np.array([1, 17], dtype=np.int32)]
    merged_l, merged_r = merge_indices(local, remote, parts_l, parts_r)
    assert merged_l.tolist() == [0, 64, 1, 65] and merged_r.tolist() == [0, 16, 1, 17]


def order(xfer_id: int, *, table: int = 1, peer: str = "p", nbytes: int = 10) -> ReadOrder:
    return ReadOrder(
        xfer_id, table, np.array([xfer_id], np.int32), 2, np.array([xfer_id], np.int32), b"n", peer, nbytes
    )


def part(read_id: str, geo: DescGeometry) -> StepPart:
    return StepPart(geo, geo, notif.ReadNotification("lease-" + read_id, read_id, 0, 1, 10))


def test_combine_groups_what_can_share_a_transfer_and_keeps_the_rest_alone() -> None:
    geo = geometry(1, 64, 0)
    loop = asyncio.new_event_loop()
    try:
        futures = [loop.create_future() for _ in range(6)]
        queued = [
            Queued(order(1), futures[0], part("a", geo)),
            Queued(order(2), futures[1], None),  # no StepPart: alone
            Queued(order(3), futures[2], part("c", geo)),
            Queued(order(4, peer="other"), futures[3], part("d", geo)),  # another peer: alone
            Queued(order(5), futures[4], part("e", geo)),
            Queued(order(6), futures[5], part("f", geo)),
        ]
        ids = iter(range(100, 200))
        postings = combine(queued, lambda: next(ids), most=2)
    finally:
        loop.close()
    assert [p.order.xfer_id for p in postings] == [100, 2, 4, 101]
    assert postings[0].merged == (1, 3) and postings[3].merged == (5, 6)
    assert postings[0].futures == (futures[0], futures[2]) and postings[1].futures == (futures[1],)
    assert postings[0].order.nbytes == 20
    assert [(r.admission_id, r.part) for r in notif.decode_all(postings[0].order.notif)] == [("a", 0), ("c", 0)]
    assert postings[1].order.notif == b"n" and not postings[1].merged


@pytest.mark.parametrize(
    ("answer", "kept"),
    [
        (("posted", "PROC", None), True),  # in flight: its SETTLED settles the READs it carries
        (("posted", "DONE", None), False),  # final within the post: no SETTLED follows
        (("refused", ("PeerUnavailable", "no")), False),
    ],
)
def test_every_read_of_a_step_read_gets_its_outcome(answer: tuple[Any, ...], kept: bool) -> None:
    geo = geometry(1, 64, 2)

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        sent: list[tuple[ReadOrder, ...]] = []
        calls: list[asyncio.Future[Any]] = []

        def submit(op: str, orders: tuple[ReadOrder, ...]) -> asyncio.Future[Any]:
            assert op == "reads"
            sent.append(orders)
            calls.append(loop.create_future())
            return calls[-1]

        ids = iter(range(1000, 2000))
        book = StepReadBook(lambda: next(ids))
        batcher = ReadBatcher(loop, submit, book)
        waiters = [batcher.post(order(i), part(f"r{i}", geo)) for i in range(3)]
        await asyncio.sleep(0)
        assert len(sent) == 1 and len(sent[0]) == 1 and sent[0][0].xfer_id == 1000
        assert len(book) == 1
        calls[0].set_result([answer])
        await asyncio.sleep(0)
        for waiter in waiters:
            if answer[0] == "posted":
                assert waiter.result() == (answer[1], answer[2])
            else:
                assert isinstance(waiter.exception(), Exception)
        assert len(book) == (1 if kept else 0)
        if kept:
            assert book.settled(1000) == (0, 1, 2) and len(book) == 0

    asyncio.run(scenario())


def test_a_lost_worker_fails_every_read_of_a_step_read_and_forgets_it() -> None:
    geo = geometry(1, 64, 2)

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        call: asyncio.Future[Any] = loop.create_future()
        book = StepReadBook(iter(range(1000, 2000)).__next__)
        batcher = ReadBatcher(loop, lambda op, orders: call, book)
        waiters = [batcher.post(order(i), part(f"r{i}", geo)) for i in range(2)]
        await asyncio.sleep(0)
        call.set_exception(RuntimeError("worker lost"))
        await asyncio.sleep(0)
        assert all(isinstance(w.exception(), RuntimeError) for w in waiters) and len(book) == 0

    asyncio.run(scenario())


def test_a_read_built_from_its_tag_is_what_its_notification_decodes_to() -> None:
    rng = random.Random(40)
    for _ in range(500):
        lease = "".join(rng.choice("abc-_.09") for _ in range(rng.randint(1, 300)))
        admission = "".join(rng.choice("xyz12") for _ in range(rng.randint(1, 64)))
        parts = rng.randint(1, 9)
        part, nbytes = rng.randrange(parts), rng.choice([0, 1, 2 << 20, 10**15])
        tag = notif.tag(lease, admission)
        assert notif.read_of(tag, part, parts, nbytes) == notif.decode(notif.encode(tag, part, parts, nbytes))
    for bad_tag in ("kvd1|l|a", "kvd2|l", "kvd2||a", "kvd2|l|a|x", "kvd2|" + "l" * 600 + "|a"):
        assert notif.read_of(bad_tag, 0, 1, 5) is None, bad_tag
    assert notif.read_of("kvd2|l|a", 1, 1, 5) is None and notif.read_of("kvd2|l|a", 0, 1, -1) is None


def test_step_notifications_round_trip_and_refuse_what_is_not_one() -> None:
    reads = [notif.ReadNotification(f"lease{i}", f"adm{i}", i % 2, 2, 1 << 20) for i in range(64)]
    assert notif.decode_all(notif.encode_many(reads)) == reads
    lone = notif.encode_many(reads[:1])
    assert lone.startswith(b"kvd2|") and notif.decode_all(lone) == reads[:1]
    good = notif.encode_many(reads[:2])
    hostile = [
        b"kvd3|65|" + b"|".join([b"l|a|0|1|1"] * 65),  # more reads than a step holds
        b"kvd3|1|l|a|0|1|1",  # a step of one: never sent
        b"kvd3|2|l|a|0|1|1",  # fewer reads than counted
        b"kvd3|x|l|a|0|1|1|l|b|0|1|1",
        b"kvd3|2|l|a|0|1|1|l||0|1|1",  # an empty admission
        b"kvd3|2|l|a|0|1|1|l|b|1|1|1",  # part 1 of 1
        b"kvd3|2|l|a|0|1|1|l|b|0|1|-5",
        b"kvd3|2|l|a|0|1|1|l|b|0|1|z",
        b"kvd3|2|" + b"x" * (64 * 512),  # too long
        good.rsplit(b"|", 1)[0],  # a field short
        b"kvd3",
        b"kvd3|",
    ]
    for message in hostile:
        assert notif.decode_all(message) == [], message[:60]
    with pytest.raises(ValueError):
        notif.encode_many([])
    with pytest.raises(ValueError):
        notif.encode_many([notif.ReadNotification("l|x", "a", 0, 1, 1)] * 2)


def test_a_step_read_carries_at_most_its_bytes_and_a_large_read_goes_alone() -> None:
    geo = geometry(1, 64, 0)
    loop = asyncio.new_event_loop()
    try:
        sizes = [30, 30, 30, 100, 10, 10]  # most_bytes 64: [30, 30], [30, 10, 10]; 100 alone
        queued = [Queued(order(i + 1, nbytes=n), loop.create_future(), part(f"r{i}", geo)) for i, n in enumerate(sizes)]
        ids = iter(range(100, 200))
        postings = combine(queued, lambda: next(ids), most=64, most_bytes=64)
    finally:
        loop.close()
    assert [(p.merged, p.order.nbytes) for p in postings] == [((1, 2), 60), ((3, 5, 6), 50), ((), 100)]
