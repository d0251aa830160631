"""What earlier ``kvd bench`` runs left in /dev/shm: removed before a run starts.

A bench run puts its engine's KV cache in a POSIX shared-memory file named
``kvd-bench-<pid>-<random>`` (kvd.bench.rig.Engine) and removes it when it ends. A run that is
killed (a timeout, SIGKILL, an out-of-memory kill) cannot, and each file holds up to the whole
cache it was given (hundreds of MiB for a full run's largest pulls). On one machine, runs killed
over a day had left 15 GB there, and /dev/shm is memory: the next large job was killed for lack
of it. So every run first removes the files of bench runs whose process is gone. A file whose
process is alive is another run's, in use, and stays; nothing else in /dev/shm is touched.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "kvd-bench"
_NAME = re.compile(rf"^{SEGMENT_PREFIX}-(\d{{1,7}})-[0-9a-f]+$")


def segment_name(pid: int, suffix: str) -> str:
    """The shm name of a bench run's engine cache (what :func:`remove_dead_runs_files` recognises)."""
    return f"{SEGMENT_PREFIX}-{pid}-{suffix}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    try:  # a zombie (exited, not reaped yet) no longer uses its files
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def remove_dead_runs_files(shm_dir: Path = SHM_DIR) -> tuple[int, int]:
    """Remove the bench files whose creating process is gone; returns (files, bytes) removed."""
    removed, freed = 0, 0
    try:
        entries = list(os.scandir(shm_dir))
    except OSError:
        return 0, 0
    for entry in entries:
        match = _NAME.match(entry.name)
        if match is None or _alive(int(match.group(1))):
            continue
        try:
            size = entry.stat(follow_symlinks=False).st_size
            os.unlink(entry.path)
        except OSError:  # gone meanwhile, or not ours to remove
            continue
        removed, freed = removed + 1, freed + size
    return removed, freed
