"""engine_group: engines running as another uid in that group reach the socket; others do not."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as a second uid"),
]

NOBODY = 65534
ENGINES_GID = 54329  # a group nobody is in unless we say so; numeric, so no groupadd is needed

# What an engine does first: connect to the socket and ask the daemon for its health.
CLIENT = """
import socket, sys
probe = socket.socket(socket.AF_UNIX)
try:
    probe.connect(sys.argv[1])
except OSError as exc:
    print(f"connect: {exc.strerror}")
    sys.exit(0)
finally:
    probe.close()
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
with grpc.insecure_channel("unix://" + sys.argv[1]) as channel:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=20)
print("SERVING" if reply.status == health_pb2.HealthCheckResponse.SERVING else "NOT SERVING")
"""


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvd-group-"))
    path.chmod(0o755)  # pytest's tmp_path is root-only: a second uid could not even look
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=False)


def _as_engine(socket_path: str, groups: list[int]) -> str:
    group_flag = f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups"
    result = subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", group_flag, sys.executable, "-c", CLIENT, socket_path],
        capture_output=True, text=True, timeout=60, check=False, cwd="/",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_a_member_of_engine_group_connects_and_others_get_eacces(spawn_daemon, shared_tmp: Path) -> None:
    sock = shared_tmp / "run" / "engine.sock"
    spawn_daemon("--unix-socket", str(sock), "--engine-group", str(ENGINES_GID))

    directory = sock.parent.stat()
    assert stat.S_IMODE(directory.st_mode) == 0o750 and directory.st_gid == ENGINES_GID
    socket_info = sock.stat()
    assert stat.S_IMODE(socket_info.st_mode) == 0o660 and socket_info.st_gid == ENGINES_GID

    assert _as_engine(str(sock), [ENGINES_GID]) == "SERVING"
    assert _as_engine(str(sock), []) == "connect: Permission denied"


def test_without_engine_group_the_socket_is_owner_only(spawn_daemon, shared_tmp: Path) -> None:
    sock = shared_tmp / "run" / "engine.sock"
    spawn_daemon("--unix-socket", str(sock))
    assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600
    assert _as_engine(str(sock), [ENGINES_GID]) == "connect: Permission denied"
