"""kvd.worker.vm: engine mappings at addresses never reused, re-maps of the same pages, retiring."""

from __future__ import annotations

import ctypes
import os
import uuid
from collections.abc import Iterator

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
