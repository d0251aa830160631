"""The engine side of shared-memory regions: creating the ``/dev/shm`` file an engine registers.

An engine (or anything acting as one: ``kvd selftest``, the daemon's selftest scratch engine,
the reference engine, tests) puts host KV in a POSIX shm file and registers it by name
(``MemoryRegion.shm_name``); the daemon maps the same file. Every such file is created here,
one way: owner-only (``0600``) and exclusively (``O_EXCL``), so a caller never truncates or maps
a file it did not create (another engine's cache, or a link an attacker planted).

The file functions use only the standard library; :func:`create_shm_tensor` maps the file with
torch, imported when called (an engine has torch; the client library does not need it).
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["SHM_DIR", "create_shm_file", "create_shm_tensor", "new_shm_name", "unlink_shm"]

SHM_DIR = Path("/dev/shm")
_SHM_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")


def new_shm_name(prefix: str) -> str:
    """A fresh name for a region of this process: ``<prefix>-<pid>-<random>``."""
    return f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def create_shm_file(name: str, nbytes: int) -> Path:
    """Create ``/dev/shm/<name>`` of ``nbytes`` zero bytes, owner-only; fail if it exists.

    Raises ``ValueError`` for a name that is not a plain file name or a size that is not positive,
    ``FileExistsError`` when the file is already there.
    """
    if not _SHM_NAME.match(name):
        raise ValueError(f"shm name {name!r} is not a plain file name (letters, digits, '.', '_', '-')")
    if nbytes <= 0:
        raise ValueError(f"shm region size must be positive, got {nbytes}")
    path = SHM_DIR / name
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    except BaseException:
        os.close(fd)
        unlink_shm(name)
        raise
    os.close(fd)
    return path


def create_shm_tensor(name: str, nbytes: int) -> torch.Tensor:
    """Create ``/dev/shm/<name>`` as :func:`create_shm_file` does and map it: a flat uint8 tensor."""
    import torch  # noqa: PLC0415 - only this function needs torch; the client does not depend on it

    path = create_shm_file(name, nbytes)
    try:
        return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
    except BaseException:
        unlink_shm(name)
        raise


def unlink_shm(name: str) -> None:
    """Remove ``/dev/shm/<name>`` if present (mappings stay valid until unmapped)."""
    with contextlib.suppress(FileNotFoundError):
        (SHM_DIR / name).unlink()
