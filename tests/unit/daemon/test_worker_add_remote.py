"""Loading a peer agent's metadata: a peer that went away meanwhile is unavailable, not invalid.

The fleet's rolling restart found it: a reader loading a restarting holder's metadata got NIXL's
``NIXL_ERR_REMOTE_DISCONNECT`` and the pull failed ``InvalidArgument`` (a caller's bad input, not
retried) instead of ``PeerUnavailable`` (the peer is gone: retry, re-handshake). Metadata NIXL
rejects for what it is stays ``InvalidArgument``.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvd.worker.nixl_agent import NixlAgent
from kvd_client.errors import InvalidArgument, PeerUnavailable

WAIT_S = 10.0


class RefusingAgent:
    """A NIXL agent whose add_remote_agent raises NIXL's error text."""

    def __init__(self, message: str) -> None:
        self.message = message

    def add_remote_agent(self, _metadata: bytes) -> str:
        raise RuntimeError(self.message)

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        return {}


async def _add_remote(message: str) -> None:
    agent = NixlAgent("test-add-remote")
    agent.agent = RefusingAgent(message)
    thread = threading.Thread(target=agent._owner.run, name="kvd-nixl-test", daemon=True)
    agent._owner.thread = thread
    thread.start()
    try:
        await agent.add_remote(b"metadata")
    finally:
        agent._owner.stopping = True
        agent._owner.wake()
        thread.join(WAIT_S)


def test_a_peer_gone_while_its_metadata_loads_is_peer_unavailable() -> None:
    with pytest.raises(PeerUnavailable, match="NIXL_ERR_REMOTE_DISCONNECT"):
        asyncio.run(_add_remote("loadRemoteMD: NIXL_ERR_REMOTE_DISCONNECT"))


def test_a_peer_whose_worker_ucx_cannot_reach_is_peer_unavailable() -> None:
    """NIXL_ERR_BACKEND: UCX could not connect to the peer's worker (the fleet saw it right after a
    fault replaced that worker); the peer's state, retried, never the caller's bad argument."""
    with pytest.raises(PeerUnavailable, match="unreachable"):
        asyncio.run(_add_remote("loadRemoteMD: error loading connection info: NIXL_ERR_BACKEND"))


def test_metadata_nixl_rejects_is_invalid_argument() -> None:
    with pytest.raises(InvalidArgument, match="rejected by NIXL"):
        asyncio.run(_add_remote("loadRemoteMD: NIXL_ERR_INVALID_PARAM"))
