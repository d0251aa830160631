"""``pip install ./client`` gives a working client that needs grpcio and protobuf only."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
CLIENT = REPO / "client"


def test_the_client_distribution_depends_on_grpcio_and_protobuf_only() -> None:
    project = tomllib.loads((CLIENT / "pyproject.toml").read_text())
    names = {dep.split(">")[0].split("=")[0].split("<")[0].strip() for dep in project["project"]["dependencies"]}
    assert names == {"grpcio", "protobuf"}


def test_the_client_packages_are_discovered_not_listed() -> None:
    """Both distributions find their packages (setup.py beside each pyproject.toml): a new client
    subpackage ships without anyone listing it. tests/integration/test_packaging.py builds the
    wheels and checks that every importable file of client/ is in both."""
    for pyproject in (CLIENT / "pyproject.toml", REPO / "pyproject.toml"):
        assert "packages" not in tomllib.loads(pyproject.read_text())["tool"].get("setuptools", {}), pyproject
    assert "find_packages" in (CLIENT / "setup.py").read_text()
    assert '"kvd_client": "client"' in (REPO / "setup.py").read_text()


def test_every_client_module_works_without_the_daemon_or_its_dependencies() -> None:
    """With kvd, kvd_engine, numpy, torch, grpc_health... unimportable, the whole client imports
    and its sync and asyncio clients run a call (a health check of nothing: False)."""
    code = textwrap.dedent(
        """
        import asyncio, importlib, importlib.abc, pkgutil, sys

        FORBIDDEN = {"kvd", "kvd_engine", "numpy", "torch", "nixl", "grpc_health", "grpc_reflection",
                     "prometheus_client", "vllm"}

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in FORBIDDEN:
                    raise ImportError(f"{name} is not part of the client distribution")
                return None

        sys.meta_path.insert(0, Block())
        import kvd_client
        for info in pkgutil.walk_packages(kvd_client.__path__, "kvd_client."):
            importlib.import_module(info.name)
        from kvd_client import AsyncKvdClient, KvdClient, pb

        with KvdClient("127.0.0.1:1", timeout_s=1) as client:
            assert client.health_check() is False

        async def main():
            async with AsyncKvdClient("127.0.0.1:1", timeout_s=1) as client:
                assert await client.health_check() is False

        asyncio.run(main())
        assert pb.router_pb2.StartPullRequest(request_id="r").request_id == "r"
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
