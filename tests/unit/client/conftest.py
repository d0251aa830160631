"""Fixtures of the client's unit tests: a fake daemon per test, and a target nobody serves."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from client_fakes import END, FakeDaemon, short_dir, start_fake_daemon


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[FakeDaemon]:
    """A fake daemon for one test."""
    fake = start_fake_daemon(short_dir(tmp_path))
    try:
        yield fake
    finally:
        fake.router.release.set()
        for stream in fake.engine.streams:
            stream.outbound.put(END)
        fake.server.stop(grace=None).wait(5)


@pytest.fixture
def nowhere(tmp_path: Path) -> str:
    """A Unix socket target nothing listens on: calls fail UNAVAILABLE at once."""
    return f"unix://{short_dir(tmp_path) / 'nobody-home.sock'}"
