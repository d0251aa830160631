"""Opening an engine's KV memory without copying it.

Host memory is a POSIX shared-memory file the engine created under ``/dev/shm``; the daemon
maps the same file (``MAP_SHARED``, at an address from :data:`kvd.core.vm.ARENA`, never one a
released region had), so a NIXL write into the daemon's mapping is the engine's memory. GPU
memory is a CUDA IPC handle of a torch storage, opened on the same device. Either way the daemon
gets a uint8 tensor over the engine's bytes and its address, and never copies them.
"""

from __future__ import annotations

import ctypes
import dataclasses
import enum
import logging
import os
import re
from pathlib import Path

import torch

from kvd.core import vm
from kvd_client.errors import InvalidArgument, MemoryOpenError

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
_SHM_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")


class MemoryKind(enum.Enum):
    SHM = "shm"
    CUDA_IPC = "cuda_ipc"


@dataclasses.dataclass(frozen=True)
class CudaIpcSpec:
    """The fields of ``torch.UntypedStorage._share_cuda_()``, as sent by the engine."""

    device_index: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


@dataclasses.dataclass(frozen=True)
class RegionRequest:
    """One memory region an engine asks the daemon to open."""

    kind: MemoryKind
    size_bytes: int
    shm_name: str = ""
    cuda_ipc: CudaIpcSpec | None = None


@dataclasses.dataclass(eq=False)
class OpenedRegion:
    """An engine region mapped into the daemon: a uint8 tensor over the engine's own bytes."""

    request: RegionRequest
    tensor: torch.Tensor
    # The daemon's mapping of a shm region, unmapped by close() once nothing can touch it.
    mapping: vm.HostMapping | None = None

    def close(self) -> None:
        """Unmap the daemon's own mapping (the engine's file and pages are the engine's)."""
        if self.mapping is not None:
            self.mapping.close()
            self.mapping = None

    @property
    def address(self) -> int:
        return int(self.tensor.data_ptr())

    @property
    def size_bytes(self) -> int:
        return self.request.size_bytes

    @property
    def vram(self) -> bool:
        return self.tensor.is_cuda

    @property
    def device_index(self) -> int:
        """NIXL's device id: the GPU index for VRAM, 0 for host memory."""
        return int(self.tensor.device.index or 0) if self.tensor.is_cuda else 0

    @property
    def mem_type(self) -> str:
        return "VRAM" if self.vram else "DRAM"


def open_region(request: RegionRequest) -> OpenedRegion:
    """Map one region; raise MemoryOpenError (nothing mapped) if it cannot be opened."""
    if request.size_bytes <= 0:
        raise InvalidArgument(f"region size must be > 0, got {request.size_bytes}")
    if request.kind is MemoryKind.SHM:
        mapping = _open_shm(request.shm_name, request.size_bytes)
        buffer = (ctypes.c_uint8 * request.size_bytes).from_address(mapping.address)
        return OpenedRegion(request, torch.frombuffer(buffer, dtype=torch.uint8), mapping)
    if request.cuda_ipc is None:
        raise InvalidArgument("a CUDA IPC region needs its cuda_ipc handle")
    return OpenedRegion(request, _open_cuda_ipc(request.cuda_ipc, request.size_bytes))


def _open_shm(name: str, size: int) -> vm.HostMapping:
    if not _SHM_NAME.match(name or ""):
        raise InvalidArgument(
            f"shm name {name!r} is not a plain file name under {SHM_DIR} (letters, digits, '.', '_', '-')"
        )
    path = SHM_DIR / name
    try:
        stat = path.stat()
    except FileNotFoundError as exc:
        raise MemoryOpenError(f"shared memory {path} does not exist: did the engine create it?") from exc
    except OSError as exc:
        raise MemoryOpenError(f"cannot stat shared memory {path}: {exc.strerror}") from exc
    if stat.st_size < size:
        raise MemoryOpenError(f"shared memory {path} has {stat.st_size} bytes, the registration claims {size}")
    if not os.access(path, os.R_OK | os.W_OK):
        raise MemoryOpenError(f"the daemon may not read and write {path} (permissions {oct(stat.st_mode & 0o777)})")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise MemoryOpenError(f"cannot open shared memory {path}: {exc.strerror}") from exc
    try:
        return vm.map_shared_file(fd, size)
    except OSError as exc:
        raise MemoryOpenError(f"cannot map shared memory {path}: {exc.strerror}") from exc
    finally:
        os.close(fd)  # the mapping keeps the file's pages


def _open_cuda_ipc(spec: CudaIpcSpec, size: int) -> torch.Tensor:
    if not torch.cuda.is_available():
        raise MemoryOpenError("a CUDA IPC region was registered but this daemon sees no CUDA device")
    if not 0 <= spec.device_index < torch.cuda.device_count():
        raise MemoryOpenError(
            f"CUDA device {spec.device_index} does not exist here ({torch.cuda.device_count()} visible)"
        )
    if size > spec.storage_size_bytes:
        raise InvalidArgument(f"region size {size} exceeds the shared CUDA storage's {spec.storage_size_bytes} bytes")
    try:
        with torch.cuda.device(spec.device_index):
            storage = torch.UntypedStorage._new_shared_cuda(
                spec.device_index,
                spec.handle,
                spec.storage_size_bytes,
                spec.storage_offset_bytes,
                spec.ref_counter_handle,
                spec.ref_counter_offset,
                spec.event_handle,
                spec.event_sync_required,
            )
    except RuntimeError as exc:
        raise MemoryOpenError(f"cannot open CUDA IPC handle on device {spec.device_index}: {exc}") from exc
    device = torch.device("cuda", spec.device_index)
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (size,), (1,))


def cuda_ipc_spec_of(tensor: torch.Tensor) -> CudaIpcSpec:
    """What an engine sends for a CUDA tensor's storage (engine side of :func:`open_region`)."""
    (device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = (
        tensor.untyped_storage()._share_cuda_()
    )
    return CudaIpcSpec(
        device_index=int(device),
        handle=bytes(handle),
        storage_size_bytes=int(size),
        storage_offset_bytes=int(offset),
        ref_counter_handle=bytes(ref_handle),
        ref_counter_offset=int(ref_offset),
        event_handle=bytes(event_handle) if event_handle else b"",
        event_sync_required=bool(event_sync),
    )
