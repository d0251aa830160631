"""kvd.worker.prefault: the worker's mappings of engine memory are populated in the background,
without a byte changed, and never after the mapping was retired or closed."""

from __future__ import annotations

import errno
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
import torch

from kvd.dataplane_protocol import MemoryKind, RegionRequest
from kvd.worker import prefault, vm
from kvd.worker.regions import RegionTable
from kvd_client.shm import create_shm_tensor, unlink_shm

SIZE = 32 << 20
WAIT_S = 60.0  # the thread takes a quarter of a core at most: a loaded machine may leave it waiting


@pytest.fixture
def engine_shm() -> Iterator[Callable[[], tuple[str, torch.Tensor]]]:
    """Shared-memory files as an engine makes them: created and written (resident)."""
    names: list[str] = []

    def make() -> tuple[str, torch.Tensor]:
        name = f"kvdpf-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        names.append(name)
        tensor = create_shm_tensor(name, SIZE)
        tensor.copy_(torch.arange(SIZE, dtype=torch.int64).to(torch.uint8))
        return name, tensor

    yield make
    for name in names:
        unlink_shm(name)


def _mapped_kb(address: int) -> tuple[int, int]:
    """(Rss, Anonymous) in KiB of this process's mapping starting at ``address``: the pages its
    page tables map (a fresh mapping of resident shared memory has none until touched)."""
    start = f"{address:x}-"
    rss = anonymous = None
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if "-" in line.split(" ", 1)[0] and not line.startswith(("Rss", "Anonymous")):
                inside = line.startswith(start)
                continue
            if inside and line.startswith("Rss:"):
                rss = int(line.split()[1])
            elif inside and line.startswith("Anonymous:"):
                anonymous = int(line.split()[1])
    assert rss is not None and anonymous is not None, f"no mapping at {address:#x}"
    return rss, anonymous


def _request(name: str) -> RegionRequest:
    return RegionRequest(kind=MemoryKind.SHM, size_bytes=SIZE, shm_name=name)


