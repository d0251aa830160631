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


def test_the_client_distribution_ships_every_client_package() -> None:
    project = tomllib.loads((CLIENT / "pyproject.toml").read_text())
    packages = set(project["tool"]["setuptools"]["packages"])
    on_disk = {
        ".".join(["kvd_client", *init.parent.relative_to(CLIENT).parts])
        for init in CLIENT.rglob("__init__.py")
        if "build" not in init.parts
    }
    assert packages == on_disk
    root = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert on_disk <= set(root["tool"]["setuptools"]["packages"]), "the root install must ship the client too"


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
