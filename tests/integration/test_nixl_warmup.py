"""The data-plane worker's transport warm-up (kvd.worker.nixl_setup.warm_transport).

A new agent pays UCX's one-time connection costs at worker start, against two throwaway agents,
instead of on the first pull to a new peer (figures in docs/performance.md). What must hold: the
warmed agent then reads and is read from normally, no warm-up notification or registration is
left behind, and a warm-up that fails or never finishes is never fatal and never releases memory
a READ may still land in. The real-NIXL part runs in a child process: NIXL agents left in the
test process have crashed later tests.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from typing import Any

import pytest

from kvd.worker import nixl_setup

_SCRIPT = r"""
import time
import torch
from nixl import _api as api
from kvd.worker.nixl_setup import warm_transport

config = api.nixl_agent_config(
    enable_prog_thread=False, backends=["UCX"], sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
)
main = api.nixl_agent("main", config)
assert warm_transport(api, main, ["UCX"]) is None
assert main.get_new_notifs() == {}, "a warm-up notification was left for the worker to forward"
peer = api.nixl_agent("peer", api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def read(initiator, target, notif):
    source = torch.arange(1 << 16, dtype=torch.int32)
    destination = torch.zeros_like(source)
    registrations = (target.register_memory(source), initiator.register_memory(destination))
    name = initiator.add_remote_agent(target.get_agent_metadata())
    remote = initiator.prep_xfer_dlist(name, [(source.data_ptr(), source.nbytes, 0)], "DRAM")
    local = initiator.prep_xfer_dlist("NIXL_INIT_AGENT", [(destination.data_ptr(), source.nbytes, 0)], "DRAM")
    handle = initiator.make_prepped_xfer("READ", local, [0], remote, [0], notif)
    state, notifs, deadline = initiator.transfer(handle), {}, time.monotonic() + 10
    while (state == "PROC" or not notifs) and time.monotonic() < deadline:
        state = initiator.check_xfer_state(handle) if state == "PROC" else state
        for agent, messages in target.get_new_notifs().items():
            notifs.setdefault(agent, []).extend(messages)
    assert state == "DONE", state
    assert torch.equal(source, destination)
    initiator.release_xfer_handle(handle)
    initiator.release_dlist_handle(local)
    initiator.release_dlist_handle(remote)
    initiator.remove_remote_agent(name)
    initiator.deregister_memory(registrations[1])
    target.deregister_memory(registrations[0])
    return {agent: [bytes(m) for m in messages] for agent, messages in notifs.items()}


print("read in", read(peer, main, b"in"))
print("read out", read(main, peer, b"out"))
"""


@pytest.mark.integration
@pytest.mark.parametrize("ucx_tls", ["", "tcp"], ids=["default-transports", "ucx-tcp"])
def test_a_warmed_agent_reads_and_is_read_with_only_real_notifications(ucx_tls: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "UCX_TLS"} | ({"UCX_TLS": ucx_tls} if ucx_tls else {})
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("read")]
    assert lines == ["read in {'peer': [b'in']}", "read out {'main': [b'out']}"], done.stdout


class _Api:
    """A NIXL module whose agents refuse to be created."""

    def nixl_agent_config(self, **_: Any) -> None:
        return None

    def nixl_agent(self, *_: Any) -> Any:
        raise RuntimeError("no UCX here")


def test_a_failed_warm_up_is_not_fatal(caplog: pytest.LogCaptureFixture) -> None:
    assert nixl_setup.warm_transport(_Api(), _FakeAgent("main"), ["UCX"]) is None
    assert "warm-up failed" in caplog.text


class _FakeAgent:
    """Records what was set up and undone; its READs never finish (``stuck``) or finish at once."""

    def __init__(self, name: str, stuck: bool = False) -> None:
        self.name = name
        self.stuck = stuck
        self.calls: list[str] = []

    def register_memory(self, *_: Any) -> str:
        self.calls.append("register")
        return "registration"

    def deregister_memory(self, _: Any) -> None:
        self.calls.append("deregister")

    def get_agent_metadata(self) -> bytes:
        return self.name.encode()

    def add_remote_agent(self, metadata: bytes) -> bytes:
        return metadata

    def remove_remote_agent(self, _: str) -> None:
        self.calls.append("remove")

    def prep_xfer_dlist(self, *_: Any) -> str:
        return "list"

    def release_dlist_handle(self, _: Any) -> None:
        self.calls.append("release list")

    def make_prepped_xfer(self, *_: Any) -> str:
        return "handle"

    def transfer(self, _: Any) -> str:
        return "PROC"

    def check_xfer_state(self, _: Any) -> str:
        return "PROC" if self.stuck else "DONE"

    def release_xfer_handle(self, _: Any) -> None:
        self.calls.append("release handle")

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        return {"other": [b"kvd-warmup"]}


def test_a_finished_warm_read_undoes_everything() -> None:
    initiator, target = _FakeAgent("initiator"), _FakeAgent("target")
    assert nixl_setup._warm_read(initiator, target) is None
    assert initiator.calls == ["register", "release handle", "release list", "release list", "remove", "deregister"]
    assert target.calls == ["register", "deregister"]


def test_a_warm_read_that_never_finishes_keeps_its_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nixl_setup, "WARMUP_TIMEOUT_S", 0.05)
    initiator, target = _FakeAgent("initiator", stuck=True), _FakeAgent("target")
    leftover = nixl_setup._warm_read(initiator, target)
    assert leftover is not None  # buffers, handle and registrations stay alive
    assert initiator.calls == ["register"] and target.calls == ["register"]  # nothing released


def test_a_warm_read_whose_poll_fails_mid_way_keeps_its_memory_and_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class _PollFails(_FakeAgent):
        def check_xfer_state(self, _: Any) -> str:
            raise RuntimeError("check_xfer_state: backend error")

    initiator, target = _PollFails("initiator"), _FakeAgent("target")
    with caplog.at_level(logging.WARNING):
        leftover = nixl_setup._warm_read(initiator, target)
    assert leftover is not None, "the READ may still land: nothing of it is released"
    assert initiator.calls == ["register"] and target.calls == ["register"]
    assert "backend error" in caplog.text and "not final" in caplog.text
