"""A pytest plugin: this run's /dev/shm files are removed however their processes end, and checked.

Tests put engines' KV in POSIX shared memory: the test process itself, engine processes it
starts (some SIGKILLed on purpose: tests/chaos), ``kvd selftest`` and bench processes, the fleet.
A file outlives a process that dies without unlinking it, and so does every file of a pytest run
that is itself killed (a CI timeout): five 512 MiB files of tests/chaos/test_reader_death.py were
left on one machine (issue 42). So, for every run (tests/conftest.py loads this plugin):

* **whose file**: a watcher thread lists /dev/shm every :data:`POLL_S`; a new file whose name
  carries the pid of this pytest process or of a live descendant of it (every name the project
  makes does: ``<prefix>-<pid>-<random>``) is this run's. Other runs on the same machine, and
  whatever else lives in /dev/shm, are never touched;
* **after each test** the run's files whose creator process is gone are removed: what a
  supervisor does for a dead engine (the name only; a daemon that mapped the file keeps its
  memory until it unmaps it). A file of a live process, the test process included, may still be
  in use (a module fixture's engine) and stays;
* **at the end of the session** every file of the run still there is removed, and the session
  fails naming them: a test left its own file behind (CI checks that /dev/shm holds nothing of
  the project's afterwards);
* **if pytest itself is killed**: a reaper process, in a session of its own, waits for the run's
  end (the end of a pipe only pytest holds) and removes every file the watcher recorded (a list
  file in the temp dir, written as files are found), so even a SIGKILLed run leaves none.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

SHM_DIR = Path("/dev/shm")
POLL_S = 0.2
MAX_PID_DIGITS = 7  # pid_max is at most 2**22: a longer run of digits is a random part, not a pid

_REAPER = r"""
import os, sys
sys.stdin.buffer.read()  # end of file: the run is over, however it ended
shm_dir, record = sys.argv[1], sys.argv[2]
try:
    with open(record) as f:
        names = f.read().split()
except OSError:
    names = []
for name in names:
    try:
        os.unlink(os.path.join(shm_dir, name))
    except OSError:
        pass
try:
    os.unlink(record)
except OSError:
    pass
"""


def _parent(pid: int) -> int:
    """The parent of ``pid``, or 0 if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat.rsplit(")", 1)[1].split()[1])  # the command name may hold spaces and parentheses


def descends(pid: int, root: int) -> bool:
    """Is ``pid`` ``root`` or a live process below it?"""
    for _ in range(64):
        if pid == root:
            return True
        if pid <= 1:
            return False
        pid = _parent(pid)
    return False


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not reaped yet) has stopped using its files: it counts as gone.
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return False


def pids_in(name: str) -> list[int]:
    """The fields of a file name that can be a pid (``<prefix>-<pid>-<random>``)."""
    return [int(f) for f in name.split("-") if f.isdigit() and len(f) <= MAX_PID_DIGITS and int(f) > 1]


@dataclasses.dataclass(frozen=True)
class Owned:
    name: str
    creator: int  # the pid in its name that made it this run's


class ShmGuard:
    """Finds, records and removes the run's /dev/shm files (module docstring)."""

    def __init__(self, root: int, shm_dir: Path = SHM_DIR) -> None:
        self.root = root
        self.shm_dir = shm_dir
        self.owned: dict[str, Owned] = {}
        self._seen: set[str] = set(self._listing())  # there before the run: never the run's
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._reaper: subprocess.Popen[bytes] | None = None
        fd, record = tempfile.mkstemp(prefix=f"kvdtest-shm-{root}-", suffix=".txt")
        os.close(fd)
        self.record = Path(record)

    def _listing(self) -> list[str]:
        try:
            return os.listdir(self.shm_dir)
        except OSError:
            return []

    def start(self) -> None:
        self._reaper = subprocess.Popen(
            [sys.executable, "-c", _REAPER, str(self.shm_dir), str(self.record)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # not in the run's process group: a group kill spares it
        )
        self._thread = threading.Thread(target=self._watch, name="kvdtest-shm-guard", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            self.scan()

    def scan(self) -> None:
        """Record the run's files that appeared since the last scan."""
        with self._lock:
            new = [name for name in self._listing() if name not in self._seen]
            found = []
            for name in new:
                self._seen.add(name)
                creator = next((pid for pid in pids_in(name) if descends(pid, self.root)), 0)
                if creator:
                    self.owned[name] = Owned(name, creator)
                    found.append(name)
            if found:
                with self.record.open("a") as record:
                    record.write("".join(f"{name}\n" for name in found))

    def _present(self) -> list[Owned]:
        return [owned for owned in self.owned.values() if (self.shm_dir / owned.name).exists()]

    def _remove(self, files: list[Owned]) -> list[str]:
        removed = []
        for owned in files:
            with contextlib.suppress(FileNotFoundError):
                (self.shm_dir / owned.name).unlink()
                removed.append(owned.name)
        return removed

    def after_test(self) -> list[str]:
        """Remove the run's files whose creator process is gone; their names."""
        self.scan()
        with self._lock:
            return self._remove([o for o in self._present() if o.creator != self.root and not alive(o.creator)])

    def finish(self) -> list[str]:
        """Remove every file of the run still there (the session is over); their names."""
        self.scan()
        with self._lock:
            return self._remove(self._present())

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        reaper, self._reaper = self._reaper, None
        if reaper is not None and reaper.stdin is not None:
            reaper.stdin.close()  # it removes what is left (nothing, after finish) and the record
            with contextlib.suppress(subprocess.TimeoutExpired):
                reaper.wait(10.0)


_GUARD = pytest.StashKey[ShmGuard]()
_LEFT = pytest.StashKey[list[str]]()


def pytest_configure(config: pytest.Config) -> None:
    if not SHM_DIR.is_dir():
        return
    guard = ShmGuard(os.getpid())
    guard.start()
    config.stash[_GUARD] = guard


@pytest.fixture(autouse=True)
def _shm_of_dead_processes_removed(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test (its other fixtures torn down first): the run's files of gone processes."""
    yield
    guard = request.config.stash.get(_GUARD, None)
    if guard is not None:
        guard.after_test()


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    guard = session.config.stash.get(_GUARD, None)
    if guard is None:
        return
    time.sleep(POLL_S)  # a file made just before the end is listed too
    left = guard.finish()
    session.config.stash[_LEFT] = left
    if left and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    left = terminalreporter.config.stash.get(_LEFT, [])
    if left:
        terminalreporter.write_sep("=", "/dev/shm files this run left behind (now removed)", red=True)
        for name in left:
            terminalreporter.write_line(f"  {name}")


def pytest_unconfigure(config: pytest.Config) -> None:
    guard = config.stash.get(_GUARD, None)
    if guard is not None:
        guard.stop()
