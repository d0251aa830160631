"""The operator commands, run as an operator would: `kvd selftest`, `kvd demo`, `kvd status`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def _kvd(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvd.cli.main", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def test_selftest_moves_and_verifies_a_pattern_between_two_daemons() -> None:
    result = _kvd("selftest", "--size-mb", "16", "--iterations", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all bytes match" in result.stdout
    assert "ratio kvd/raw" in result.stdout and result.stdout.rstrip().endswith("PASS")


def test_selftest_against_a_running_peer(spawn_daemon) -> None:
    local, peer = spawn_daemon(name="local"), spawn_daemon(name="peer")
    result = _kvd("selftest", "--target", local.unix_target, "--peer", peer.tcp, "--size-mb", "8", "--iterations", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "started" not in result.stdout  # it used the daemons it was given


def test_selftest_fails_non_zero_when_the_peer_is_unreachable(spawn_daemon) -> None:
    local = spawn_daemon(name="local")
    result = _kvd(
        "selftest", "--target", local.unix_target, "--peer", "127.0.0.1:1", "--size-mb", "8", "--iterations", "1"
    )
    assert result.returncode != 0
    assert "FAIL" in result.stdout and "127.0.0.1:1" in result.stdout


def test_demo_runs_the_whole_flow() -> None:
    result = _kvd("demo")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "matched the model bit for bit" in result.stdout
    assert "rejected drafts never written" in result.stdout
    assert 'kvd_transfer_bytes_total{direction="pull"' in result.stdout


def test_status_prints_the_daemon_as_json(spawn_daemon) -> None:
    daemon = spawn_daemon()
    result = _kvd("status", "--target", daemon.tcp, timeout=30)
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert status["incarnation"] == daemon.incarnation and status["serving"] is True


def test_status_of_nothing_is_a_clear_error() -> None:
    result = _kvd("status", "--target", "127.0.0.1:1", "--timeout", "2", timeout=30)
    assert result.returncode == 1
    assert "127.0.0.1:1" in result.stderr and "Unavailable" in result.stderr


def test_serve_refuses_a_bad_config_with_exit_2(tmp_path) -> None:
    result = _kvd("serve", "--port", "99999", "--unix-socket", str(tmp_path / "s.sock"), timeout=30)
    assert result.returncode == 2
    assert "port 99999 is not in 0..65535" in result.stderr