def _wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_new_mapping_is_populated_in_the_background_without_a_byte_changed(engine_shm) -> None:
    (name, engine), (other_name, _) = engine_shm(), engine_shm()
    expected = engine.clone()
    populated, plain = RegionTable(prefault=True), RegionTable(prefault=False)
    try:
        region = populated.open(_request(name))
        cold = plain.open(_request(other_name))
        _wait_for(lambda: _mapped_kb(region.address)[0] == SIZE // 1024, "the mapping was never populated")
        duplicate = populated.duplicate(region.region_id)  # a re-map (a fence) starts cold: populated too
        _wait_for(lambda: _mapped_kb(duplicate.address)[0] == SIZE // 1024, "the re-map was never populated")
        assert _mapped_kb(region.address)[1] == 0, "shared pages mapped, nothing private allocated"
        assert _mapped_kb(cold.address)[0] == 0, "prefault off: the mapping stays as the kernel made it"
        assert torch.equal(engine, expected) and torch.equal(populated.get(region.region_id), expected)
    finally:
        populated.close_all()
        plain.close_all()


def test_only_resident_pages_are_populated_a_sparse_file_gains_no_memory(engine_shm) -> None:
    name, _engine = engine_shm()
    path = f"/dev/shm/{name}"
    os.truncate(path, 0)  # drop the engine's pages, then write every other MiB only
    os.truncate(path, SIZE)
    with open(path, "r+b") as file:
        for offset in range(0, SIZE, 2 << 20):
            file.seek(offset)
            file.write(b"\x07" * (1 << 20))
    allocated = os.stat(path).st_blocks
    assert allocated * 512 == SIZE // 2
    table = RegionTable(prefault=True)
    try:
        region = table.open(_request(name))
        _wait_for(lambda: _mapped_kb(region.address)[0] == SIZE // 2048, "the resident half was never populated")
        time.sleep(0.1)
        assert _mapped_kb(region.address)[0] == SIZE // 2048, "only what the engine wrote is mapped"
        assert os.stat(path).st_blocks == allocated, "the pre-fault allocated pages the engine never wrote"
    finally:
        table.close_all()


@pytest.mark.parametrize("ending", ["retire", "close"])
def test_retiring_or_closing_a_mapping_waits_for_the_chunk_in_progress_and_stops_there(
    engine_shm, monkeypatch: pytest.MonkeyPatch, ending: str
) -> None:
    name, engine = engine_shm()
    in_chunk, release = threading.Event(), threading.Event()
    chunks: list[tuple[int, int]] = []
    populate = vm.populate_writable

    def first_chunk_blocks(address: int, size: int) -> None:
        chunks.append((address, size))
        if len(chunks) == 1:
            in_chunk.set()
            release.wait(WAIT_S)
        populate(address, size)

    monkeypatch.setattr(vm, "populate_writable", first_chunk_blocks)
    table = RegionTable(prefault=True)
    try:
        region = table.open(_request(name))
        assert in_chunk.wait(WAIT_S), "the prefault thread never started"
        end = threading.Thread(target=getattr(table, ending), args=(region.region_id,))
        end.start()
        end.join(0.2)
        assert end.is_alive(), f"{ending} must wait for the chunk being populated"
        release.set()
        end.join(WAIT_S)
        assert not end.is_alive()
        time.sleep(0.2)  # the thread would go on with the next chunk here, were it not stopped
        assert len(chunks) == 1, "no chunk is populated after the mapping was retired or closed"
        if ending == "retire":  # the retired range is private memory now: none of it populated
            assert _mapped_kb(region.address) == (0, 0)
        assert int(engine[5]) == 5
    finally:
        release.set()
        table.close_all()


def test_a_kernel_without_populate_write_is_tried_once_and_left_alone(
    engine_shm, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []

    def unsupported(address: int, size: int) -> None:
        calls.append(address)
        raise OSError(errno.EINVAL, "madvise(MADV_POPULATE_WRITE): Invalid argument")

    monkeypatch.setattr(vm, "populate_writable", unsupported)
    prefaulter = prefault.Prefaulter()
    mappings = []
    try:
        for _ in range(3):
            name, _engine = engine_shm()
            fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
            mappings.append(vm.map_shared_file(fd, SIZE))
            os.close(fd)
            prefaulter.add(mappings[-1])
            if len(mappings) == 1:
                _wait_for(lambda: prefaulter.unsupported, "the failure was never seen")
        time.sleep(0.1)
        assert calls == [mappings[0].address], "one try, then nothing queued any more"
    finally:
        prefaulter.close()
        for mapping in mappings:
            mapping.close()


def _prefault_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "kvd-prefault"]


def test_the_thread_ends_once_nothing_is_left_to_populate_and_the_next_mapping_starts_another(
    engine_shm,
) -> None:
    """A killed worker exits only once each of its threads has run, and a thread waits for the
    CPU on a busy machine: an idle prefault thread (then at the lowest priority) held a killed
    worker's exit, and the daemon's restart, up by seconds. So none is left waiting between
    mappings."""
    (name, _), (other_name, _) = engine_shm(), engine_shm()
    table = RegionTable(prefault=True)
    try:
        first = table.open(_request(name))
        _wait_for(lambda: _mapped_kb(first.address)[0] == SIZE // 1024, "the mapping was never populated")
        _wait_for(lambda: not _prefault_threads(), "the prefault thread outlived its work")
        second = table.open(_request(other_name))
        _wait_for(lambda: _mapped_kb(second.address)[0] == SIZE // 1024, "the next mapping was never populated")
        _wait_for(lambda: not _prefault_threads(), "the second prefault thread outlived its work")
    finally:
        table.close_all()


def test_the_thread_runs_at_the_workers_own_priority_never_lowered(engine_shm, monkeypatch) -> None:
    """A Python thread preempted while it holds the GIL holds every other thread of the worker
    up until the kernel runs it again: at the lowest priority, on a busy machine, that was
    hundreds of milliseconds at a time. It is paced instead (DUTY)."""
    name, _ = engine_shm()
    populating, go = threading.Event(), threading.Event()
    real_populate = vm.populate_writable

    def held(address: int, size: int) -> None:
        populating.set()
        assert go.wait(WAIT_S)
        real_populate(address, size)

    monkeypatch.setattr(vm, "populate_writable", held)
    table = RegionTable(prefault=True)
    try:
        table.open(_request(name))
        assert populating.wait(WAIT_S), "the mapping was never populated"
        (thread,) = _prefault_threads()
        assert thread.native_id is not None
        assert os.getpriority(os.PRIO_PROCESS, thread.native_id) == os.getpriority(os.PRIO_PROCESS, 0)
    finally:
        go.set()
        table.close_all()
