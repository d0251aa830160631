"""kvd_client.shm: every engine-side shm file is created owner-only and exclusively."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator

import pytest

from kvd_client import shm


@pytest.fixture
def name() -> Iterator[str]:
    name = shm.new_shm_name("kvd-test-shm")
    yield name
    shm.unlink_shm(name)


def test_creates_an_owner_only_zero_file(name: str) -> None:
    path = shm.create_shm_file(name, 4096)
    info = path.stat()
    assert info.st_size == 4096
    assert stat.S_IMODE(info.st_mode) == 0o600
    assert path.read_bytes() == bytes(4096)


def test_refuses_an_existing_file_and_leaves_it_alone(name: str) -> None:
    path = shm.SHM_DIR / name
    path.write_bytes(b"someone else's")
    with pytest.raises(FileExistsError):
        shm.create_shm_file(name, 4096)
    assert path.read_bytes() == b"someone else's"


def test_refuses_a_planted_symlink(name: str, tmp_path: os.PathLike[str]) -> None:
    victim = os.path.join(tmp_path, "victim")
    with open(victim, "wb") as f:
        f.write(b"keep")
    os.symlink(victim, shm.SHM_DIR / name)
    with pytest.raises(FileExistsError):
        shm.create_shm_file(name, 4096)
    with open(victim, "rb") as f:
        assert f.read() == b"keep"


@pytest.mark.parametrize("bad", ["", "a/b", "../x", "x" * 201])
def test_refuses_names_that_are_not_plain_file_names(bad: str) -> None:
    with pytest.raises(ValueError, match="plain file name"):
        shm.create_shm_file(bad, 4096)


def test_refuses_a_size_that_is_not_positive(name: str) -> None:
    with pytest.raises(ValueError, match="positive"):
        shm.create_shm_file(name, 0)
    assert not (shm.SHM_DIR / name).exists()


def test_tensor_maps_the_file_shared(name: str) -> None:
    tensor = shm.create_shm_tensor(name, 64)
    tensor[:4] = 7
    assert (shm.SHM_DIR / name).read_bytes()[:5] == bytes([7, 7, 7, 7, 0])


def test_unlink_of_a_missing_file_is_quiet(name: str) -> None:
    shm.unlink_shm(name)
    shm.unlink_shm(name)
