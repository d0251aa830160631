"""Every way `kvd serve` can fail to start: one line naming the cause and the fix, exit 2 for a
config problem and 1 for a runtime one, no traceback, and nothing left behind."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

pytestmark = pytest.mark.integration

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the daemon as another uid")
# setpriv is util-linux, on every Debian/Ubuntu; as root it must be there


def _serve(
    *flags: str, env: dict[str, str] | None = None, user: list[str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`kvd serve` with ``flags``; ``user`` is a command prefix that runs it as another uid."""
    return subprocess.run(
        [*(user or []), sys.executable, "-m", "kvd.cli.main", "serve", *flags],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, **(env or {})}, cwd="/",
    )  # fmt: skip


def _one_line_failure(result: subprocess.CompletedProcess[str], code: int, *words: str) -> str:
    """The failure's single `kvd serve:` line, checked for exit code, words, and no traceback."""
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("kvd serve:")]
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert "; " in line, line  # cause; fix
    for word in words:
        assert word in line, line
    return line


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another program listens on."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock.getsockname()[1]
    sock.close()


def test_tcp_port_held_by_another_program(tmp_path: Path, taken_port: int) -> None:
    sock_dir = tmp_path / "run"
    result = _serve("--unix-socket", str(sock_dir / "engine.sock"), "--port", str(taken_port), "--metrics-port", "-1")
    _one_line_failure(result, 1, f"127.0.0.1:{taken_port}", "already in use", "--port")
    assert not sock_dir.exists()  # nothing created, nothing left


def test_a_second_daemon_on_the_same_port_fails_and_the_first_keeps_serving(spawn_daemon, tmp_path: Path) -> None:
    """No SO_REUSEPORT: the second daemon does not silently share the first one's port."""
    first = spawn_daemon(name="first")
    port = first.tcp.rsplit(":", 1)[1]
    result = _serve("--unix-socket", str(tmp_path / "second" / "engine.sock"), "--port", port, "--metrics-port", "-1")
    _one_line_failure(result, 1, "already in use", "another kvd")
    with grpc.insecure_channel(first.tcp) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert not (tmp_path / "second").exists()


def test_metrics_port_taken(tmp_path: Path, taken_port: int) -> None:
    sock_dir = tmp_path / "run"
    result = _serve("--unix-socket", str(sock_dir / "engine.sock"), "--port", "0", "--metrics-port", str(taken_port))
    _one_line_failure(result, 1, "metrics port", "--metrics-port")
    assert not sock_dir.exists()


def test_health_port_taken(tmp_path: Path, taken_port: int) -> None:
    result = _serve(
        "--unix-socket", str(tmp_path / "run" / "engine.sock"), "--port", "0", "--metrics-port", "-1",
        "--health-port", str(taken_port),
    )  # fmt: skip
    _one_line_failure(result, 1, "health port", "--health-port")


def test_host_that_is_not_this_machine_is_a_config_error(tmp_path: Path) -> None:
    result = _serve(
        "--unix-socket", str(tmp_path / "s.sock"), "--host", "192.0.2.1", "--port", "0", "--metrics-port", "-1"
    )
    _one_line_failure(result, 2, "192.0.2.1", "--host")


def test_socket_path_under_a_file_is_refused(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = _serve("--unix-socket", str(blocker / "run" / "engine.sock"), "--port", "0", "--metrics-port", "-1")
    _one_line_failure(result, 1, str(blocker), "--unix-socket")
    assert blocker.is_file()


def test_socket_path_that_is_a_regular_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "engine.sock"
    path.write_text("not a socket")
    result = _serve("--unix-socket", str(path), "--port", "0", "--metrics-port", "-1")
    _one_line_failure(result, 2, "is not a socket")
    assert path.read_text() == "not a socket"


def test_a_live_daemons_socket_is_not_stolen(spawn_daemon) -> None:
    first = spawn_daemon(name="first")
    result = _serve("--unix-socket", first.unix_socket, "--port", "0", "--metrics-port", "-1")
    _one_line_failure(result, 1, "another daemon is serving", "--unix-socket")
    assert Path(first.unix_socket).exists()


def test_missing_tls_file_is_a_config_error(tmp_path: Path) -> None:
    result = _serve(
        "--unix-socket", str(tmp_path / "run" / "engine.sock"), "--port", "0", "--metrics-port", "-1",
        "--tls-cert", str(tmp_path / "nope.crt"), "--tls-key", str(tmp_path / "nope.key"),
    )  # fmt: skip
    _one_line_failure(result, 2, "tls_cert", "nope.crt")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--port", "99999"], ["port 99999 is not in 0..65535"]),
        (["--engine-group", "no-such-group-kvd"], ["engine_group", "no-such-group-kvd", "groupadd"]),
        (["--port", "50155", "--metrics-port", "50155"], ["each listener needs its own port"]),
        (["--lease-ttl-s", "abc"], ["lease_ttl_s", "abc"]),
    ],
)
def test_bad_config_exits_2(tmp_path: Path, flags: list[str], words: list[str]) -> None:
    result = _serve("--unix-socket", str(tmp_path / "run" / "engine.sock"), *flags)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("kvd serve:")]
    assert len(lines) == 1 and all(w in lines[0] for w in words), result.stderr
    assert not (tmp_path / "run").exists()


