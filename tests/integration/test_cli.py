"""The operator commands, run as an operator would: `kvd selftest`, `kvd demo`, `kvd status`."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time

import pytest

import kvd
from kvd.core import metrics_text
from kvd_client import AsyncKvdClient, KvdClient

pytestmark = pytest.mark.integration


def _kvd(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvd.cli.main", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def test_selftest_moves_and_verifies_a_pattern_between_two_daemons() -> None:
    result = _kvd("selftest", "--size-mb", "16", "--iterations", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all bytes match" in result.stdout
    for step in (
        "starting local and peer daemons",
        "warm-up pull",
        "kvd pull 2/2",
        "raw NIXL read 2/2",
        "selftest took",
    ):
        assert step in result.stdout  # progress, as it goes
    assert "ratio kvd/raw" in result.stdout and result.stdout.rstrip().endswith("PASS")


def test_selftest_against_a_running_peer(spawn_daemon) -> None:
    local, peer = spawn_daemon(name="local"), spawn_daemon(name="peer")
    result = _kvd("selftest", "--target", local.unix_target, "--peer", peer.tcp, "--size-mb", "8", "--iterations", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "started" not in result.stdout  # it used the daemons it was given


def test_selftest_refuses_a_size_out_of_range() -> None:
    result = _kvd("selftest", "--size-mb", "0", timeout=60)
    assert result.returncode == 2 and "--size-mb must be in 1..1024" in result.stderr
    assert "starting" not in result.stdout  # refused before any daemon started


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


def test_status_json_has_every_field_with_numbers_as_numbers(spawn_daemon) -> None:
    daemon = spawn_daemon()
    result = _kvd("status", "--target", daemon.tcp, "--json", timeout=30)
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert status["incarnation"] == daemon.incarnation and status["serving"] is True
    # zero-valued fields are present, not omitted
    assert status["transfers_in_flight"] == 0 and status["leases_held"] == 0 and status["leases_draining"] == 0
    assert status["engines"] == [] and status["peers"] == []
    assert status["metrics_address"] == daemon.metrics


def test_status_shows_engines_peers_and_traffic_after_a_pull(spawn_daemon) -> None:
    """After a real pull: the puller lists its peer (incarnation, last contact) and bytes pulled;
    the holder lists its engine with its layout and bytes served; --json gives byte counts as ints."""
    local, peer = spawn_daemon(name="local"), spawn_daemon(name="peer")
    moved = _kvd("selftest", "--target", local.unix_target, "--peer", peer.tcp, "--size-mb", "8", "--iterations", "1")
    assert moved.returncode == 0, moved.stdout + moved.stderr

    puller = _kvd("status", "--target", local.unix_target, timeout=30)
    assert puller.returncode == 0, puller.stderr
    text = puller.stdout
    assert f"kvd {local.incarnation[:8]}" in text and "serving" in text
    assert "peers: 1" in text and peer.tcp in text and peer.incarnation[:8] in text and "s ago" in text
    pulled = next(line for line in text.splitlines() if line.strip().startswith("pulled"))
    assert "16.0 MiB" in pulled and "2 done, 0 failed" in pulled  # warm-up + 1 timed pull, 8 MiB each
    assert "errors: none" in text

    holder = _kvd("status", "--target", peer.tcp, timeout=30)
    assert holder.returncode == 0, holder.stderr
    assert "engines: 1 rank, 8.0 MiB registered" in holder.stdout
    assert "32 layers, split K/V NHD, 4 blocks of 16, 8/8 heads x 128 bf16" in holder.stdout
    served = next(line for line in holder.stdout.splitlines() if line.strip().startswith("served"))
    assert "16.0 MiB" in served  # two reads of 8 MiB

    as_json = json.loads(_kvd("status", "--target", peer.tcp, "--json", timeout=30).stdout)
    assert as_json["engines"][0]["registered_bytes"] == 8 << 20  # a number, not a string
    assert as_json["engines"][0]["layout"]["dtype"] == "DTYPE_BFLOAT16"


def test_status_watch_refreshes_until_interrupted(spawn_daemon) -> None:
    daemon = spawn_daemon()
    process = subprocess.Popen(
        [sys.executable, "-m", "kvd.cli.main", "status", "--target", daemon.tcp, "--watch", "0.3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # Ctrl-C's default action, whatever this run inherited: a test run started in the
        # background by a shell without job control ignores SIGINT, and so would its children.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        time.sleep(4.0)
    finally:
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)
    assert process.returncode == 0, err
    assert out.count(f"kvd {daemon.incarnation[:8]}") >= 2  # refreshed at least once
    assert "rate over the last" in out  # rates between refreshes, not averages


def test_status_of_nothing_is_a_clear_error() -> None:
    result = _kvd("status", "--target", "127.0.0.1:1", "--timeout", "2", timeout=30)
    assert result.returncode == 1
    assert "127.0.0.1:1" in result.stderr and "Unavailable" in result.stderr


def test_serve_refuses_a_bad_config_with_exit_2(tmp_path) -> None:
    result = _kvd("serve", "--port", "99999", "--unix-socket", str(tmp_path / "s.sock"), timeout=30)
    assert result.returncode == 2
    assert "port 99999 is not in 0..65535" in result.stderr


def test_daemon_reports_its_version_and_logs_a_too_old_client_once(spawn_daemon) -> None:
    """GetStatus and `kvd status` name the release; a kvd-client older than the daemon supports
    (posed here with the user-agent such a client sends) is logged once, sync and asyncio alike."""
    daemon = spawn_daemon()
    with KvdClient(daemon.tcp, timeout_s=10) as current:
        assert current.get_status().version == kvd.__version__
    old_agent = [("grpc.primary_user_agent", "kvd-client/0.0.9")]
    with KvdClient(daemon.tcp, timeout_s=10, options=old_agent) as old:
        old.get_status()
        old.get_status()

    async def aio_calls() -> None:
        async with AsyncKvdClient(daemon.unix_target, timeout_s=10, options=old_agent) as old_aio:
            await old_aio.get_status()

    asyncio.run(aio_calls())
    log = daemon.log_path.read_text()
    assert log.count("a kvd-client 0.0.9 called") == 1, log
    assert f"this daemon (kvd {kvd.__version__}) supports kvd-client" in log
    assert f"kvd-client {kvd.__version__} called" not in log

    shown = _kvd("status", "--target", daemon.tcp, timeout=30)
    assert shown.returncode == 0 and f"version {kvd.__version__}" in shown.stdout.splitlines()[0]
    assert json.loads(_kvd("status", "--target", daemon.tcp, "--json", timeout=30).stdout)["version"] == kvd.__version__
    assert _kvd("--version", timeout=30).stdout.strip() == f"kvd {kvd.__version__}"
    scraped = metrics_text.samples(metrics_text.fetch(daemon.metrics, 10))
    assert ("kvd_build_info", {"version": kvd.__version__}, 1.0) in scraped
    assert ("kvd_serving", {}, 1.0) in scraped
