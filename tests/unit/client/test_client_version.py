"""One version for both distributions, and every client channel names it in its user-agent."""

from __future__ import annotations

import asyncio
import tomllib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2_grpc
from grpc_health.v1._async import HealthServicer

import kvd
import kvd_client
from kvd.cli.main import build_parser
from kvd_client import AsyncKvdClient, KvdClient
from kvd_client.channel import DEFAULT_OPTIONS, PEER_CHANNEL_OPTIONS, channel_options
from kvd_client.version import USER_AGENT, is_older, version_tuple

REPO = Path(__file__).resolve().parents[3]


def test_both_distributions_take_their_version_from_client_version_py() -> None:
    for pyproject in (REPO / "pyproject.toml", REPO / "client" / "pyproject.toml"):
        project = tomllib.loads(pyproject.read_text())
        assert "version" not in project["project"], f"{pyproject}: a second version"
        assert project["project"]["dynamic"] == ["version"]
        assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "kvd_client.version.__version__"}
    assert kvd.__version__ == kvd_client.__version__
    assert version_tuple(kvd.__version__) is not None


def test_kvd_version_prints_the_release(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvd {kvd.__version__}"


@pytest.mark.parametrize(
    ("version", "minimum", "older"),
    [
        ("0.1.0", "0.2.0", True),
        ("0.2.0", "0.2.0", False),
        ("0.2", "0.2.0", False),
        ("0.10.0", "0.9.3", False),
        ("1.0.0rc1", "1.0.0", False),  # a release candidate is not too old for its release
        ("0.9.9.dev3", "1.0", True),
        ("garbage", "0.1.0", None),
    ],
)
def test_versions_compare_by_their_numeric_release(version: str, minimum: str, older: bool | None) -> None:
    assert is_older(version, minimum) is older


def test_client_and_peer_channels_send_the_user_agent() -> None:
    assert ("grpc.primary_user_agent", USER_AGENT) in DEFAULT_OPTIONS
    assert ("grpc.primary_user_agent", USER_AGENT) in PEER_CHANNEL_OPTIONS
    assert f"kvd-client/{kvd_client.__version__}" == USER_AGENT
    # a caller's own option still wins (the daemon's tests pose as old clients this way)
    assert ("grpc.primary_user_agent", "kvd-client/0.0.1") in channel_options(
        extra=[("grpc.primary_user_agent", "kvd-client/0.0.1")]
    )


class _RecordAgents(grpc.aio.ServerInterceptor):
    def __init__(self) -> None:
        self.agents: list[str] = []

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]], details: grpc.HandlerCallDetails
    ) -> Any:
        self.agents += [str(v) for k, v in details.invocation_metadata or () if k == "user-agent"]
        return await continuation(details)


def test_sync_and_asyncio_clients_send_their_version_in_every_call() -> None:
    async def main() -> list[str]:
        recorder = _RecordAgents()
        server = grpc.aio.server(interceptors=[recorder])
        health_pb2_grpc.add_HealthServicer_to_server(HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with AsyncKvdClient(f"127.0.0.1:{port}", timeout_s=5) as client:
                assert await client.health_check()

            def sync_call() -> None:
                with KvdClient(f"127.0.0.1:{port}", timeout_s=5) as client:
                    assert client.health_check()

            await asyncio.to_thread(sync_call)
        finally:
            await server.stop(None)
        return recorder.agents

    agents = asyncio.run(main())
    assert len(agents) == 2
    assert all(agent.startswith(f"kvd-client/{kvd_client.__version__} ") for agent in agents), agents
