"""Fixtures shared by every test folder: real daemons as child processes."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/kvtest.py helpers

from kvd.spawn import DaemonProcess, start_daemon

# Every /dev/shm file of the run is removed however its processes end; the session fails if a
# test left one behind (tests/shm_guard.py).
pytest_plugins = ["shm_guard"]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--chaos-repeat",
        type=int,
        default=int(os.environ.get("KVD_CHAOS_REPEAT", "3")),
        help="run every chaos test this many times, the first beside a CPU load (default: $KVD_CHAOS_REPEAT or 3; "
        "run 10 or more before believing a change to a lifetime)",
    )


@pytest.fixture
def spawn_daemon(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., DaemonProcess]]:
    """Start `kvd serve` processes (free ports, private sockets); all are stopped at the end."""
    started: list[DaemonProcess] = []
    counter = iter(range(1000))

    # A spare data-plane worker imports torch and NIXL for seconds of CPU after the daemon is
    # ready: tests that never lose a worker start without one (on two cores it competed with every
    # test's first pulls). Chaos tests and tests marked spare_worker keep the default (a spare).
    with_spare = any(request.node.get_closest_marker(m) is not None for m in ("chaos", "spare_worker"))

    def spawn(
        *flags: str, name: str = "", env: dict[str, str] | None = None, command_prefix: tuple[str, ...] = ()
    ) -> DaemonProcess:
        name = name or f"d{next(counter)}"
        if not with_spare and not any(flag.startswith("--dataplane-spare-worker") for flag in flags):
            flags = (*flags, "--dataplane-spare-worker", "false")
        daemon = start_daemon(tmp_path, name, list(flags), env=env, command_prefix=command_prefix)
        started.append(daemon)
        return daemon

    yield spawn
    failed = getattr(request.node, "rep_call", None)
    crashes = []
    for daemon in started:
        code = daemon.terminate()
        crash = daemon.crash()
        if crash:
            crashes.append(crash)
        elif failed is not None and failed.failed:
            print(f"--- log of daemon {daemon.name} (exit {code}) ---\n{daemon.log_tail(60)}")
    if crashes:  # never a plain failure: a daemon that died of a signal fails the test, with its stacks
        pytest.fail("a daemon crashed:\n" + "\n\n".join(crashes), pytrace=False)


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    setattr(item, "rep_" + report.when, report)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` skip cleanly (with the reason) where no CUDA device is visible."""
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run `pytest -m gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
