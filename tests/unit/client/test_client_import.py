"""kvd_client runs inside engines and routers: importing it must not drag in torch or nixl."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_import_leaves_torch_and_nixl_out() -> None:
    code = textwrap.dedent(
        """
        import sys
        import kvd_client
        import kvd_client.aio, kvd_client.sync, kvd_client.errors, kvd_client.pb
        from kvd_client import AsyncKvdClient, EngineStream, KvdClient, pb
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "nixl"))
        assert not heavy, heavy
        assert pb.common_pb2.TransferStatus and pb.router_pb2_grpc.RouterServiceStub
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_public_names_are_exported() -> None:
    import kvd_client

    for name in kvd_client.__all__:
        assert hasattr(kvd_client, name), name
    for name in (
        "KvdClient",
        "AsyncKvdClient",
        "EngineStream",
        "AsyncEngineStream",
        "errors",
        "pb",
        "KvdError",
        "UnknownLease",
        "from_status",
        "TlsConfig",
    ):
        assert name in kvd_client.__all__, name
    assert kvd_client.UnknownLease is kvd_client.errors.UnknownLease
