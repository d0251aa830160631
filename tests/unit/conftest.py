"""Unit tests run in one process with no NIXL in it.

NIXL's libraries, once loaded into the test process, made a later import of grpc_tools' protoc
compiler (tests/unit/test_proto_current.py) segfault, killing the whole run. Unit tests use fakes
for NIXL; real NIXL belongs in integration tests, in child processes. A test that loads it fails
here, by name, instead of a later test crashing.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _no_nixl_in_the_test_process(request: pytest.FixtureRequest) -> Iterator[None]:
    loaded_before = "nixl" in sys.modules
    yield
    if not loaded_before:
        assert "nixl" not in sys.modules, f"{request.node.nodeid} loaded NIXL into the unit-test process"
