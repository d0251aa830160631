"""Putting an engine's KV memory where the node's daemon can map it without a copy.

Host memory goes to POSIX shared memory (a file under ``/dev/shm``): the engine and the
daemon map the same file, so a NIXL WRITE into the daemon's registration is the engine's
cache. GPU memory is exported as a CUDA IPC handle (torch storage sharing).

Two ways to get host KV into shm:

* :func:`create_shm_region` allocates a fresh file (the reference engine allocates its cache
  there from the start);
* :func:`move_storage_to_shm` moves an *existing* CPU tensor's storage in place, once. It
  swaps the storage's data pointer under every tensor that shares it (torch's own
  file-system sharing), so views the engine bound elsewhere (vLLM binds per-layer kernel
  views of one backing buffer) follow too. Torch prefixes such a file with a small
  refcount header; :attr:`ShmRegion.data_offset` says where the data starts.
  When that torch API is missing it falls back to copy + ``Tensor.set_`` on the tensors
  it was given.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable
from typing import Any, cast

import torch

from kvd_client import shm as client_shm

logger = logging.getLogger(__name__)

__all__ = [
    "SHM_DIR",
    "ShmRegion",
    "create_shm_region",
    "cuda_ipc_handle",
    "known_region",
    "move_storage_to_shm",
    "unlink_quietly",
]

SHM_DIR = str(client_shm.SHM_DIR)

# Regions this process mapped, by the data pointer of their storage: lets a connector find the
# shm file behind a cache the engine allocated in shm itself (no second move, no copy).
_REGIONS: dict[int, ShmRegion] = {}


@dataclasses.dataclass
class ShmRegion:
    """One shm file holding KV bytes.

    ``size_bytes`` is the file's size (what the daemon maps); the KV data starts at
    ``data_offset`` inside it. ``owned``: this process created the file and must unlink it.
    """

    name: str
    size_bytes: int
    data_offset: int
    owned: bool
    tensor: torch.Tensor  # flat uint8 view of the data (not the header)

    @property
    def path(self) -> str:
        return os.path.join(SHM_DIR, self.name)

    def unlink(self) -> None:
        """Remove the file name (mappings stay valid until unmapped) and forget it. Idempotent."""
        _REGIONS.pop(self.tensor.untyped_storage().data_ptr(), None)
        if self.owned:
            unlink_quietly(self.path)
            self.owned = False


def known_region(t: torch.Tensor) -> ShmRegion | None:
    """The shm region this process mapped under ``t``'s storage, if any."""
    return _REGIONS.get(t.untyped_storage().data_ptr())


def unlink_quietly(path: str) -> None:
    """Unlink the shm file at ``path``, ignoring a file that is already gone."""
    client_shm.unlink_shm(os.path.basename(path))


def create_shm_region(nbytes: int, prefix: str = "kvd-kv") -> ShmRegion:
    """A zero-filled shm file of ``nbytes`` (created by :mod:`kvd_client.shm`) mapped into this process."""
    name = client_shm.new_shm_name(prefix)
    tensor = client_shm.create_shm_tensor(name, nbytes)
    region = ShmRegion(name=name, size_bytes=nbytes, data_offset=0, owned=True, tensor=tensor)
    _REGIONS[tensor.untyped_storage().data_ptr()] = region
    return region


def move_storage_to_shm(tensors: Iterable[torch.Tensor], prefix: str = "kvd-kv") -> ShmRegion:
    """Move the one CPU storage behind ``tensors`` into a named shm file, in place.

    Every tensor sharing that storage (also ones not passed here) keeps its identity, shape,
    strides and contents; only the memory under it changes. Call once per storage.
    """
    tensors = list(tensors)
    if not tensors:
        raise ValueError("move_storage_to_shm needs at least one tensor")
    storage = tensors[0].untyped_storage()
    if any(t.untyped_storage().data_ptr() != storage.data_ptr() for t in tensors):
        raise ValueError("move_storage_to_shm: the tensors do not share one storage")
    if storage.device.type != "cpu":
        raise ValueError(f"move_storage_to_shm wants CPU memory, got {storage.device}")
    share = getattr(storage, "_share_filename_cpu_", None)
    known = _REGIONS.get(storage.data_ptr())
    if known is not None:
        return known
    # Idempotent in torch: a storage already shared by file name returns the same file.
    if share is not None:
        try:
            _manager, raw_name, nbytes = share()
        except RuntimeError as err:  # e.g. no torch_shm_manager binary: use the fallback
            logger.warning("torch file-system sharing failed (%s); copying into a kvd shm file instead", err)
        else:
            name = raw_name.decode() if isinstance(raw_name, bytes) else str(raw_name)
            name = name.lstrip("/")
            file_size = os.path.getsize(os.path.join(SHM_DIR, name))
            header = file_size - int(nbytes)
            flat = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (int(nbytes),), (1,))
            # Torch's manager unlinks the file when this process exits: not ours to unlink.
            region = ShmRegion(name=name, size_bytes=file_size, data_offset=header, owned=False, tensor=flat)
            _REGIONS[storage.data_ptr()] = region
            return region
    return _copy_into_shm(tensors, storage, prefix)


def _copy_into_shm(tensors: list[torch.Tensor], storage: torch.UntypedStorage, prefix: str) -> ShmRegion:
    """Fallback: copy the bytes into a new shm file and re-point the given tensors at it."""
    nbytes = storage.nbytes()
    region = create_shm_region(nbytes, prefix)
    new_storage = cast(torch.UntypedStorage, torch.UntypedStorage.from_file(region.path, shared=True, nbytes=nbytes))
    old = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,))
    region.tensor.copy_(old)
    for t in tensors:
        t.set_(new_storage, t.storage_offset(), t.shape, t.stride())
    _REGIONS.pop(region.tensor.untyped_storage().data_ptr(), None)
    region.tensor = torch.empty(0, dtype=torch.uint8).set_(new_storage, 0, (nbytes,), (1,))
    _REGIONS[new_storage.data_ptr()] = region
    logger.warning(
        "moved KV storage into %s by copy: views of the old storage not passed in keep the old memory", region.path
    )
    return region


def cuda_ipc_handle(t: torch.Tensor) -> dict[str, Any]:
    """The fields of ``kvd.v1.CudaIpcHandle`` for the CUDA storage behind ``t``."""
    storage = t.untyped_storage()
    if storage.device.type != "cuda":
        raise ValueError(f"cuda_ipc_handle wants a CUDA tensor, got {storage.device}")
    (
        device,
        handle,
        size_bytes,
        offset_bytes,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = storage._share_cuda_()
    return {
        "device_index": int(device),
        "handle": bytes(handle),
        "storage_size_bytes": int(size_bytes),
        "storage_offset_bytes": int(offset_bytes),
        "ref_counter_handle": bytes(ref_counter_handle),
        "ref_counter_offset": int(ref_counter_offset),
        "event_handle": bytes(event_handle) if event_handle else b"",
        "event_sync_required": bool(event_sync_required),
    }
