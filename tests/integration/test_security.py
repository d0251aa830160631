"""Authenticated roles on every RPC, through real daemons over mTLS, loopback TCP and the Unix socket.

A throwaway PKI (tests/pki.py) makes certificates for two daemons (peer role), a router, an
operator, a stranger (signed by the daemons' CA but named in no role) and a foreign peer (signed by
another CA). Every RPC is called as every identity: the ones the role table allows get through to
the servicer, every other one is refused with PERMISSION_DENIED naming the role it needs.

The attacks the security issue reported are replayed and must fail: a stranger asking for NIXL
metadata (and so reading or writing engine memory with a bare NIXL agent), a plaintext caller of
another uid on loopback, a router handshaking, a second uid on the engine socket.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from kvtest import ShmEngine, small_spec
from pki import make_identities

from kvd_client import KvdClient, TlsConfig, errors
from kvd_client.v1 import common_pb2, engine_pb2, engine_pb2_grpc, peer_pb2, peer_pb2_grpc, router_pb2, router_pb2_grpc

pytestmark = pytest.mark.integration

ROUTER_TOKEN = "router-token-" + uuid.uuid4().hex
IDENTITIES = {
    "node-a": ["URI:spiffe://kvd.test/node/a"],
    "node-b": ["URI:spiffe://kvd.test/node/b"],
    "router": ["DNS:router.kvd.test"],
    "operator": ["URI:spiffe://kvd.test/ops/alice"],
    "stranger": ["DNS:stranger.kvd.test"],
    "foreign-peer": ["URI:spiffe://kvd.test/node/evil"],
}
ROLE_OF = {"node-b": "peer", "router": "router", "operator": "operator", "stranger": None}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = make_identities(tmp_path_factory.mktemp("pki"), IDENTITIES)
    (directory / "router-tokens").write_text(f"# test routers\n{ROUTER_TOKEN}\n")
    return directory


def _daemon_flags(pki: Path, node: str) -> list[str]:
    return [
        f"--tls-cert={pki / node}.pem",
        f"--tls-key={pki / node}.key",
        f"--tls-ca={pki / 'ca.pem'}",
        "--tls-peer-names=spiffe://kvd.test/node/*",
        "--tls-router-names=router.kvd.test",
        "--tls-operator-names=spiffe://kvd.test/ops/*",
        f"--router-token-file={pki / 'router-tokens'}",
    ]


def _tls(pki: Path, name: str) -> TlsConfig:
    return TlsConfig.from_files(
        root_cert=pki / "ca.pem", client_cert=pki / f"{name}.pem", client_key=pki / f"{name}.key"
    )


def _channel(pki: Path, name: str, target: str) -> grpc.Channel:
    return grpc.secure_channel(target, _tls(pki, name).credentials())


@pytest.fixture
def mtls_pair(spawn_daemon, pki: Path) -> Iterator[tuple[Any, Any, ShmEngine, ShmEngine]]:
    a = spawn_daemon(*_daemon_flags(pki, "node-a"), name="a")
    b = spawn_daemon(*_daemon_flags(pki, "node-b"), name="b")
    holder = ShmEngine(a.unix_target, "holder", small_spec())
    reader = ShmEngine(b.unix_target, "reader", small_spec())
    holder.register()
    reader.register()
    holder.fill_random(11)
    yield a, b, holder, reader
    holder.close()
    reader.close()


def _calls(lease_id: str) -> dict[str, Callable[[grpc.Channel], Any]]:
    """One call per RPC served on TCP, with arguments an allowed caller gets a non-auth answer to."""
    peer = lambda ch: peer_pb2_grpc.PeerServiceStub(ch)  # noqa: E731
    router = lambda ch: router_pb2_grpc.RouterServiceStub(ch)  # noqa: E731
    return {
        "/kvd.v1.PeerService/Handshake": lambda ch: peer(ch).Handshake(peer_pb2.HandshakeRequest(), timeout=10),
        "/kvd.v1.PeerService/PreparePull": lambda ch: peer(ch).PreparePull(
            peer_pb2.PreparePullRequest(lease_id="no-such-lease", engine_id="holder"), timeout=10
        ),
        "/kvd.v1.PeerService/AbandonPull": lambda ch: peer(ch).AbandonPull(
            peer_pb2.AbandonPullRequest(lease_id="no-such-lease"), timeout=10
        ),
        "/kvd.v1.PeerService/PeerStream": lambda ch: list(
            peer(ch).PeerStream(
                iter(
                    [
                        peer_pb2.PeerCalls(
                            calls=[
                                peer_pb2.PeerCall(
                                    call_id=1,
                                    timeout_ms=5000,
                                    prepare_pull=peer_pb2.PreparePullRequest(lease_id="no-such-lease"),
                                )
                            ]
                        )
                    ]
                ),
                timeout=10,
            )
        ),
        "/kvd.v1.RouterService/StartPull": lambda ch: router(ch).StartPull(
            router_pb2.StartPullRequest(engine_id="nosuch", request_id="r", local_block_ids=[0]), timeout=10
        ),
        "/kvd.v1.RouterService/StartPulls": lambda ch: router(ch).StartPulls(
            router_pb2.StartPullsRequest(
                pulls=[router_pb2.StartPullRequest(engine_id="nosuch", request_id="r", local_block_ids=[0])]
            ),
            timeout=10,
        ),
        "/kvd.v1.RouterService/GetTransfer": lambda ch: router(ch).GetTransfer(
            router_pb2.GetTransferRequest(transfer_id="nosuch"), timeout=10
        ),
        "/kvd.v1.RouterService/WatchTransfer": lambda ch: list(
            router(ch).WatchTransfer(router_pb2.GetTransferRequest(transfer_id="nosuch"), timeout=10)
        ),
        "/kvd.v1.RouterService/WatchTransfers": lambda ch: list(
            router(ch).WatchTransfers(iter([router_pb2.WatchTransfersRequest(transfer_ids=["nosuch"])]), timeout=10)
        ),
        "/kvd.v1.RouterService/CancelTransfer": lambda ch: router(ch).CancelTransfer(
            router_pb2.CancelTransferRequest(transfer_id="nosuch"), timeout=10
        ),
        "/kvd.v1.RouterService/LookupHeld": lambda ch: router(ch).LookupHeld(
            router_pb2.LookupHeldRequest(), timeout=10
        ),
        "/kvd.v1.RouterService/RenewLease": lambda ch: router(ch).RenewLease(
            router_pb2.RenewLeaseRequest(lease_id=lease_id), timeout=10
        ),
        "/kvd.v1.RouterService/ReleaseLease": lambda ch: router(ch).ReleaseLease(
            router_pb2.ReleaseLeaseRequest(lease_id="no-such-lease"), timeout=10
        ),
        "/kvd.v1.RouterService/GetStatus": lambda ch: router(ch).GetStatus(router_pb2.GetStatusRequest(), timeout=10),
        "/kvd.v1.RouterService/SelftestHold": lambda ch: router(ch).SelftestHold(
            router_pb2.SelftestHoldRequest(size_bytes=1 << 20, seed=3), timeout=30
        ),
        "/kvd.v1.EngineService/HoldBlocks": lambda ch: engine_pb2_grpc.EngineServiceStub(ch).HoldBlocks(
            engine_pb2.HoldBlocksRequest(engine_id="holder", request_id="x", block_ids=[0], num_tokens=1), timeout=10
        ),
    }


def _outcome(call: Callable[[grpc.Channel], Any], channel: grpc.Channel) -> tuple[grpc.StatusCode, str]:
    try:
        call(channel)
    except grpc.RpcError as err:
        return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""


def test_role_matrix_every_rpc_as_every_identity(mtls_pair, pki: Path) -> None:
    from kvd.server.authz import RPC_ROLES

    a, _, holder, _ = mtls_pair
    lease = holder.client.hold_blocks(engine_id="holder", request_id="keep", block_ids=[1], num_tokens=4).lease
    refused = {grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED}
    calls = _calls(lease.lease_id)
    table: dict[tuple[str, str], grpc.StatusCode] = {}
    for name, role in ROLE_OF.items():
        with _channel(pki, name, a.tcp.replace("127.0.0.1", "localhost")) as channel:
            for method, call in calls.items():
                code, details = _outcome(call, channel)
                table[(name, method)] = code
                if "EngineService" in method:
                    # Not served on TCP at all: engines live on the Unix socket.
                    assert code is grpc.StatusCode.UNIMPLEMENTED, (name, method, code)
                elif role is not None and role in {r.value for r in RPC_ROLES[method]}:
                    assert code not in refused, (name, method, code, details)
                else:
                    assert code is grpc.StatusCode.PERMISSION_DENIED, (name, method, code, details)
                    needed = " or ".join(sorted(r.value for r in RPC_ROLES[method]))
                    assert f"needs role {needed}" in details, details
    # What an allowed call returns is real: the peer gets metadata, the operator a status.
    assert table[("node-b", "/kvd.v1.PeerService/Handshake")] is grpc.StatusCode.OK
    assert table[("node-b", "/kvd.v1.PeerService/PeerStream")] is grpc.StatusCode.OK  # its call's error is in the reply
    assert table[("router", "/kvd.v1.RouterService/GetStatus")] is grpc.StatusCode.OK
    assert table[("router", "/kvd.v1.RouterService/RenewLease")] is grpc.StatusCode.OK
    assert table[("operator", "/kvd.v1.RouterService/SelftestHold")] is grpc.StatusCode.OK
    # The lease the stranger could not touch is still held.
    assert any(p.lease_id == lease.lease_id for p in holder.client.lookup_held(engine_id="holder").held)


def test_router_starts_and_watches_pulls_but_cannot_handshake(mtls_pair, pki: Path) -> None:
    _, b, holder, reader = mtls_pair
    holder.fill_random(12)
    params = holder.client.hold_blocks(
        engine_id="holder", request_id="r", block_ids=[2, 3], num_tokens=30
    ).kv_transfer_params
    with KvdClient(b.tcp.replace("127.0.0.1", "localhost"), tls=_tls(pki, "router"), timeout_s=30) as router:
        started = router.start_pull(
            engine_id="reader", tp_rank=0, request_id="r", local_block_ids=[5, 6], remote=params
        )
        assert router.wait_transfer(started.transfer_id, timeout_s=30).state == common_pb2.TRANSFER_STATE_DONE
    assert reader.token_bytes([5, 6], 30).equal(holder.token_bytes([2, 3], 30))
    with _channel(pki, "router", b.tcp.replace("127.0.0.1", "localhost")) as channel:
        code, details = _outcome(_calls("")["/kvd.v1.PeerService/Handshake"], channel)
    assert code is grpc.StatusCode.PERMISSION_DENIED and "needs role peer" in details


def test_router_token_grants_the_router_role_and_a_wrong_token_nothing(mtls_pair, pki: Path) -> None:
    a = mtls_pair[0]
    target = a.tcp.replace("127.0.0.1", "localhost")
    with _channel(pki, "stranger", target) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        held = stub.LookupHeld(
            router_pb2.LookupHeldRequest(), metadata=[("authorization", f"Bearer {ROUTER_TOKEN}")], timeout=10
        )
        assert isinstance(held, router_pb2.LookupHeldResponse)
        with pytest.raises(grpc.RpcError) as caught:
            stub.LookupHeld(router_pb2.LookupHeldRequest(), metadata=[("authorization", "Bearer guess")], timeout=10)
        assert caught.value.code() is grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as caught:
            peer_pb2_grpc.PeerServiceStub(channel).Handshake(
                peer_pb2.HandshakeRequest(), metadata=[("authorization", f"Bearer {ROUTER_TOKEN}")], timeout=10
            )
        assert caught.value.code() is grpc.StatusCode.PERMISSION_DENIED  # a router token is no peer


_BARE_AGENT = textwrap.dedent(
    """
    import sys, uuid
    import numpy as np, torch
    from nixl._api import nixl_agent, nixl_agent_config
    metadata, address, nbytes = open(sys.argv[1], "rb").read(), int(sys.argv[2]), int(sys.argv[3])
    buffer = torch.zeros(nbytes, dtype=torch.uint8)
    agent = nixl_agent(f"kvd-test-attacker-{uuid.uuid4().hex[:8]}", nixl_agent_config(backends=["UCX"]))
    agent.register_memory(buffer)
    remote = agent.add_remote_agent(metadata)
    local_h = agent.prep_xfer_dlist("NIXL_INIT_AGENT", np.array([[buffer.data_ptr(), nbytes, 0]], np.int64), "DRAM")
    remote_h = agent.prep_xfer_dlist(remote, np.array([[address, nbytes, 0]], np.int64), "DRAM")
    handle = agent.make_prepped_xfer("READ", local_h, np.array([0], np.int32), remote_h, np.array([0], np.int32))
    state = agent.transfer(handle)
    while state == "PROC":
        state = agent.check_xfer_state(handle)
    print(state, bytes(buffer.numpy()).hex())
    """
)


def _bare_nixl_read(handshake: peer_pb2.HandshakeResponse, engine_id: str, nbytes: int, workdir: Path) -> bytes:
    """What the reported attack did: load the metadata into a bare NIXL agent and READ engine memory
    (in a child process: a NIXL agent is not something to leave in the test process)."""
    region = next(e for e in handshake.engines if e.engine_id == engine_id).regions[0]
    metadata = workdir / "stolen-metadata"
    metadata.write_bytes(handshake.agent_metadata)
    result = subprocess.run(
        [sys.executable, "-c", _BARE_AGENT, str(metadata), str(region.address), str(nbytes)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    state, _, data = result.stdout.strip().splitlines()[-1].partition(" ")
    assert state == "DONE", result.stdout + result.stderr
    return bytes.fromhex(data)


def test_stranger_gets_no_metadata_so_a_bare_nixl_agent_has_nothing_to_read_with(
    mtls_pair, pki: Path, tmp_path: Path
) -> None:
    a, _, holder, _ = mtls_pair
    target = a.tcp.replace("127.0.0.1", "localhost")
    before = bytes(holder.buffer[:4096].numpy())
    # Control: with a peer's certificate the attack apparatus works (this is what NIXL grants a peer).
    with _channel(pki, "node-b", target) as channel:
        info = peer_pb2_grpc.PeerServiceStub(channel).Handshake(peer_pb2.HandshakeRequest(), timeout=10)
    assert _bare_nixl_read(info, "holder", 4096, tmp_path) == before
    # The stranger (same CA, no role), a foreign CA's "peer", and plaintext: no metadata at all.
    with _channel(pki, "stranger", target) as channel, pytest.raises(grpc.RpcError) as caught:
        peer_pb2_grpc.PeerServiceStub(channel).Handshake(peer_pb2.HandshakeRequest(), timeout=10)
    assert caught.value.code() is grpc.StatusCode.PERMISSION_DENIED
    assert "needs role peer" in (caught.value.details() or "")
    foreign = TlsConfig.from_files(
        root_cert=pki / "ca.pem", client_cert=pki / "foreign-peer.pem", client_key=pki / "foreign-peer.key"
    )
    with grpc.secure_channel(target, foreign.credentials()) as channel, pytest.raises(grpc.RpcError) as caught:
        peer_pb2_grpc.PeerServiceStub(channel).Handshake(peer_pb2.HandshakeRequest(), timeout=5)
    assert caught.value.code() is grpc.StatusCode.UNAVAILABLE  # the TLS handshake itself fails
    with grpc.insecure_channel(a.tcp) as channel, pytest.raises(grpc.RpcError) as caught:
        peer_pb2_grpc.PeerServiceStub(channel).Handshake(peer_pb2.HandshakeRequest(), timeout=5)
    assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
    assert bytes(holder.buffer[:4096].numpy()) == before


needs_root = pytest.mark.skipif(os.getuid() != 0, reason="dropping to another uid needs root")

_AS_NOBODY = textwrap.dedent(
    """
    import os, sys, grpc
    from kvd_client.v1 import peer_pb2, peer_pb2_grpc, router_pb2, router_pb2_grpc
    os.setgroups([]); os.setgid(65534); os.setuid(65534)  # after the imports: the repo may be root-only
    target, kind = sys.argv[1], sys.argv[2]
    with grpc.insecure_channel(target) as channel:
        try:
            if kind == "handshake":
                peer_pb2_grpc.PeerServiceStub(channel).Handshake(peer_pb2.HandshakeRequest(), timeout=5)
            else:
                router_pb2_grpc.RouterServiceStub(channel).LookupHeld(router_pb2.LookupHeldRequest(), timeout=5)
        except grpc.RpcError as err:
            print(err.code().name, "|", err.details())
        else:
            print("OK |")
    """
)


def _as_nobody(target: str, kind: str) -> tuple[str, str]:
    result = subprocess.run(
        [sys.executable, "-c", _AS_NOBODY, target, kind], capture_output=True, text=True, timeout=60, check=True
    )
    code, _, details = result.stdout.strip().rpartition("\n")[-1].partition(" | ")
    return code.strip(), details


@needs_root
def test_another_uid_is_refused_on_loopback_tcp_and_on_the_engine_socket(spawn_daemon) -> None:
    """The issue's attacker: same host, no credentials, plaintext TCP (and the engine socket)."""
    daemon = spawn_daemon()  # defaults: plaintext loopback TCP, owner-only engine socket
    engine = ShmEngine(daemon.unix_target, "victim", small_spec())
    try:
        engine.register()
        engine.client.hold_blocks(engine_id="victim", request_id="r", block_ids=[0], num_tokens=4)
        code, details = _as_nobody(daemon.tcp, "handshake")
        assert code == "UNAUTHENTICATED" and "needs role peer" in details and "uid 65534" in details, details
        code, details = _as_nobody(daemon.tcp, "lookup")
        assert code == "UNAUTHENTICATED" and "needs role" in details, details
        # The engine socket: the kernel refuses the connection (socket 0600 in a 0700 directory).
        code, details = _as_nobody(daemon.unix_target, "lookup")
        assert code == "UNAVAILABLE" and "Permission denied" in details, details
        # The daemon's own uid is the engine: it still works, and nothing changed.
        with grpc.insecure_channel(daemon.tcp) as channel:
            info = peer_pb2_grpc.PeerServiceStub(channel).Handshake(peer_pb2.HandshakeRequest(), timeout=10)
        assert info.agent_metadata
        assert engine.client.get_status().leases_held == 1
    finally:
        engine.close()