def test_unknown_kvd_variables_are_warned_about(spawn_daemon) -> None:
    daemon = spawn_daemon(env={**os.environ, "KVD_PROT": "1234", "KVD_SETUP_VLLM": "0"})
    log = daemon.log_path.read_text()
    assert "KVD_PROT is not a kvd setting" in log and "did you mean KVD_PORT?" in log
    assert "KVD_SETUP_VLLM" not in log  # scripts/setup.sh's own variable is not a typo


def test_print_config_names_each_source_and_reads_back(tmp_path: Path) -> None:
    config = tmp_path / "kvd.toml"
    config.write_text("[kvd]\nport = 50160\nlease_ttl_s = 12.0\n")
    result = _serve(
        "--config", str(config), "--lease-ttl-s", "7", "--print-config",
        env={"KVD_METRICS_PORT": "9999", "KVD_MEATRICS_HOST": "x", "NOTIFY_SOCKET": "/run/systemd/notify"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = {line.split(" = ")[0]: line for line in result.stdout.splitlines() if " = " in line}
    assert lines["port"].endswith(f"# file {config}")
    assert lines["lease_ttl_s"].startswith("lease_ttl_s = 7.0") and lines["lease_ttl_s"].endswith(
        "# flag --lease-ttl-s"
    )
    assert lines["metrics_port"].endswith("# env KVD_METRICS_PORT")
    assert lines["notify_socket"].endswith("# systemd NOTIFY_SOCKET")
    assert lines["host"].endswith("# default")
    assert "KVD_MEATRICS_HOST is not a kvd setting" in result.stderr and "KVD_METRICS_HOST" in result.stderr
    from kvd.config import load_config

    printed = tmp_path / "printed.toml"
    printed.write_text(result.stdout)
    again = load_config(printed, env={})
    assert (again.port, again.lease_ttl_s, again.metrics_port) == (50160, 7.0, 9999)


# --- as another uid: permissions ------------------------------------------------------------------


def as_user(uid: int, gid: int, groups: list[int]) -> list[str]:
    """A command prefix (util-linux setpriv) that runs the rest as ``uid``/``gid`` with ``groups``."""
    group_flag = f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups"
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", group_flag]


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A world-traversable directory (pytest's tmp_path is root-only)."""
    path = Path(tempfile.mkdtemp(prefix="kvd-startup-"))
    path.chmod(0o755)
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=False)


@as_root
def test_unwritable_socket_directory(shared_tmp: Path) -> None:
    """A daemon user that may not create its socket directory is told so, not shown a traceback."""
    result = _serve(
        "--unix-socket", str(shared_tmp / "run" / "engine.sock"), "--port", "0", "--metrics-port", "-1",
        user=as_user(NOBODY, NOBODY, []),
    )  # fmt: skip
    _one_line_failure(result, 1, "Permission denied", "RuntimeDirectory", "--unix-socket")
    assert not (shared_tmp / "run").exists()


@as_root
def test_a_failure_after_the_socket_exists_removes_it(shared_tmp: Path) -> None:
    """The daemon's user is not in engine_group: discovered only once the socket is bound, and
    the socket, the servers and the NIXL agent are all undone before the one-line exit."""
    run = shared_tmp / "run"
    run.mkdir(mode=0o700)
    os.chown(run, NOBODY, NOBODY)  # the daemon's own directory: nobody else may write it
    result = _serve(
        "--unix-socket", str(run / "engine.sock"), "--port", "0", "--metrics-port", "0",
        "--engine-group", "54321", user=as_user(NOBODY, NOBODY, []),
        env={"HOME": str(shared_tmp)},  # NIXL reads $HOME/.nixl.cfg
    )  # fmt: skip
    _one_line_failure(result, 1, "group 54321", "not a member", "SupplementaryGroups")
    assert list(run.iterdir()) == []


def test_plaintext_tcp_off_loopback_is_refused(tmp_path: Path) -> None:
    """Whoever reaches a plaintext port could ask for NIXL metadata: off loopback, mTLS or an explicit opt-in."""
    result = _serve(
        "--unix-socket", str(tmp_path / "run" / "engine.sock"), "--host", "0.0.0.0", "--port", "0",
        "--metrics-port", "-1",
    )  # fmt: skip
    _one_line_failure(result, 2, "0.0.0.0", "not a loopback address", "tls_cert", "allow_insecure_tcp")
    assert not (tmp_path / "run").exists()  # refused before anything was created


def test_socket_directory_others_may_write_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    result = _serve("--unix-socket", str(shared / "engine.sock"), "--port", "0", "--metrics-port", "-1")
    _one_line_failure(result, 2, str(shared), "others may write it", "chmod go-w")
    assert not (shared / "engine.sock").exists()
