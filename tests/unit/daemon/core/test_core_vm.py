"""kvd.worker.vm: engine mappings at addresses never reused, re-maps of the same pages, retiring."""

from __future__ import annotations

import ctypes
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvd.worker import vm
from kvd_client.shm import create_shm_tensor, unlink_shm

SIZE = 1 << 20


@pytest.fixture
def shm() -> Iterator[tuple[str, torch.Tensor]]:
    name = f"kvdvm-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield name, create_shm_tensor(name, SIZE)
    unlink_shm(name)


def _view(mapping: vm.HostMapping) -> torch.Tensor:
    return torch.frombuffer((ctypes.c_uint8 * SIZE).from_address(mapping.address), dtype=torch.uint8)


def _map(name: str, arena: vm.AddressArena) -> vm.HostMapping:
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
    try:
        return vm.map_shared_file(fd, SIZE, arena)
    finally:
        os.close(fd)


def test_mappings_released_and_made_again_never_reuse_addresses(shm: tuple[str, torch.Tensor]) -> None:
    name, engine = shm
    arena = vm.AddressArena()
    seen: list[tuple[int, int]] = []
    for _ in range(20):  # map, release, map again: the kernel alone would hand the same range back
        mapping = _map(name, arena)
        assert vm.ARENA_BASE <= mapping.address < vm.ARENA_END
        assert all(mapping.address >= end or mapping.address + mapping.size <= start for start, end in seen)
        seen.append((mapping.address, mapping.address + mapping.size))
        mapping.close()
    mapping = _map(name, arena)
    try:
        engine[7] = 42
        assert int(_view(mapping)[7]) == 42, "the mapping is the engine's own pages"
        copy = vm.duplicate_mapping(mapping.address, SIZE, arena)
        try:
            assert copy.address not in {start for start, _ in seen} and copy.address > mapping.address
            _view(copy)[8] = 43
            assert int(engine[8]) == 43, "a re-map sees and changes the same pages"
            vm.retire_range(mapping.address, SIZE)
            _view(mapping)[9] = 44
            assert int(engine[9]) == 0 and int(_view(copy)[9]) == 0, "a retired range no longer reaches the engine"
        finally:
            copy.close()
    finally:
        mapping.close()


def test_a_full_or_unusable_arena_leaves_placement_to_the_kernel(shm: tuple[str, torch.Tensor]) -> None:
    name, _ = shm
    for arena in (vm.AddressArena(base=0, end=0), vm.AddressArena(base=vm.ARENA_BASE, end=vm.ARENA_BASE + 4096)):
        mapping = _map(name, arena)
        try:
            assert not vm.ARENA_BASE <= mapping.address < vm.ARENA_BASE + 4096
            assert int(_view(mapping)[0]) == 0
        finally:
            mapping.close()


def _thp_mode() -> str:
    """The kernel's transparent-huge-page mode ("always", "madvise", "never"), "" without THP."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return ""
    return text[text.index("[") + 1 : text.index("]")]


def _vma_of(address: int) -> dict[str, str]:
    """The fields of this process's /proc/self/smaps entry whose range holds ``address``."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def test_host_staging_starts_on_a_huge_page_and_asks_for_huge_pages() -> None:
    """The staging buffer (kvd.worker.regions) is 2 MiB-aligned and advised MADV_HUGEPAGE before
    any page is touched: where the kernel has THP, its mapping is eligible for huge pages."""
    from kvd.worker.regions import RegionTable

    table = RegionTable(prefault=False)
    try:
        size = 8 * vm.HUGE_PAGE + 12345
        region = table.staging(size, "cpu")
        assert region.address % vm.HUGE_PAGE == 0 and region.size_bytes == size and not region.vram
        buffer = table.get(region.region_id)
        buffer.fill_(1)  # every byte writable, the whole size
        assert int(buffer.sum()) == size
        if _thp_mode() in ("always", "madvise"):
            fields = _vma_of(region.address)
            assert fields.get("THPeligible") == "1", fields
            assert "hg" in fields.get("VmFlags", "").split(), "MADV_HUGEPAGE was not applied"
    finally:
        table.close_all()


def test_advise_huge_pages_needs_a_whole_huge_page() -> None:
    assert not vm.advise_huge_pages(vm.HUGE_PAGE + 1, vm.HUGE_PAGE)  # no aligned 2 MiB inside
    assert not vm.advise_huge_pages(0, 0)
