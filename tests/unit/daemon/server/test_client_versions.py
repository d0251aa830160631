"""The daemon names each kvd-client version older than it supports, once, and nothing else."""

from __future__ import annotations

import logging

import pytest

from kvd.server import client_versions
from kvd.server.client_versions import ClientVersionLog, client_version


def _md(agent: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", "Bearer x"), ("user-agent", agent))


def _agent(version: str, flavour: str = "grpc-python/1.85.3") -> str:
    return f"kvd-client/{version} {flavour} grpc-c/58.0.0 (linux; chttp2)"


def test_the_version_is_read_from_the_kvd_client_token() -> None:
    assert client_version(_agent("0.2.0")) == "0.2.0"
    assert client_version("grpc-python/1.85.3 grpc-c/58.0.0") is None
    assert client_version("grpcurl/1.9 kvd-client/0.3.1") == "0.3.1"
    assert client_version("not-kvd-client/9.9") is None


def test_a_too_old_version_is_logged_once_whatever_its_grpc_flavour(caplog: pytest.LogCaptureFixture) -> None:
    log = ClientVersionLog(minimum="0.2.0", own_version="0.3.0")
    with caplog.at_level(logging.WARNING, logger=client_versions.__name__):
        for _ in range(3):
            log.note(_md(_agent("0.1.5")), "/kvd.v1.RouterService/GetStatus")
        log.note(_md(_agent("0.1.5", "grpc-python-asyncio/1.85.3")), "/kvd.v1.RouterService/StartPull")
        log.note(_md(_agent("0.1.9")), "/kvd.v1.RouterService/GetStatus")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "kvd-client 0.1.5 called /kvd.v1.RouterService/GetStatus" in lines[0]
    assert "this daemon (kvd 0.3.0) supports kvd-client 0.2.0 or newer" in lines[0]
    assert "0.1.9" in lines[1]
    assert log.logged == {"0.1.5", "0.1.9"}


def test_current_newer_and_unnamed_clients_are_not_logged(caplog: pytest.LogCaptureFixture) -> None:
    log = ClientVersionLog(minimum="0.2.0", own_version="0.2.0")
    with caplog.at_level(logging.DEBUG, logger=client_versions.__name__):
        for metadata in (
            _md(_agent("0.2.0")),
            _md(_agent("1.4.0")),
            _md("grpc-go/1.70 (a kubelet probe)"),
            _md(_agent("not-a-version")),
            (),
            None,
        ):
            log.note(metadata, "/grpc.health.v1.Health/Check")
    assert caplog.records == [] and log.logged == set()


def test_a_caller_inventing_versions_cannot_flood_the_log(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client_versions, "MAX_VERSIONS_LOGGED", 3)
    monkeypatch.setattr(client_versions, "MAX_AGENTS_REMEMBERED", 5)
    log = ClientVersionLog(minimum="1.0.0", own_version="1.0.0")
    with caplog.at_level(logging.WARNING, logger=client_versions.__name__):
        for minor in range(50):
            log.note(_md(_agent(f"0.{minor}.0")), "/kvd.v1.RouterService/GetStatus")
    assert len(caplog.records) == 4  # three versions, then one line saying no more are logged
    assert "no more are logged" in caplog.records[-1].getMessage()
    assert len(log._agents) == 5
