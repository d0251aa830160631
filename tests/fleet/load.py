"""Load as a fault: one busy process per core beside the fleet (``--load``), for the whole run.

Each hog spins in pure Python at the priority the daemons run at (the fleet's own: it starts the
daemons, and nothing renices them), so the scheduler shares every core between the hogs and the
fleet's processes as it would on a node whose other tenants are busy. The hogs live in the
fleet's namespace and are ended by pid at the end, or by the fleet's interrupt handler.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

SPIN = "while True:\n    pass\n"


def cores() -> int:
    """The cores this process may run on (its affinity), as the daemons see them."""
    return len(os.sched_getaffinity(0))


def start_hogs(count: int | None = None) -> list[subprocess.Popen[bytes]]:
    """``count`` (default: one per core) busy processes at this process's own nice value."""
    return [
        subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        for _ in range(count if count is not None else cores())
    ]


def stop_hogs(hogs: list[subprocess.Popen[bytes]]) -> None:
    for hog in hogs:
        if hog.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                hog.kill()
    for hog in hogs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            hog.wait(10)
