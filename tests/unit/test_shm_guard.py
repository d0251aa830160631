"""tests/shm_guard.py: a run's /dev/shm files are removed however their processes end.

Issue 42: after the suite and repeated runs of tests/chaos/test_reader_death.py, five 512 MiB
``kvdtest-<pid>-…`` files were left in /dev/shm, one per run whose engine was killed. These
tests kill the processes that made files (an engine, the pytest run itself) and check that no
file is left and that nothing not the run's is touched; the guard watches a folder of the test's
own here, except in the last test, which runs a whole pytest session on the real /dev/shm.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import shm_guard
from shm_guard import ShmGuard

TESTS = Path(__file__).resolve().parents[1]
HANG_GUARD_S = 30.0  # only turns a hang into a failure: no outcome depends on it

_MAKER = r"""
import os, sys, time
path = os.path.join(sys.argv[1], f"{sys.argv[2]}-{os.getpid()}-0a1b2c")
open(path, "wb").close()
print(path, flush=True)
time.sleep(3600)
"""


def make_file(folder: Path, prefix: str = "kvdtest") -> tuple[subprocess.Popen[str], Path]:
    """A child process (an engine) that makes ``<prefix>-<its pid>-…`` in ``folder`` and lives on."""
    child = subprocess.Popen([sys.executable, "-c", _MAKER, str(folder), prefix], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    return child, Path(child.stdout.readline().strip())


def until_gone(path: Path) -> bool:
    deadline = time.monotonic() + HANG_GUARD_S
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not path.exists()


def test_after_a_test_the_files_of_its_dead_processes_are_removed_and_nothing_else(tmp_path: Path) -> None:
    """An engine SIGKILLed by the test leaves its file: removed after the test. A live engine's
    file, the test process's own, and a file of a process not of this run all stay."""
    stranger = tmp_path / f"kvdtest-{os.getppid()}-0a1b2c"  # our parent: alive, not below us
    stranger.touch()
    guard = ShmGuard(os.getpid(), shm_dir=tmp_path)
    killed, killed_file = make_file(tmp_path)
    living, living_file = make_file(tmp_path)
    own = tmp_path / f"kvdlt-{os.getpid()}-0a1b2c"
    own.touch()
    try:
        guard.scan()
        assert set(guard.owned) == {killed_file.name, living_file.name, own.name}
        killed.kill()
        killed.wait()

        assert guard.after_test() == [killed_file.name]
        assert not killed_file.exists() and living_file.exists() and own.exists() and stranger.exists()

        assert sorted(guard.finish()) == sorted([living_file.name, own.name])  # the session is over
        assert stranger.exists()
    finally:
        living.kill()
        living.wait()
        guard.stop()


def test_a_file_there_before_the_run_is_never_the_runs(tmp_path: Path) -> None:
    before = tmp_path / f"kvdtest-{os.getpid()}-0a1b2c"
    before.touch()
    guard = ShmGuard(os.getpid(), shm_dir=tmp_path)
    guard.scan()
    assert guard.owned == {} and guard.finish() == [] and before.exists()
    guard.stop()


_RUN = r"""
import os, sys, time
sys.path.insert(0, sys.argv[2])
from pathlib import Path
from shm_guard import ShmGuard
guard = ShmGuard(os.getpid(), shm_dir=Path(sys.argv[1]))
guard.start()
path = Path(sys.argv[1]) / f"kvdtest-{os.getpid()}-0a1b2c"
path.touch()
guard.scan()
print(path, flush=True)
time.sleep(3600)
"""


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_run_killed_outright_leaves_no_file(tmp_path: Path, how: signal.Signals) -> None:
    """The pytest run itself is killed (a CI timeout): no fixture, no finaliser, no atexit runs.
    The reaper it started removes the run's files once the run is gone, then itself."""
    run = subprocess.Popen([sys.executable, "-c", _RUN, str(tmp_path), str(TESTS)], stdout=subprocess.PIPE, text=True)
    assert run.stdout is not None
    path = Path(run.stdout.readline().strip())
    assert path.exists()
    run.send_signal(how)
    run.wait()
    assert until_gone(path), "the killed run's file is still there"
    records = Path(tempfile.gettempdir()).glob(f"kvdtest-shm-{run.pid}-*.txt")
    assert all(until_gone(record) for record in records), "the reaper left its record"


_LEAKY_TEST = """
import os

def test_leaks_a_shm_file():
    open(f"/dev/shm/kvdtest-{os.getpid()}-guardcheck", "wb").close()

def test_cleans_up():
    path = f"/dev/shm/kvdtest-{os.getpid()}-guardclean"
    open(path, "wb").close()
    os.unlink(path)
"""


@pytest.mark.skipif(not shm_guard.SHM_DIR.is_dir(), reason="needs /dev/shm")
def test_a_session_whose_test_left_a_file_fails_and_leaves_none(tmp_path: Path) -> None:
    """A whole pytest session with the plugin on the real /dev/shm: every test passes, but one
    left its file behind (its own process: not removed after the test). The session fails naming
    it, and the file is removed."""
    (tmp_path / "test_leaky.py").write_text(_LEAKY_TEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    session = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "shm_guard", "-p", "no:cacheprovider", "-q", str(tmp_path)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(TESTS)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = session.stdout + session.stderr
    assert "2 passed" in out, out
    assert session.returncode == pytest.ExitCode.TESTS_FAILED, out
    assert "/dev/shm files this run left behind" in out and "-guardcheck" in out and "-guardclean" not in out, out
    assert not list(shm_guard.SHM_DIR.glob("kvdtest-*-guardcheck")), "the leaked file was not removed"
