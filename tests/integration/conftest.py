"""Fixtures of the integration tests that more than one module shares."""

from __future__ import annotations

from pathlib import Path

import pytest
from release_kit import REPO, build_distributions


@pytest.fixture(scope="session")
def release_dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sdists and wheels of both distributions, built once per session as a release builds them
    (tests/integration/test_packaging.py checks them, test_release.py installs and runs them)."""
    if not (REPO / ".git").exists():
        pytest.skip("needs a git checkout to know which files a clean clone holds")
    return build_distributions(tmp_path_factory.mktemp("release"))
