"""Large host READs are cut into equal descriptors for NIXL's copy threads (kvd.worker.nixl_reads).

NIXL's UCX thread pool splits a transfer by its descriptor count, not its bytes, and a 2 MiB
pull has as many runs as a 128 MiB one; so the worker re-cuts a large READ's runs into about
``copy_threads`` x SPLIT_BATCH_SIZE equal descriptors of the same bytes. These tests check the
cut (every byte once, in order, matching sides), the rows each prepared list remembers, which
READs take the path, and that its poller sleeps instead of spinning. A fake agent stands in for
NIXL; tests/integration/test_pull.py moves real bytes through it.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Any

import numpy as np
import pytest

from kvd.dataplane_protocol import LOCAL_AGENT
from kvd.layout.geometry import DescGeometry, expand_strided
from kvd.worker import nixl_agent, nixl_reads
from kvd.worker.nixl_agent import NixlAgent
from kvd.worker.nixl_reads import NixlRead, PostedRead, PreparedTable, build_parallel_xfer, copies_in_parallel, cut_runs
from kvd_client.errors import Internal

MIB = 1 << 20
WAIT_S = 10.0


def _geometry() -> DescGeometry:
    # 4 planes in two regions, 16 blocks of 32 KiB, runs up to 8 blocks.
    return DescGeometry(
        planes=((0, 0), (0, 1 << 20), (1, 0), (1, 1 << 20)),
        num_units=16,
        unit_stride=32 << 10,
        unit_bytes=32 << 10,
        max_run_log2=3,
    )


@pytest.mark.parametrize("compressed", [True, False])
def test_a_prepared_table_resolves_any_index_to_the_descriptor_nixl_prepared(compressed: bool) -> None:
    strided = _geometry().strided([1 << 30, 3 << 30], device_id=0)
    expanded = expand_strided(strided)
    table = PreparedTable.of(object(), "peer", "DRAM", strided if compressed else expanded)
    indices = np.random.default_rng(5).integers(0, expanded.shape[0], 500)
    address, length, device = table.descriptors(indices)
    assert np.array_equal(address, expanded[indices, 0])
    assert np.array_equal(length, expanded[indices, 1])
    assert np.array_equal(device, expanded[indices, 2])


@pytest.mark.parametrize(
    "lengths",
    [[2 * MIB] * 64, [96 << 10] * 700, [3 * MIB, 4096, 5 * MIB + 123, 1], [1 << 27]],
)
@pytest.mark.parametrize("pieces", [512, 1024, 7])
def test_cutting_runs_keeps_every_byte_once_in_order(lengths: list[int], pieces: int) -> None:
    lengths_array = np.array(lengths, dtype=np.int64)
    run, offset, length = cut_runs(lengths_array, pieces)
    assert (length > 0).all()
    assert np.all(np.diff(run) >= 0), "pieces out of run order"
    for index, total in enumerate(lengths):
        mine = run == index
        ends = offset[mine] + length[mine]
        assert offset[mine][0] == 0 and ends[-1] == total
        assert np.array_equal(offset[mine][1:], ends[:-1]), "a gap or an overlap inside a run"
    size = length.max()
    assert (length[:-1][np.diff(run) == 0] == size).all(), "only a run's last piece may be shorter"
    # About the pieces asked for (each run adds at most one short piece).
    assert len(length) <= pieces + len(lengths)
    if sum(lengths) >= pieces * len(lengths):
        assert len(length) >= min(pieces, sum(lengths)) - 1


class FakeNixl:
    """The agent calls of the parallel path, recorded."""

    def __init__(self) -> None:
        self.built: list[tuple[np.ndarray, np.ndarray, str, bytes]] = []
        self.prepped = 0
        self.lock = threading.Lock()
        self.finished = False

    def get_xfer_descs(self, rows: np.ndarray, mem_type: str) -> np.ndarray:
        assert mem_type == "DRAM"
        return np.array(rows)

    def initialize_xfer(self, _op: str, local: np.ndarray, remote: np.ndarray, peer: str, notif: bytes) -> int:
        with self.lock:
            self.built.append((local, remote, peer, notif))
            return len(self.built) - 1

    def make_prepped_xfer(self, *_args: Any) -> int:
        with self.lock:
            self.prepped += 1
            return 1000 + self.prepped

    def transfer(self, _handle: int) -> str:
        return "PROC"

    def check_xfer_state(self, _handle: int) -> str:
        with self.lock:
            return "DONE" if self.finished else "PROC"

    def release_xfer_handle(self, _handle: int) -> None:
        pass

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        return {}


def _tables(local_mem: str = "DRAM", remote_mem: str = "DRAM", remote_agent: str = "peer-agent") -> tuple:
    geometry = _geometry()
    local = PreparedTable.of(object(), LOCAL_AGENT, local_mem, geometry.strided([1 << 30, 3 << 30]))
    remote = PreparedTable.of(object(), remote_agent, remote_mem, geometry.strided([5 << 30, 7 << 30]))
    return local, remote


def _merged(address: np.ndarray, length: np.ndarray) -> list[tuple[int, int]]:
    """Byte ranges in order, adjacent ones joined: two cuts of the same bytes compare equal."""
    out: list[list[int]] = []
    for a, n in zip(address.tolist(), length.tolist(), strict=True):
        if out and out[-1][0] + out[-1][1] == a:
            out[-1][1] += n
        else:
            out.append([a, n])
    return [(a, n) for a, n in out]


def _agent(copy_threads: int = 2, min_bytes: int = MIB) -> tuple[NixlAgent, FakeNixl]:
    agent = NixlAgent("me", copy_threads=copy_threads, parallel_min_bytes=min_bytes)
    fake = FakeNixl()
    agent.agent = fake
    return agent, fake


def test_a_large_host_read_is_posted_as_equal_descriptors_of_the_same_bytes() -> None:
    agent, fake = _agent(min_bytes=64 << 10)
    local, remote = _tables()
    local_indices = np.array([0, 5, 9, 12, 30, 31], dtype=np.int32)
    remote_indices = np.array([31, 5, 9, 12, 30, 0], dtype=np.int32)  # other places, runs of the same lengths
    nbytes = int(local.descriptors(local_indices)[1].sum())
    read = NixlRead(1, local, local_indices, remote, remote_indices, b"done", "peer-addr", nbytes)
    assert copies_in_parallel(read, agent._copy_threads, agent._parallel_min_bytes)
    build_parallel_xfer(fake, agent.name, read, agent._copy_threads)
    (built_local, built_remote, peer, notif) = fake.built[0]
    assert peer == "peer-agent" and notif == b"done"
    assert built_local.shape == built_remote.shape and built_local.shape[1] == 3
    assert np.array_equal(built_local[:, 1], built_remote[:, 1]), "the two sides were cut differently"
    assert len(built_local) >= 2 * nixl_reads.SPLIT_BATCH_SIZE - len(local_indices), "too few for two threads"
    # The same bytes, in the same order, on each side.
    assert _merged(built_local[:, 0], built_local[:, 1]) == _merged(*local.descriptors(local_indices)[:2])
    assert _merged(built_remote[:, 0], built_remote[:, 1]) == _merged(*remote.descriptors(remote_indices)[:2])


def test_a_read_pairing_runs_of_different_lengths_is_refused() -> None:
    agent, fake = _agent(min_bytes=64 << 10)
    local, remote = _tables()
    read = NixlRead(1, local, np.array([0, 30]), remote, np.array([30, 0]), b"", "peer", 96 << 10)
    with pytest.raises(Internal, match="different lengths"):
        build_parallel_xfer(fake, agent.name, read, agent._copy_threads)
    assert not fake.built


def test_a_read_from_this_agents_own_memory_names_this_agent() -> None:
    agent, fake = _agent()
    local, remote = _tables(remote_agent=LOCAL_AGENT)
    indices = np.arange(8, dtype=np.int32)
    build_parallel_xfer(fake, agent.name, NixlRead(1, local, indices, remote, indices, b"", "me", 8 << 20), 2)
    assert fake.built[0][2] == "me"


@pytest.mark.parametrize(
    ("copy_threads", "nbytes", "local_mem", "remote_mem", "prepared", "expected"),
    [
        (2, 2 * MIB, "DRAM", "DRAM", True, True),
        (2, MIB - 1, "DRAM", "DRAM", True, False),  # below the floor: one thread, prepared lists
        (1, 64 * MIB, "DRAM", "DRAM", True, False),  # no pool
        (2, 64 * MIB, "VRAM", "DRAM", True, False),  # a GPU copy is not a thread's
        (2, 64 * MIB, "DRAM", "VRAM", True, False),
        (2, 64 * MIB, "DRAM", "DRAM", False, False),  # lists without rows (stand-ins)
    ],
)
def test_which_reads_are_copied_in_parallel(
    copy_threads: int, nbytes: int, local_mem: str, remote_mem: str, prepared: bool, expected: bool
) -> None:
    agent, _ = _agent(copy_threads=copy_threads)
    local, remote = _tables(local_mem, remote_mem)
    indices = np.arange(4, dtype=np.int32)
    if not prepared:
        local, remote = object(), object()
    read = NixlRead(1, local, indices, remote, indices, b"", "peer", nbytes)
    assert copies_in_parallel(read, agent._copy_threads, agent._parallel_min_bytes) is expected


def test_a_parallel_read_is_polled_without_spinning_until_its_bytes_time() -> None:
    """The owner thread sleeps while NIXL's threads copy (spinning took one of their cores), then
    polls every POLL_FAST_S; the READ settles once NIXL says DONE."""
    agent, fake = _agent()
    local, remote = _tables()
    indices = np.arange(32, dtype=np.int32)
    nbytes = 64 * MIB
    settled: concurrent.futures.Future[PostedRead] = concurrent.futures.Future()
    agent._on_settled = settled.set_result
    thread = threading.Thread(target=agent._owner.run, daemon=True)
    agent._owner.thread = thread
    thread.start()
    try:
        answered: concurrent.futures.Future[list[Any]] = concurrent.futures.Future()
        posted_at = time.monotonic()
        agent.post_reads([NixlRead(3, local, indices, remote, indices, b"n", "peer", nbytes)], answered.set_result)
        (xfer,) = answered.result(WAIT_S)
        assert isinstance(xfer, PostedRead) and xfer.parallel and fake.prepped == 0
        assert xfer.spin_until == 0.0
        assert xfer.poll_from >= posted_at + nbytes / (nixl_reads.PARALLEL_BYTES_PER_S * 2) - 1e-3
        interval = agent._poll_interval()
        assert interval is not None and interval >= nixl_agent.POLL_FAST_S
        with fake.lock:
            fake.finished = True
        assert settled.result(WAIT_S).xfer_id == 3
    finally:
        agent._owner.stopping = True
        agent._owner.wake()
        thread.join(WAIT_S)


def test_a_table_keeps_its_rows_compressed_where_nixl_is_given_them_expanded() -> None:
    """A NIXL without the compressed form gets one row per descriptor; the table itself keeps
    the few compressed rows (millions of descriptors would otherwise be held twice)."""

    class OldNixl:
        def __init__(self) -> None:
            self.given: np.ndarray | None = None

        def prep_xfer_dlist(self, _agent: str, rows: np.ndarray, _mem: str) -> object:
            self.given = rows
            return object()

    agent = NixlAgent("me")
    old = OldNixl()
    agent.agent = old
    strided = _geometry().strided([1 << 30, 3 << 30])
    table = agent.prepare_table("peer", strided, "DRAM")
    assert old.given is not None and old.given.shape[1] == 3  # expanded for this NIXL
    assert table.rows.shape == strided.shape  # kept compressed
    indices = np.arange(old.given.shape[0])
    assert np.array_equal(table.descriptors(indices)[0], old.given[:, 0])
