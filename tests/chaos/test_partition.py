"""Chaos: the link between two daemons is cut mid-read (two network namespaces, a veth pair,
UCX over TCP). The pull must fail within its deadline, and when the link comes back, not one
byte of the failed pull may land in the blocks the engine has meanwhile recomputed.

Needs root and iproute2 (CI runs as root); skipped with the reason otherwise.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
import torch
from kvtest import ShmEngine, llama_spec, metric_value

from kvd_client import errors
from kvd_client.v1 import common_pb2

pytestmark = [pytest.mark.chaos, pytest.mark.integration]

# Addresses only ever configured inside the two namespaces this test makes (and removes).
HOLDER_ADDR, READER_ADDR = "10.251.7.1", "10.251.7.2"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextlib.contextmanager
def two_hosts() -> Iterator[tuple[str, str, str, str]]:
    """Two network namespaces joined by a veth pair: (holder ns, reader ns, holder dev, reader dev)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to make network namespaces")
    tag = uuid.uuid4().hex[:6]
    ns_h, ns_r, dev_h, dev_r = f"kvdh{tag}", f"kvdr{tag}", f"vh{tag}", f"vr{tag}"
    try:
        _ip("netns", "add", ns_h)
        _ip("netns", "add", ns_r)
        _ip("link", "add", dev_h, "type", "veth", "peer", "name", dev_r)
        _ip("link", "set", dev_h, "netns", ns_h)
        _ip("link", "set", dev_r, "netns", ns_r)
        for ns, dev, addr in ((ns_h, dev_h, HOLDER_ADDR), (ns_r, dev_r, READER_ADDR)):
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield ns_h, ns_r, dev_h, dev_r
    finally:
        for ns in (ns_h, ns_r):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _ucx_env(device: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(UCX_TLS="tcp", UCX_NET_DEVICES=device)
    return env


def test_link_cut_mid_read_fails_in_time_and_no_late_byte_lands(spawn_daemon) -> None:
    with two_hosts() as (ns_h, ns_r, dev_h, dev_r):
        holder_daemon = spawn_daemon(
            "--host",
            HOLDER_ADDR,
            "--allow-insecure-tcp=true",
            name="holder",
            env=_ucx_env(dev_h),
            command_prefix=("ip", "netns", "exec", ns_h),
        )
        reader_daemon = spawn_daemon(
            "--host",
            READER_ADDR,
            "--allow-insecure-tcp=true",
            name="reader",
            env=_ucx_env(dev_r),
            command_prefix=("ip", "netns", "exec", ns_r),
        )
        spec = llama_spec(num_blocks=256)  # 512 MiB: long enough over TCP to cut the link mid-read
        holder = ShmEngine(holder_daemon.unix_target, "p", spec)
        reader = ShmEngine(reader_daemon.unix_target, "d", spec)
        try:
            holder.register()
            reader.register()
            pattern = (torch.arange(1 << 20, dtype=torch.int32).remainder_(251) + 1).to(torch.uint8)
            holder.buffer.view(-1, 1 << 20).copy_(pattern)  # never 0: a landed byte is visible
            reader.fill(0)
            blocks = list(range(256))
            params = holder.client.hold_blocks(
                engine_id="p", request_id="cut", block_ids=blocks, num_tokens=256 * 16
            ).kv_transfer_params
            deadline_s = 3.0
            started = reader.client.start_pull(
                engine_id="d",
                tp_rank=0,
                request_id="cut",
                local_block_ids=blocks,
                remote=params,
                deadline_ms=int(deadline_s * 1000),
            )
            t0 = time.monotonic()
            _wait_until_bytes_arrive(reader)
            _ip("-n", ns_r, "link", "set", dev_r, "down")
            with pytest.raises((errors.DeadlineExceeded, errors.Unavailable)):
                reader.client.wait_transfer(started.transfer_id, timeout_s=30)
            assert time.monotonic() - t0 < deadline_s + 1.5, "the failure was not reported within the deadline"
            arrived = int(torch.count_nonzero(reader.buffer))
            assert 0 < arrived < reader.buffer.numel(), "the cut did not happen mid-read"

            # The engine recomputes into its blocks; then the link comes back and the stalled READ
            # resumes. Wait until the reader daemon saw it finish (no NIXL read in flight), or 20 s.
            reader.fill(0xEE)
            _ip("-n", ns_r, "link", "set", dev_r, "up")
            until = time.monotonic() + 20.0
            while time.monotonic() < until:
                if not bool((reader.buffer[:: 1 << 12] == 0xEE).all()):
                    break
                if metric_value(_scrape_in(ns_r, reader_daemon.metrics), "kvd_nixl_reads_in_flight") == 0:
                    break
                time.sleep(0.2)
            landed = int(reader.buffer.numel() - torch.count_nonzero(reader.buffer == 0xEE))
            assert landed == 0, f"{landed} bytes of the failed pull landed after it was reported failed"
            text = _scrape_in(ns_r, reader_daemon.metrics)
            assert metric_value(text, "kvd_nixl_reads_in_flight") == 0, "the resumed READ never finished"
            assert metric_value(text, "kvd_quarantined_bytes") == 0, "the retired mapping was not freed"
            fenced = metric_value(text, "kvd_pull_fences_total", outcome="remapped") + metric_value(
                text, "kvd_pull_fences_total", outcome="final"
            )
            assert fenced >= 1, "the failed pull was not fenced"

            # The next pull over the restored link works, byte-exact, into the re-mapped memory.
            # Beside a CPU load, UCX over TCP may keep the reader's NIXL thread inside one NIXL call
            # (get_new_notifs, its stack in the log) past the heartbeat once the link heals: the
            # daemon then replaces its worker, and a pull meanwhile is refused UNAVAILABLE with
            # "retry", as the client is told. A router retries that; so does this test, for 30 s.
            retry_until = time.monotonic() + 30.0
            attempt = 0
            while True:
                attempt += 1
                again = holder.client.hold_blocks(
                    engine_id="p", request_id=f"again{attempt}", block_ids=[0, 1], num_tokens=32
                )
                try:
                    pulled = reader.client.start_pull(
                        engine_id="d",
                        tp_rank=0,
                        request_id=f"again{attempt}",
                        local_block_ids=[5, 6],
                        remote=again.kv_transfer_params,
                        deadline_ms=20000,
                    )
                    done = reader.client.wait_transfer(pulled.transfer_id, timeout_s=30)
                    break
                except errors.Unavailable as exc:
                    if "restarting" not in str(exc) or time.monotonic() > retry_until:
                        raise
                    time.sleep(0.5)
            assert done.state == common_pb2.TRANSFER_STATE_DONE
            same = reader.token_bytes([5, 6], 32).equal(holder.token_bytes([0, 1], 32))
            assert same, "the pull after the partition moved wrong bytes"
            assert holder_daemon.process.poll() is None and reader_daemon.process.poll() is None
        finally:
            for engine in (holder, reader):
                engine.close()


def test_a_read_the_holder_timed_out_while_cut_off_is_proven_over_when_the_link_heals(spawn_daemon) -> None:
    """Issue 42's leak, between two real daemons. The link is cut mid-read: the reader fails by its
    deadline, the holder times the admitted read out (past its deadline + margin, not proven over)
    and its engine goes: the mapping is retired and quarantined. When the link heals, the stalled
    READ ends and the reader says so (its notification, or its AbandonPull once the READ is final):
    the holder's quarantine empties, instead of keeping the mapping for the daemon's life."""
    with two_hosts() as (ns_h, ns_r, dev_h, dev_r):
        holder_daemon = spawn_daemon(
            "--host",
            HOLDER_ADDR,
            "--allow-insecure-tcp=true",
            "--read-admission-margin-s",
            "0.5",
            name="holder",
            env=_ucx_env(dev_h),
            command_prefix=("ip", "netns", "exec", ns_h),
        )
        reader_daemon = spawn_daemon(
            "--host",
            READER_ADDR,
            "--allow-insecure-tcp=true",
            name="reader",
            env=_ucx_env(dev_r),
            command_prefix=("ip", "netns", "exec", ns_r),
        )
        spec = llama_spec(num_blocks=256)  # 512 MiB: long enough over TCP to cut the link mid-read
        holder = ShmEngine(holder_daemon.unix_target, "p", spec)
        reader = ShmEngine(reader_daemon.unix_target, "d", spec)
        try:
            holder.register()
            reader.register()
            holder.fill(0x5A)
            reader.fill(0)
            blocks = list(range(256))
            params = holder.client.hold_blocks(
                engine_id="p", request_id="cut", block_ids=blocks, num_tokens=256 * 16
            ).kv_transfer_params
            started = reader.client.start_pull(
                engine_id="d", tp_rank=0, request_id="cut", local_block_ids=blocks, remote=params, deadline_ms=3000
            )
            _wait_until_bytes_arrive(reader)
            _ip("-n", ns_r, "link", "set", dev_r, "down")
            with pytest.raises((errors.DeadlineExceeded, errors.Unavailable)):
                reader.client.wait_transfer(started.transfer_id, timeout_s=30)
            assert int(torch.count_nonzero(reader.buffer)) < reader.buffer.numel(), "the cut came after the read"

            assert _until(lambda: _holder_metric(ns_h, holder_daemon.metrics, "timed_out") == 1), (
                "the holder never timed the cut-off read out"
            )
            holder.client.unregister_kv_cache(engine_id="p", tp_rank=0)  # the engine goes (it is killed)
            holder.registered = False
            assert _holder_metric(ns_h, holder_daemon.metrics, "quarantined") == spec.total_bytes

            _ip("-n", ns_r, "link", "set", dev_r, "up")
            assert _until(lambda: _holder_metric(ns_h, holder_daemon.metrics, "quarantined") == 0), (
                "the holder kept the retired mapping after the read was over"
            )
            text = _scrape_in(ns_r, reader_daemon.metrics)
            assert (
                metric_value(text, "kvd_nixl_reads_in_flight") == 0 and metric_value(text, "kvd_quarantined_bytes") == 0
            )
            assert holder_daemon.process.poll() is None and reader_daemon.process.poll() is None
        finally:
            for engine in (holder, reader):
                engine.close()


def _holder_metric(namespace: str, address: str, which: str) -> float:
    text = _scrape_in(namespace, address)
    if which == "timed_out":
        return metric_value(text, "kvd_admissions_ended_total", reason="timed_out")
    return metric_value(text, "kvd_quarantined_bytes")


def _until(condition: Callable[[], bool], hang_guard_s: float = 30.0) -> bool:
    """Poll ``condition`` until it holds; False only if it never did (a hang guard, not a timing)."""
    deadline = time.monotonic() + hang_guard_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _wait_until_bytes_arrive(reader: ShmEngine, timeout_s: float = 10.0) -> None:
    """Return once some, not all, of the pull's bytes are in the reader's blocks."""
    deadline = time.monotonic() + timeout_s
    step = reader.buffer.numel() // 64
    while time.monotonic() < deadline:
        if bool((reader.buffer[::step] != 0).any()):
            return
        time.sleep(0.002)
    raise AssertionError("no byte of the pull arrived")


def _scrape_in(namespace: str, address: str) -> str:
    """/metrics of a daemon whose metrics port is on its namespace's loopback."""
    code = f"from kvd.core import metrics_text; print(metrics_text.fetch({address!r}))"
    run = subprocess.run(
        ["ip", "netns", "exec", namespace, sys.executable, "-c", code], check=True, capture_output=True
    )
    return run.stdout.decode()
