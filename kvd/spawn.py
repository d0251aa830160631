"""Start `kvd serve` as a child process and wait until it is ready (selftest, demo, tests)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path


@dataclasses.dataclass
class DaemonProcess:
    """A running child daemon and what its ready file said."""

    process: subprocess.Popen[bytes]
    name: str
    unix_socket: str
    tcp: str
    metrics: str
    incarnation: str
    log_path: Path
    killed: bool = False  # the caller SIGKILLed it on purpose (chaos): its signal is not a crash

    def crash(self) -> str:
        """Why the daemon died of a signal nobody sent it on purpose, with its log's tail (where
        ``kvd serve``'s faulthandler wrote every thread's stack); "" while it lives or if it exited."""
        code = self.process.poll()
        if code is None or code >= 0 or self.killed:
            return ""
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"kvd serve ({self.name}, pid {self.process.pid}) died of {name}:\n{self.log_tail(120)}"

    @property
    def unix_target(self) -> str:
        return f"unix://{self.unix_socket}"

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def terminate(self, timeout_s: float = 20.0) -> int:
        """SIGTERM and wait; SIGKILL if it does not exit in time. Returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.killed = True  # hung at shutdown: reported by its exit code (-9), not as a crash
                self.process.kill()
                self.process.wait()
        return int(self.process.returncode)

    def kill(self) -> None:
        """SIGKILL: the daemon dies mid-whatever (chaos tests)."""
        self.killed = True
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@dataclasses.dataclass
class Launch:
    """A `kvd serve` child that was started but may not be ready yet (see :func:`wait_ready`)."""

    process: subprocess.Popen[bytes]
    name: str
    ready: Path
    log_path: Path


def launch_daemon(
    workdir: Path,
    name: str,
    extra_flags: Sequence[str] = (),
    env: dict[str, str] | None = None,
    command_prefix: Sequence[str] = (),
) -> Launch:
    """Start a daemon on a free TCP port, a private Unix socket and a free metrics port; don't wait.

    Several launches followed by their :func:`wait_ready` start daemons in parallel (each spends
    seconds importing torch and creating its NIXL agent). ``command_prefix`` runs the daemon under
    another command (``ip netns exec NS`` in partition tests).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    ready = workdir / f"{name}.ready.json"
    ready.unlink(missing_ok=True)
    log_path = workdir / f"{name}.log"
    sock = workdir / f"{name}.sock"
    cmd = [
        *command_prefix,
        sys.executable,
        "-m",
        "kvd.cli.main",
        "serve",
        "--unix-socket",
        str(sock),
        "--port",
        "0",
        "--metrics-port",
        "0",
        "--ready-file",
        str(ready),
        *extra_flags,
    ]
    log = open(log_path, "wb")  # noqa: SIM115 - the child owns it for its lifetime
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env if env is not None else None)
    log.close()
    return Launch(process, name, ready, log_path)


def wait_ready(launch: Launch, ready_timeout_s: float = 60.0) -> DaemonProcess:
    """Wait for a launched daemon's ready file; a daemon that exits or hangs first is an error."""
    process, name, ready, log_path = launch.process, launch.name, launch.ready, launch.log_path
    deadline = time.monotonic() + ready_timeout_s
    while not ready.exists():
        if process.poll() is not None:
            raise RuntimeError(
                f"kvd serve ({name}) exited with {process.returncode} before it was ready:\n"
                + log_path.read_text(errors="replace")[-4000:]
            )
        if time.monotonic() > deadline:
            process.kill()
            process.wait()
            raise RuntimeError(
                f"kvd serve ({name}) not ready after {ready_timeout_s}s:\n" + log_path.read_text()[-4000:]
            )
        time.sleep(0.05)
    info = json.loads(ready.read_text())
    return DaemonProcess(process, name, info["unix"], info["tcp"], info["metrics"], info["incarnation"], log_path)


def start_daemon(
    workdir: Path,
    name: str,
    extra_flags: Sequence[str] = (),
    env: dict[str, str] | None = None,
    ready_timeout_s: float = 60.0,
    command_prefix: Sequence[str] = (),
) -> DaemonProcess:
    """Start a daemon (see :func:`launch_daemon`) and wait until it is ready."""
    return wait_ready(launch_daemon(workdir, name, extra_flags, env, command_prefix), ready_timeout_s)


@contextlib.contextmanager
def running_daemon(workdir: Path, name: str, extra_flags: Sequence[str] = ()) -> Iterator[DaemonProcess]:
    daemon = start_daemon(workdir, name, extra_flags)
    try:
        yield daemon
    finally:
        daemon.terminate()


def start_owned(stack: contextlib.ExitStack, workdir: Path, *names: str) -> list[DaemonProcess]:
    """Start daemons in parallel that ``stack`` stops (SIGTERM, also in parallel) on exit.

    For selftest, bench and demo: both the start (imports, NIXL agent) and the exit (interpreter
    teardown) take about a second each, so doing them side by side halves the wait.
    """
    return [wait_ready(launch) for launch in launch_owned(stack, workdir, *names)]


def launch_owned(
    stack: contextlib.ExitStack, workdir: Path, *names: str, extra_flags: Sequence[str] = ()
) -> list[Launch]:
    """:func:`start_owned` without the wait: the caller does other work, then :func:`wait_ready`.

    These daemons live seconds and nothing kills their workers: they start without a spare worker
    (``dataplane_spare_worker``), which would only compete for the CPU with their first pulls."""
    flags = ["--log-level", "WARNING", "--dataplane-spare-worker", "false", *extra_flags]
    launches = [launch_daemon(workdir, name, flags) for name in names]
    stack.callback(stop_launches, launches)
    return launches


def stop_launches(launches: Sequence[Launch], timeout_s: float = 20.0, wait: bool = True) -> None:
    """SIGTERM every still-running launch, then wait for all; SIGKILL the ones that outstay ``timeout_s``.

    ``wait=False`` only signals (a later call waits): the daemon shuts down while the caller works.
    """
    for launch in launches:
        if launch.process.poll() is None:
            launch.process.send_signal(signal.SIGTERM)
    if not wait:
        return
    deadline = time.monotonic() + timeout_s
    for launch in launches:
        try:
            launch.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            launch.process.kill()
            launch.process.wait()


def child_env(**overrides: str) -> dict[str, str]:
    """The current environment plus overrides (for children with e.g. UCX_TLS set)."""
    env = dict(os.environ)
    env.update(overrides)
    return env
