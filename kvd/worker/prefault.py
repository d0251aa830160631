"""Populating the worker's mappings of engine host memory in the background, off the pull path.

Why: the worker maps an engine's ``/dev/shm`` file when the engine registers it. The file's
pages are resident (the engine wrote them), but the worker's page tables for the new mapping
are empty, so the first NIXL copy into each page takes a page fault inside UCX's copy. Measured
on the development VM: ``process_vm_readv`` (what UCX's ``cma`` transport does for a READ) of
128 MiB into a fresh mapping of resident shared memory took 52-56 ms, into the same mapping
once touched 16 ms. A pull paid that for every block it wrote for the first time, and again
for every block after a fence re-mapped the region (kvd.worker.vm). Reading from a holder's
fresh mapping costs less (about 10 % more, read faults map 16 pages at once) and is populated
the same way.

``MADV_POPULATE_WRITE`` (Linux 5.14) fills the page tables without touching the bytes: about
0.2 ms per MiB of one core here, paid once per mapping, at most :data:`DUTY` of one core (the
thread sleeps between chunks for its own CPU time's worth): the pulls come first. Not at a low
CPU priority: this is a Python thread, and a thread preempted while it holds the GIL holds up
every other thread of the worker (its NIXL thread, its event loop) until the kernel runs it
again: beside two busy processes on two cores, stalls of 310-360 ms at a time while 512 MiB was
populated (docs/performance.md, "The prefault thread's priority"). Only pages
already resident are populated (``mincore`` first): a page of a sparse file the engine never
wrote would be allocated by it, and its first write allocates it anyway. On an older kernel the
first attempt fails with ``EINVAL`` and the worker stops trying (logged once).

Owner, thread and lifetime: one :class:`Prefaulter` per worker, owned by its
:class:`~kvd.worker.regions.RegionTable` (event loop). Its thread, ``kvd-prefault``, starts when a
mapping is handed to it and ends once none is left to populate (the next mapping starts another):
a killed process exits only once each of its threads has run, and a thread waiting for the CPU
holds a killed worker's exit up, and with it the daemon's restart (measured when it ran at the
lowest priority: 0.1-2.8 s from a SIGKILL to the worker reaped beside two busy processes on two
cores, 0.06-0.09 s without a prefault thread). It holds :class:`~kvd.worker.vm.HostMapping`
objects only, and populates each in chunks under the mapping's own lock, so a mapping that is
retired or closed meanwhile stops within one chunk (:data:`CHUNK_BYTES`, about a millisecond)
and nothing is ever populated in a range after it was retired or unmapped.
"""

from __future__ import annotations

import collections
import errno
import logging
import threading
import time

from kvd.worker.vm import HostMapping

logger = logging.getLogger(__name__)

CHUNK_BYTES = 4 << 20
"""Populated per step: short enough that closing or retiring a mapping waits ~1 ms at most."""

DUTY = 0.25
"""The most of one core the thread takes: after each chunk it sleeps ``(1 - DUTY) / DUTY`` times
the CPU time that chunk took."""


class Prefaulter:
    """Populates host mappings one after another, in a thread of its own (module docstring)."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        self._chunk_bytes = chunk_bytes
        self._queue: collections.deque[HostMapping] = collections.deque()
        self._condition = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.unsupported = False  # the kernel has no MADV_POPULATE_WRITE: nothing is queued any more

    def add(self, mapping: HostMapping) -> None:
        """Queue ``mapping`` to be populated; returns at once."""
        with self._condition:
            if self._closed or self.unsupported:
                return
            self._queue.append(mapping)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvd-prefault", daemon=True)
                self._thread.start()
            self._condition.notify()

    def close(self) -> None:
        """Drop what is queued and end the thread (a chunk in progress finishes first)."""
        with self._condition:
            self._closed = True
            self._queue.clear()
            self._condition.notify()

    def _next(self) -> HostMapping | None:
        """The next mapping to populate; None (the thread ends) when none is left or closed."""
        with self._condition:
            if self._closed or not self._queue:
                self._thread = None  # under the lock: add() starts a new thread for the next one
                return None
            return self._queue.popleft()

    def _run(self) -> None:
        pause_per_cpu_s = (1.0 - DUTY) / DUTY
        while (mapping := self._next()) is not None:
            started = time.perf_counter()
            try:
                while True:
                    cpu_before = time.thread_time()
                    more = mapping.populate_next(self._chunk_bytes)
                    if not more:
                        break
                    time.sleep((time.thread_time() - cpu_before) * pause_per_cpu_s)
            except OSError as exc:
                if exc.errno == errno.EINVAL and mapping.populated == 0:
                    with self._condition:
                        self.unsupported = True
                        self._queue.clear()
                    logger.info(
                        "this kernel cannot pre-fault mappings (MADV_POPULATE_WRITE, Linux 5.14): the first "
                        "copy into each page of engine memory takes a page fault instead"
                    )
                    return
                logger.info(
                    "stopped pre-faulting a mapping of engine memory at %d of %d bytes: %s",
                    mapping.populated,
                    mapping.size,
                    exc,
                )
                continue
            logger.debug(
                "pre-faulted %d of %d bytes of a mapping in %.1f ms",
                mapping.populated,
                mapping.size,
                (time.perf_counter() - started) * 1e3,
            )
