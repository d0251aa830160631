"""Chaos tests run many times: a crash that shows once in four runs must not pass as green.

Every test here runs ``--chaos-repeat`` times (3 by default: CI's whole run took 55 minutes with
5 on its loaded 2-core machine, and must stay well under an hour; 10 or more, by hand, before
believing a change to a lifetime;
``KVD_CHAOS_REPEAT`` or the flag to change it; ``@pytest.mark.chaos_rounds(N)`` caps a test whose
one round takes a minute and whose every case is covered within N rounds); round 0 runs beside
a CPU load generator (a busy process per core), because lifetimes races show most when the
daemons are starved. Tests that take the ``ucx_env`` fixture run over UCX TCP and over UCX's
default transports (shared memory, CMA, TCP as UCX picks).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kvd.spawn import child_env

LOADED_ROUND = 0
TRANSPORTS = {"tcp": {"UCX_TLS": "tcp"}, "default": {}}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "chaos_round" in metafunc.fixturenames:
        rounds = max(1, metafunc.config.getoption("--chaos-repeat"))
        cap = metafunc.definition.get_closest_marker("chaos_rounds")
        if cap is not None:  # a long test whose every case (transport, side, load) fits in fewer rounds
            rounds = min(rounds, int(cap.args[0]))
        ids = [f"round{i}{'-cpuload' if i == LOADED_ROUND else ''}" for i in range(rounds)]
        metafunc.parametrize("chaos_round", range(rounds), indirect=True, ids=ids)
    if "ucx_env" in metafunc.fixturenames:
        metafunc.parametrize("ucx_env", list(TRANSPORTS), indirect=True, ids=[f"ucx-{t}" for t in TRANSPORTS])


@pytest.fixture(autouse=True)
def chaos_round(request: pytest.FixtureRequest) -> Iterator[int]:
    """The repetition; the loaded one keeps every core busy for the whole test."""
    index = int(request.param)
    burners: list[subprocess.Popen[bytes]] = []
    if index == LOADED_ROUND:
        burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        yield index
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


@pytest.fixture
def ucx_env(request: pytest.FixtureRequest) -> dict[str, str]:
    """The daemons' environment for one UCX transport choice."""
    return child_env(**TRANSPORTS[str(request.param)])
