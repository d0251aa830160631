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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os

logger = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
_PROT_READ_WRITE = mmap.PROT_READ | mmap.PROT_WRITE
_MAP_PRIVATE = mmap.MAP_PRIVATE
_MAP_ANONYMOUS = getattr(mmap, "MAP_ANONYMOUS", 0x20)
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000
_MREMAP_MAYMOVE = 1
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mremap.restype = ctypes.c_void_p
_libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


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


class HostMapping:
    """A second mapping of shared pages, owned by kvd (unmapped by :meth:`close`)."""

    def __init__(self, address: int, size: int) -> None:
        self.address = address
        self.size = size
        self._closed = False

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if _libc.munmap(self.address, self.size) != 0:
                logger.warning("munmap(%#x, %d) failed: %s", self.address, self.size, os.strerror(ctypes.get_errno()))


def duplicate_mapping(address: int, size: int) -> HostMapping:
    """Map the shared pages under ``address`` once more, at a new address (the old one is untouched).

    ``address`` must start a page and lie in a shared mapping (an engine's ``/dev/shm`` file as
    the daemon mapped it): the new mapping sees and changes the very same pages.
    """
    if address % PAGE:
        raise ValueError(f"address {address:#x} does not start a page")
    _, length = page_span(address, size)
    new = _check(_libc.mremap(address, 0, length, _MREMAP_MAYMOVE), "mremap(old_size=0) of a shared mapping")
    return HostMapping(new, length)
