"""The worker's mappings of engine memory and staging buffers, and the conversions over them.

Host memory is a POSIX shared-memory file the engine created under ``/dev/shm``; the worker
maps the same file (``MAP_SHARED``, at an address from :data:`kvd.worker.vm.ARENA`, never one a
released region had), so a NIXL write into the worker's mapping is the engine's memory. GPU
memory is a CUDA IPC handle of a torch storage, opened on the same device. Either way the worker
gets a uint8 tensor over the engine's bytes and its address, and never copies them.

Every mapping is named by a region id the control process uses in later calls. The table is
owned by the worker's event loop; conversions run in its thread pool over tensors looked up on
the loop first. Each host mapping (a new one, or a re-map) is handed to the table's
:class:`~kvd.worker.prefault.Prefaulter`, which fills its page tables in the background so a
pull's copy does not fault on every page it writes first.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import itertools
import logging
import math
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvd.dataplane_protocol import CudaIpcSpec, MappedRegion, MemoryKind, RegionRequest
from kvd.worker import vm
from kvd.worker.prefault import Prefaulter
from kvd_client.errors import FailedPrecondition, InvalidArgument, MemoryOpenError, NotFound

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
_SHM_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")


@dataclasses.dataclass(eq=False)
class _Region:
    tensor: torch.Tensor
    mapping: vm.HostMapping | None  # the worker's own mapping (shm, duplicate), unmapped on close


class RegionTable:
    """Region id -> the worker's mapping. Event-loop only (conversions get tensors, not ids)."""

    def __init__(self, prefault: bool = True) -> None:
        self._regions: dict[int, _Region] = {}
        self._ids = itertools.count(1)
        self._cuda_streams: dict[int, Any] = {}
        self._prefaulter = Prefaulter() if prefault else None
        # Closed host mappings kept readable (retired: throw-away pages) until their time, oldest
        # first: (when to unmap, the mapping). Unmapped by later opens and closes (no timer).
        self._tombstones: collections.deque[tuple[float, vm.HostMapping]] = collections.deque()

    def __len__(self) -> int:
        return len(self._regions)

    def _add(self, tensor: torch.Tensor, mapping: vm.HostMapping | None) -> MappedRegion:
        region_id = next(self._ids)
        self._regions[region_id] = _Region(tensor, mapping)
        if mapping is not None and self._prefaulter is not None:
            self._prefaulter.add(mapping)
        vram = tensor.is_cuda
        return MappedRegion(
            region_id,
            int(tensor.data_ptr()),
            tensor.numel(),
            int(tensor.device.index or 0) if vram else 0,
            vram,
        )

    def _region(self, region_id: int) -> _Region:
        region = self._regions.get(region_id)
        if region is None:
            raise NotFound(f"the data-plane worker has no region {region_id}")
        return region

    def get(self, region_id: int) -> torch.Tensor:
        return self._region(region_id).tensor

    def open(self, request: RegionRequest) -> MappedRegion:
        """Map one engine region; raise MemoryOpenError (nothing mapped) if it cannot be opened."""
        self._unmap_tombstones(time.monotonic())
        if request.size_bytes <= 0:
            raise InvalidArgument(f"region size must be > 0, got {request.size_bytes}")
        if request.kind is MemoryKind.SHM:
            mapping = _open_shm(request.shm_name, request.size_bytes)
            return self._add(_host_tensor(mapping.address, request.size_bytes), mapping)
        if request.cuda_ipc is None:
            raise InvalidArgument("a CUDA IPC region needs its cuda_ipc handle")
        return self._add(_open_cuda_ipc(request.cuda_ipc, request.size_bytes), None)

    def open_all(self, requests: Sequence[RegionRequest]) -> list[MappedRegion]:
        """Map every region or none."""
        opened: list[MappedRegion] = []
        try:
            for request in requests:
                opened.append(self.open(request))
        except BaseException:
            for region in opened:
                self.close(region.region_id)
            raise
        return opened

    def staging(self, size: int, device: str) -> MappedRegion:
        """A buffer of the worker's own (staging for conversions), freed on close."""
        return self._add(torch.empty(size, dtype=torch.uint8, device=torch.device(device)), None)

    def duplicate(self, region_id: int) -> MappedRegion:
        """The same shared pages mapped again at a new address (see kvd.worker.vm)."""
        tensor = self.get(region_id)
        if tensor.is_cuda:
            raise FailedPrecondition("GPU memory cannot be re-mapped")
        mapping = vm.duplicate_mapping(int(tensor.data_ptr()), tensor.numel())
        return self._add(_host_tensor(mapping.address, tensor.numel()), mapping)

    def retire(self, region_id: int) -> None:
        """Replace the mapping's pages with private ones: a late copy cannot reach the engine."""
        region = self._region(region_id)
        if region.mapping is not None:  # under the mapping's lock: a retired range is never populated
            region.mapping.retire()
        elif not region.tensor.is_cuda:
            vm.retire_range(int(region.tensor.data_ptr()), region.tensor.numel())

    def close(self, region_id: int, keep_readable_s: float = 0.0) -> None:
        """Drop the worker's mapping (the engine's file and pages are the engine's).

        With ``keep_readable_s`` a host mapping is retired now (the engine's pages are let go) and
        its addresses unmapped only that long after: a peer's READ planned on a handshake that
        named them may still arrive, and a READ of unmapped memory fails on the serving side
        (CMA: EFAULT), which breaks the UCX connection it travels on for every later pull."""
        now = time.monotonic()
        self._unmap_tombstones(now)
        region = self._regions.pop(region_id, None)
        if region is None or region.mapping is None:
            return
        if keep_readable_s <= 0:
            region.mapping.close()
            return
        region.mapping.retire()
        self._tombstones.append((now + keep_readable_s, region.mapping))

    def _unmap_tombstones(self, now: float) -> None:
        while self._tombstones and self._tombstones[0][0] <= now:
            self._tombstones.popleft()[1].close()

    @property
    def tombstones(self) -> int:
        """Closed host mappings still kept readable."""
        return len(self._tombstones)

    def close_all(self) -> None:
        """Unmap everything and stop pre-faulting (the worker is ending)."""
        if self._prefaulter is not None:
            self._prefaulter.close()
        for region_id in list(self._regions):
            self.close(region_id)
        self._unmap_tombstones(math.inf)

    def convert(self, postprocess: Any, staging: torch.Tensor, engine_regions: list[torch.Tensor]) -> None:
        """Run a pull's conversion (a thread of the pool). On a GPU: on a worker-owned stream,
        waited for before the blocks are reported loaded, so the engine's streams never block."""
        device = staging.device
        if device.type != "cuda":
            postprocess.run(staging, engine_regions)
            return
        stream = self._cuda_streams.get(device.index or 0)
        if stream is None:
            stream = self._cuda_streams.setdefault(device.index or 0, torch.cuda.Stream(device=device))
        with torch.cuda.stream(stream):
            postprocess.run(staging, engine_regions)
        stream.synchronize()


def _host_tensor(address: int, size: int) -> torch.Tensor:
    buffer = (ctypes.c_uint8 * size).from_address(address)
    return torch.frombuffer(buffer, dtype=torch.uint8)


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
