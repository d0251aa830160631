"""CPU accounting of the bench's processes: a daemon's whole tree (its control process and its
data-plane workers, live or reaped), apart or together, and the bench's own process."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds so far of a process and of every process under it, live or
    reaped (0 where there is none).

    A daemon that hands work to processes of its own (workers) is charged for them too: a live
    child is read on its own (recursively), a child that exited and was waited for is in the
    parent's ``cutime``/``cstime``. So a window's difference is the whole tree's CPU, whichever of
    its processes spent it. The process's own time is read from its CPU clock (nanoseconds: an
    idle daemon spends a few clock ticks a second, too few to count in ticks); ``/proc``'s ticks
    where the clock cannot be read.
    """
    return sum(split_cpu_seconds(pid))


def split_cpu_seconds(pid: int) -> tuple[float, float]:
    """(the process itself with its reaped children, its live children's trees): a daemon's
    control process and its data-plane workers (the worker and its spare), apart.

    Each process is read once: reading a busy child twice (once for the total, once for the
    share to subtract) charged the child's CPU between the two reads to the parent, negatively
    where a window's two ends differed, which a window of one engine step cannot absorb."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0.0
    tick = os.sysconf("SC_CLK_TCK")
    try:
        own = time.clock_gettime(_process_cpu_clock(pid))
    except OSError:
        own = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    reaped = (int(fields[13]) + int(fields[14])) / tick  # cutime, cstime
    return own + reaped, sum(cpu_seconds(child) for child in _children(pid))


def _process_cpu_clock(pid: int) -> int:
    """The clock id of a process's CPU time, all its threads (Linux's ``clock_getcpuclockid``:
    ``MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)``)."""
    return ((~pid) << 3) | 2


def _children(pid: int) -> list[int]:
    """The live children of ``pid`` (from each of its threads' ``children`` file)."""
    out: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        with contextlib.suppress(OSError, ValueError):
            out.extend(int(child) for child in (task / "children").read_text().split())
    return out


def own_cpu_seconds() -> float:
    """This process's CPU seconds so far, every thread (the bench's client: its gRPC channels,
    its event loop, its engine stream), without its children (it has none but the daemons)."""
    return time.process_time()