def test_client_raises_the_auth_classes(mtls_pair, pki: Path) -> None:
    a = mtls_pair[0]
    with (
        KvdClient(a.tcp.replace("127.0.0.1", "localhost"), tls=_tls(pki, "stranger"), timeout_s=10) as stranger,
        pytest.raises(errors.PermissionDenied, match="needs role"),
    ):
        stranger.lookup_held()


def _tcp_listeners(pid: int) -> list[str]:
    """The addresses of every listening TCP socket process ``pid`` owns (its fds in /proc/net/tcp[6])."""
    from kvd.server.authz import _proc_address

    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    out = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, _ = _proc_address(fields[1])
                out.append(str(getattr(address, "ipv4_mapped", None) or address))
    return out


def test_nixl_listeners_bind_only_the_configured_devices(spawn_daemon) -> None:
    """nixl_net_devices=lo: UCX (and so NIXL) listens on loopback only, and pulls still work."""
    import ipaddress

    a = spawn_daemon("--nixl-net-devices=lo", name="a")
    b = spawn_daemon("--nixl-net-devices=lo", name="b")
    holder = ShmEngine(a.unix_target, "holder", small_spec())
    reader = ShmEngine(b.unix_target, "reader", small_spec())
    try:
        holder.register()
        reader.register()
        holder.fill_random(21)
        params = holder.client.hold_blocks(
            engine_id="holder", request_id="r", block_ids=[1, 2], num_tokens=20
        ).kv_transfer_params
        started = reader.client.start_pull(
            engine_id="reader", tp_rank=0, request_id="r", local_block_ids=[3, 4], remote=params
        )
        assert reader.client.wait_transfer(started.transfer_id, timeout_s=30).state == common_pb2.TRANSFER_STATE_DONE
        assert reader.token_bytes([3, 4], 20).equal(holder.token_bytes([1, 2], 20))
        for daemon in (a, b):
            listening = _tcp_listeners(daemon.process.pid)
            assert len(listening) >= 2, listening  # gRPC, metrics, and UCX's own
            assert all(ipaddress.ip_address(x).is_loopback for x in listening), listening
    finally:
        holder.close()
        reader.close()
    # For the record (-s): without the setting, UCX listens on every device's address.
    c = spawn_daemon(name="c")
    print(f"default (no nixl_net_devices) listeners: {_tcp_listeners(c.process.pid)}")
