"""Virtual-memory primitives behind kvd's memory fences (Linux, host memory only).

NIXL 1.5 cannot cancel a READ that is in flight: releasing its handle or removing the peer's
agent leaves the UCX request running, and when a stalled peer resumes, its bytes are copied
into the destination addresses (verified here over ``UCX_TLS=tcp``). With host memory, those
copies happen inside the daemon's process, through the daemon's own mapping of the engine's
shared memory. Two operations on that mapping make a late copy harmless:

* :func:`duplicate_mapping` maps the same shared pages a second time, at a new address
  (``mremap`` with an old size of 0), so the engine's memory stays reachable for new reads;
* :func:`retire_range` replaces the old addresses with private anonymous pages
  (``mmap(MAP_FIXED)``): a late write lands there, a late read sees zeros, and neither can
  touch the engine's memory or fault.

A retired range stays reserved until no transfer can still touch it (see docs/lifetimes.md).

**Addresses are not reused.** Peers load this daemon's NIXL metadata and keep the regions they
loaded even after this daemon deregisters them (NIXL merges metadata); a new region at addresses
an old one had forces every such peer to reload its view of this daemon (kvd.core.peers), which
costs a UCX connection each time. So engine mappings (and their re-maps) are placed by
:class:`AddressArena`: at increasing addresses in a range the kernel does not place mappings in
on its own (16-64 TiB, far below the top-down mmap area), never the same range twice until the
arena wraps. Where that range is unavailable (another address-space layout) the kernel chooses,
as before, and a reuse is handled by the peers' reload.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import threading

import numpy as np

logger = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
_PROT_READ_WRITE = mmap.PROT_READ | mmap.PROT_WRITE
_MAP_PRIVATE = mmap.MAP_PRIVATE
_MAP_ANONYMOUS = getattr(mmap, "MAP_ANONYMOUS", 0x20)
_MAP_SHARED = mmap.MAP_SHARED
_PROT_NONE = 0
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000
_MAP_FIXED_NOREPLACE = 0x100000  # Linux >= 4.17: fail with EEXIST instead of replacing a mapping
_MREMAP_MAYMOVE = 1
_MREMAP_FIXED = 2
_MAP_FAILED = ctypes.c_void_p(-1).value
_EEXIST = 17

ARENA_BASE = 0x1000_0000_0000  # 16 TiB
ARENA_END = 0x4000_0000_0000  # 64 TiB
ARENA_GUARD = 1 << 21  # an unmapped gap between two placements

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mremap.restype = ctypes.c_void_p
_libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mincore.restype = ctypes.c_int
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]

MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault pages in writable, as a write would, without writing


def page_span(address: int, size: int) -> tuple[int, int]:
    """The page-aligned (start, length) covering ``[address, address + size)``."""
    start = address - address % PAGE
    end = -(-(address + size) // PAGE) * PAGE
    return start, end - start


def _check(result: int | None, what: str) -> int:
    if result is None or result == _MAP_FAILED:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")
    return int(result)


def retire_range(address: int, size: int) -> None:
    """Replace the pages under ``[address, address + size)`` with private, zeroed, anonymous ones.

    The range stays mapped (nothing faults), but it no longer reaches whatever was mapped there:
    the call is the fence that keeps a late NIXL copy out of an engine's memory.
    """
    start, length = page_span(address, size)
    flags = _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE
    got = _check(_libc.mmap(start, length, _PROT_READ_WRITE, flags, -1, 0), "mmap(MAP_FIXED) over a retired range")
    if got != start:  # MAP_FIXED either maps at start or fails
        raise OSError(0, f"mmap(MAP_FIXED) returned {got:#x}, not {start:#x}")


class AddressArena:
    """Hands out page ranges at increasing addresses of [base, end), never the same twice until it
    wraps (module docstring). Thread-safe; each range is reserved (``PROT_NONE``) when handed out,
    and the caller maps over it with ``MAP_FIXED``."""

    def __init__(self, base: int = ARENA_BASE, end: int = ARENA_END) -> None:
        self._base = base
        self._end = end
        self._cursor = base
        self._lock = threading.Lock()
        self._usable = True

    def reserve(self, length: int) -> int | None:
        """Reserve ``length`` bytes (a multiple of the page size); None where the arena cannot be used."""
        with self._lock:
            if not self._usable:
                return None
            wrapped = False
            for _ in range(256):
                start = self._cursor
                if start + length > self._end:
                    if wrapped:
                        return None
                    logger.info("address arena wrapped: later mappings may reuse addresses of released ones")
                    self._cursor = self._base
                    wrapped = True
                    continue
                flags = _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED_NOREPLACE
                got = _libc.mmap(start, length, _PROT_NONE, flags, -1, 0)
                if got == start:
                    self._cursor = start + length + ARENA_GUARD
                    return start
                if got is not None and got != _MAP_FAILED:  # a kernel that ignores MAP_FIXED_NOREPLACE
                    _libc.munmap(got, length)
                    self._usable = False
                    logger.info("MAP_FIXED_NOREPLACE is not honoured here: the kernel places engine mappings")
                    return None
                errno = ctypes.get_errno()
                if errno != _EEXIST:
                    self._usable = False
                    logger.info("the address arena cannot be used (%s): the kernel places mappings", os.strerror(errno))
                    return None
                self._cursor = start + length + ARENA_GUARD  # taken by someone else: step past it
            return None


ARENA = AddressArena()


def resident_runs(address: int, size: int) -> list[tuple[int, int]]:
    """The (address, length) runs of resident pages in the page-aligned ``[address, address + size)``
    of a shared file mapping (``mincore``: pages in the file's page cache, mapped here or not)."""
    pages = -(-size // PAGE)
    vector = np.zeros(pages, dtype=np.uint8)
    if _libc.mincore(address, size, vector.ctypes.data) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mincore: {os.strerror(errno)}")
    edges = np.flatnonzero(np.diff(np.concatenate(([0], vector & 1, [0])).astype(np.int8)))
    return [(address + int(a) * PAGE, min(int(b - a) * PAGE, size - int(a) * PAGE)) for a, b in edges.reshape(-1, 2)]


def populate_writable(address: int, size: int) -> None:
    """Fault ``[address, address + size)`` in writable (``MADV_POPULATE_WRITE``): page-table
    entries only, the bytes are not touched. Raises OSError (EINVAL: a kernel before 5.14)."""
    if _libc.madvise(address, size, MADV_POPULATE_WRITE) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"madvise(MADV_POPULATE_WRITE): {os.strerror(errno)}")


class HostMapping:
    """A second mapping of shared pages, owned by kvd (unmapped by :meth:`close`).

    It may be populated in the background (kvd.worker.prefault): :meth:`populate_next` faults it
    in one chunk at a time under the mapping's lock, and :meth:`retire` and :meth:`close` stop it
    and take the same lock, so no chunk is ever populated in a range that was retired or
    unmapped: private pages populated there would cost real memory, and an unmapped range could
    by then hold someone else's mapping.
    """

    def __init__(self, address: int, size: int) -> None:
        self.address = address
        self.size = size
        self._closed = False
        self._lock = threading.Lock()
        self._populate_stopped = False
        self.populated = 0  # bytes from the start already walked: their resident pages faulted in writable

    def populate_next(self, chunk: int) -> bool:
        """Populate the resident pages of the next ``chunk`` bytes (a page the engine never wrote
        is left alone: populating it would allocate it); False once done, stopped or closed.
        Raises OSError."""
        with self._lock:
            if self._closed or self._populate_stopped or self.populated >= self.size:
                return False
            length = min(chunk, self.size - self.populated)
            for address, run in resident_runs(self.address + self.populated, length):
                populate_writable(address, run)
            self.populated += length
            return self.populated < self.size

    def retire(self) -> None:
        """:func:`retire_range` over the whole mapping, once a chunk being populated is done
        (none is populated after it)."""
        self._populate_stopped = True  # first: the populating thread must not take the lock again
        with self._lock:
            retire_range(self.address, self.size)

    def close(self) -> None:
        self._populate_stopped = True  # as in retire
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if _libc.munmap(self.address, self.size) != 0:
                logger.warning("munmap(%#x, %d) failed: %s", self.address, self.size, os.strerror(ctypes.get_errno()))


def duplicate_mapping(address: int, size: int, arena: AddressArena | None = None) -> HostMapping:
    """Map the shared pages under ``address`` once more, at a new address (the old one is untouched).

    ``address`` must start a page and lie in a shared mapping (an engine's ``/dev/shm`` file as
    the daemon mapped it): the new mapping sees and changes the very same pages.
    """
    if address % PAGE:
        raise ValueError(f"address {address:#x} does not start a page")
    _, length = page_span(address, size)
    at = (arena or ARENA).reserve(length)
    if at is None:
        new = _check(_libc.mremap(address, 0, length, _MREMAP_MAYMOVE, None), "mremap(old_size=0) of a shared mapping")
        return HostMapping(new, length)
    got = _libc.mremap(address, 0, length, _MREMAP_MAYMOVE | _MREMAP_FIXED, at)
    if got is None or got == _MAP_FAILED:
        errno = ctypes.get_errno()
        _libc.munmap(at, length)
        raise OSError(errno, f"mremap(old_size=0) of a shared mapping: {os.strerror(errno)}")
    return HostMapping(int(got), length)


def map_shared_file(fd: int, size: int, arena: AddressArena | None = None) -> HostMapping:
    """Map ``size`` bytes of the shared file ``fd`` read-write, at an address from ``arena``."""
    _, length = page_span(0, size)
    at = (arena or ARENA).reserve(length)
    if at is None:
        got = _check(_libc.mmap(None, length, _PROT_READ_WRITE, _MAP_SHARED, fd, 0), "mmap of shared memory")
        return HostMapping(got, length)
    got = _libc.mmap(at, length, _PROT_READ_WRITE, _MAP_SHARED | _MAP_FIXED, fd, 0)
    if got is None or got == _MAP_FAILED:
        errno = ctypes.get_errno()
        _libc.munmap(at, length)
        raise OSError(errno, f"mmap of shared memory: {os.strerror(errno)}")
    return HostMapping(int(got), length)
