"""LoopbackTransport: calls to an address that answered the handshake with this daemon's own
incarnation go to its holder in the process; every other call goes to the peer transport."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest

from kvd.core.loopback import LoopbackTransport
from kvd.core.peers import HandshakeInfo, PrepareRequest, PrepareResult
from kvd_client.errors import DeadlineExceeded, UnknownLease

OWN = "inc-own"


def _info(incarnation: str) -> HandshakeInfo:
    return HandshakeInfo(incarnation, f"agent-{incarnation}", b"meta", (), frozenset())


class Inner:
    """The gRPC transport's stand-in: records what reaches the network."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.incarnations = {"self:1": OWN, "self:2": OWN, "peer:1": "inc-peer"}

    async def handshake(self, address: str, timeout_s: float) -> HandshakeInfo:
        self.calls.append(("handshake", address))
        return _info(self.incarnations[address])

    def ask_prepare_pull(self, address: str, request: PrepareRequest, timeout_s: float) -> None:
        return None

    def flush(self) -> None:
        pass

    async def prepare_pull(self, address: str, request: PrepareRequest, timeout_s: float) -> PrepareResult:
        self.calls.append(("prepare_pull", address))
        return PrepareResult((9,), "peer-tag")

    async def abandon_pull(self, address: str, *args: Any) -> None:
        self.calls.append(("abandon_pull", address))

    async def finish_read(self, address: str, *args: Any) -> None:
        self.calls.append(("finish_read", address))

    async def renew_leases(self, address: str, lease_ids: list[str], timeout_s: float) -> list[str]:
        self.calls.append(("renew_leases", address))
        return []

    async def release_leases(self, address: str, lease_ids: list[str], reason: str, timeout_s: float) -> None:
        self.calls.append(("release_leases", address))

    async def forget(self, address: str) -> None:
        self.calls.append(("forget", address))

    async def close(self) -> None:
        self.calls.append(("close", ""))


class Holder:
    """The daemon's holder methods' stand-in: records the reader identity each call carries."""

    incarnation = OWN

    def __init__(self, prepare_s: float = 0.0) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.prepare_s = prepare_s

    async def prepare_pull(self, request: PrepareRequest, **kw: Any) -> PrepareResult:
        self.calls.append(("prepare_pull", {**dataclasses.asdict(request), **kw}))
        await asyncio.sleep(self.prepare_s)
        return PrepareResult((1,), "own-tag", verify_after_read=True)

    def abandon_pull(self, lease_id: str, reader_tp_rank: int, reason: str, **kw: Any) -> None:
        self.calls.append(("abandon_pull", {"lease_id": lease_id, **kw}))
        raise UnknownLease(f"lease {lease_id!r} has no read admitted")

    async def finish_read(self, lease_id: str, reader_tp_rank: int, **kw: Any) -> None:
        self.calls.append(("finish_read", {"lease_id": lease_id, **kw}))

    def renew_leases(self, lease_ids: Sequence[str]) -> list[str]:
        self.calls.append(("renew_leases", {"lease_ids": list(lease_ids)}))
        return ["gone"]

    def release_leases(self, lease_ids: Sequence[str], reason: str) -> int:
        self.calls.append(("release_leases", {"lease_ids": list(lease_ids), "reason": reason}))
        return 1


PREPARE = PrepareRequest(
    lease_id="L",
    engine_id="p",
    block_ids=(1, 2),
    num_tokens=20,
    reader_tp_rank=0,
    reader_tp_size=1,
    remote_tp_ranks=(0,),
    reader_transfer_id="T",
    read_timeout_s=5.0,
)


def test_calls_to_this_daemon_stay_in_the_process_with_its_reader_identity() -> None:
    async def main() -> None:
        inner, holder = Inner(), Holder()
        transport = LoopbackTransport(inner, holder)  # type: ignore[arg-type]
        assert (await transport.handshake("self:1", 1.0)).incarnation == OWN
        assert transport.is_self("self:1") and not transport.is_self("self:2")
        assert ("forget", "self:1") in inner.calls  # the channel the handshake opened is closed
        inner.calls.clear()
        result = await transport.prepare_pull("self:1", PREPARE, 1.0)
        assert result == PrepareResult((1,), "own-tag", verify_after_read=True)
        (name, kw), *_ = holder.calls
        assert name == "prepare_pull" and kw["reader_incarnation"] == OWN and kw["reader_transfer_id"] == "T"
        assert kw["lease_id"] == "L" and kw["block_ids"] == (1, 2) and kw["read_timeout_s"] == 5.0
        await transport.finish_read("self:1", "L", 0, "T", 1.0)
        assert await transport.renew_leases("self:1", ["L", "gone"], 1.0) == ["gone"]
        await transport.release_leases("self:1", ["L"], "done", 1.0)
        with pytest.raises(UnknownLease):  # the holder's own error, unchanged
            await transport.abandon_pull("self:1", "L", 0, "T", "cancelled", 1.0)
        assert [name for name, _ in holder.calls] == [
            "prepare_pull",
            "finish_read",
            "renew_leases",
            "release_leases",
            "abandon_pull",
        ]
        assert all(kw.get("reader_incarnation", OWN) == OWN for _, kw in holder.calls)
        assert inner.calls == [], "a call to this daemon went to the network"

    asyncio.run(main())


def test_calls_to_peers_go_to_the_network_and_a_reused_address_stops_being_self() -> None:
    async def main() -> None:
        inner, holder = Inner(), Holder()
        transport = LoopbackTransport(inner, holder)  # type: ignore[arg-type]
        await transport.handshake("peer:1", 1.0)
        await transport.prepare_pull("peer:1", PREPARE, 1.0)
        await transport.renew_leases("peer:1", ["L"], 1.0)
        assert [name for name, _ in inner.calls] == ["handshake", "prepare_pull", "renew_leases"]
        assert holder.calls == []
        await transport.handshake("self:2", 1.0)
        await transport.forget("self:2")  # a dropped session: the address is still this daemon's
        assert transport.is_self("self:2")
        inner.incarnations["self:2"] = "inc-another"  # the address now leads to another daemon
        await transport.handshake("self:2", 1.0)
        assert not transport.is_self("self:2")

    asyncio.run(main())


def test_a_local_prepare_past_its_timeout_is_deadline_exceeded() -> None:
    async def main() -> None:
        transport = LoopbackTransport(Inner(), Holder(prepare_s=5.0))  # type: ignore[arg-type]
        await transport.handshake("self:1", 1.0)
        with pytest.raises(DeadlineExceeded, match="this daemon"):
            await transport.prepare_pull("self:1", PREPARE, 0.05)

    asyncio.run(main())
