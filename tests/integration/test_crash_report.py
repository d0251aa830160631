"""A daemon that dies of a signal is never a plain failure: its stacks are in its log, and the
test fixture names it."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from kvd.dataplane_protocol import STACKS_SIGNAL
from kvd.spawn import start_daemon
from kvd_client import KvdClient

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("sig", [signal.SIGSEGV, signal.SIGABRT])
def test_a_crashed_daemon_leaves_every_threads_stack_and_is_named(tmp_path: Path, sig: signal.Signals) -> None:
    daemon = start_daemon(tmp_path, "crashy")
    try:
        daemon.process.send_signal(sig)
        daemon.process.wait(30)
        report = daemon.crash()
        assert f"died of {sig.name}" in report and "crashy" in report
        # faulthandler: the fatal signal and the Python stack of each thread (the event loop's).
        assert "Fatal Python error" in report, report
        assert "asyncio" in report, report
    finally:
        daemon.terminate()


def test_a_daemon_killed_on_purpose_or_stopped_cleanly_is_no_crash(tmp_path: Path) -> None:
    stopped, killed = start_daemon(tmp_path, "stopped"), start_daemon(tmp_path, "killed")
    assert stopped.crash() == "" and killed.crash() == ""  # alive
    assert stopped.terminate() == 0 and stopped.crash() == ""
    killed.kill()
    deadline = time.monotonic() + 10
    while killed.process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert killed.process.returncode == -signal.SIGKILL and killed.crash() == ""


def test_a_daemon_asked_for_its_stacks_writes_every_threads_and_serves_on(tmp_path: Path) -> None:
    """An operator's `kill -USR1` on a daemon that seems stuck: its log gets every thread's Python
    stack (the event loop's among them), and the daemon neither dies nor stops answering."""
    daemon = start_daemon(tmp_path, "asked")
    try:
        daemon.process.send_signal(STACKS_SIGNAL)
        deadline = time.monotonic() + 10
        written = ""
        while "asyncio" not in written and time.monotonic() < deadline:
            time.sleep(0.05)
            written = daemon.log_path.read_text(errors="replace")
        assert "Thread 0x" in written and "asyncio" in written, written
        assert "Fatal Python error" not in written, written
        with KvdClient(daemon.unix_target) as client:
            assert client.get_status(timeout_s=10).incarnation == daemon.incarnation
        assert daemon.process.poll() is None and daemon.crash() == ""
        assert daemon.terminate() == 0  # and it still stops cleanly
    finally:
        daemon.terminate()
