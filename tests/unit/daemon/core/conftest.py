"""Fixtures of the daemon core's scenario tests (lifetimes, data-plane restarts)."""

from __future__ import annotations

import pytest
from lifetime_fakes import Fabric

import kvd.core.engines as engines_module
import kvd.core.restarts as restarts_module
import kvd.core.sweeper as sweeper_module


@pytest.fixture
def fabric(monkeypatch: pytest.MonkeyPatch) -> Fabric:
    """Daemons built by this test get a fake data plane; their sweepers never run on their own."""
    fabric = Fabric()
    monkeypatch.setattr(restarts_module, "DataPlane", fabric.make_dataplane)
    monkeypatch.setattr(sweeper_module, "SWEEP_S", 3600.0)
    monkeypatch.setattr(sweeper_module, "SWEEP_MIN_S", 3600.0)  # not even on a passed deadline
    monkeypatch.setattr(sweeper_module, "SWEEP_IDLE_MAX_S", 3600.0)
    monkeypatch.setattr(engines_module, "LIVENESS_S", 3600.0)
    return fabric
