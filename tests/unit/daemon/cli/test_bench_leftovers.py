"""kvd.bench.leftovers: a bench run first removes the shm files of earlier runs whose process is
gone (a killed run cannot remove its own), and nothing else."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kvd.bench.leftovers import remove_dead_runs_files, segment_name


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_files_of_dead_runs_are_removed_and_live_runs_and_other_files_stay(tmp_path: Path) -> None:
    dead = segment_name(_dead_pid(), "0a1b2c3d")
    live = segment_name(os.getpid(), "4e5f6a7b")
    others = ["kvd-bench-raw-0a1b2c3d", "kvdlt-1-0a1b2c3d", "ucx_shm_posix_4e4b4277", "kvd-bench-12-notahex"]
    (tmp_path / dead).write_bytes(b"x" * 4096)
    for name in [live, *others]:
        (tmp_path / name).write_bytes(b"y")

    assert remove_dead_runs_files(tmp_path) == (1, 4096)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live, *others])
    assert remove_dead_runs_files(tmp_path) == (0, 0), "a second sweep finds nothing"


def test_a_missing_directory_removes_nothing(tmp_path: Path) -> None:
    assert remove_dead_runs_files(tmp_path / "absent") == (0, 0)
