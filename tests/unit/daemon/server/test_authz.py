"""The role table covers every RPC, identities resolve to the right roles, requests are bounded."""

from __future__ import annotations

import ipaddress
import os
import socket
import stat
from pathlib import Path

import pytest

from kvd.config import KvdConfig
from kvd.server import authz, startup
from kvd.server.authz import ENGINE, OPERATOR, PEER, ROUTER, Malformed, Policy, Role
from kvd_client.errors import InvalidArgument
from kvd_client.v1 import common_pb2, engine_pb2, peer_pb2, router_pb2


def _proto_methods() -> list[str]:
    return [
        f"/{service.full_name}/{method.name}"
        for module in (engine_pb2, peer_pb2, router_pb2)
        for service in module.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    ]


def test_every_rpc_of_the_proto_has_an_entry_in_the_role_table() -> None:
    methods = _proto_methods()
    assert len(methods) >= 16
    missing = [m for m in methods if m not in authz.RPC_ROLES]
    assert not missing, f"RPCs without a role entry in kvd/server/authz.py: {missing}"
    for method in methods:
        assert authz.RPC_ROLES[method], f"{method} must name at least one role (ANYONE is for health only)"


def test_nixl_metadata_and_reads_are_peer_only() -> None:
    for name in ("Handshake", "PreparePull", "AbandonPull"):
        assert authz.RPC_ROLES[f"/kvd.v1.PeerService/{name}"] == {PEER}
    for name, roles in authz.RPC_ROLES.items():
        if "PeerService" not in name and "Engine" not in name:
            assert roles != {ENGINE}


def _policy(**fields: object) -> Policy:
    return Policy.from_config(KvdConfig(**fields))  # type: ignore[arg-type]


def test_certificate_names_map_to_roles_with_wildcards_and_spiffe_ids() -> None:
    policy = _policy(
        tls_peer_names=("spiffe://kvd.test/node/*",),
        tls_router_names=("router.kvd.test",),
        tls_operator_names=("ops-*.kvd.test",),
    )
    assert policy.roles_of_names(["spiffe://kvd.test/node/a"]) == {PEER}
    assert policy.roles_of_names(["localhost", "router.kvd.test"]) == {ROUTER}
    assert policy.roles_of_names(["ops-1.kvd.test"]) == {OPERATOR}
    assert policy.roles_of_names(["spiffe://other/node/a", "stranger.kvd.test"]) == set()
    # No names configured: every certificate the CA signed holds every TCP role (never engine).
    assert _policy().roles_of_names(["anything"]) == {PEER, ROUTER, OPERATOR}


def test_router_tokens_are_read_and_matched(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("# routers\n\nsecret-one\n  secret-two  \n")
    assert authz.read_tokens(str(tokens)) == (b"secret-one", b"secret-two")
    assert authz.bearer_token([("authorization", "Bearer secret-two")]) == b"secret-two"
    assert authz.bearer_token([("authorization", "Basic x")]) == b""
    assert authz.bearer_token([("other", "x")]) is None
    (tmp_path / "empty").write_text("# none\n")
    with pytest.raises(ValueError, match="holds no token"):
        authz.read_tokens(str(tmp_path / "empty"))


@pytest.mark.parametrize(
    ("peer", "loopback"),
    [
        ("ipv4:127.0.0.1:5000", True),
        ("ipv6:[::1]:5000", True),
        ("ipv6:%5B::ffff:127.0.0.1%5D:5000", True),
        ("ipv4:10.0.0.2:5000", False),
        ("unix:/tmp/x", False),
        ("garbage", False),
    ],
)
def test_loopback_peers(peer: str, loopback: bool) -> None:
    assert authz.is_loopback_peer(peer) is loopback


def test_the_kernel_socket_table_names_the_uid_of_a_loopback_caller() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    try:
        host, port = client.getsockname()
        assert authz.tcp_peer_uid(f"ipv4:{host}:{port}", server.getsockname()[1]) == os.getuid()
        assert authz.tcp_peer_uid(f"ipv4:{host}:{port}", server.getsockname()[1] + 1) is None
        # The fallback where netlink is unavailable reads the same answer from /proc/net/tcp.
        address = ipaddress.ip_address(host)
        assert authz._proc_uid(address, port, server.getsockname()[1], "/proc/net") == os.getuid()
    finally:
        client.close()
        server.close()


def test_malformed_bytes_and_oversized_fields_are_invalid_argument() -> None:
    parse = authz._parser(engine_pb2.HoldBlocksRequest)
    malformed = parse(b"\xff\xff\xff")
    assert isinstance(malformed, Malformed)
    with pytest.raises(InvalidArgument, match="malformed kvd.v1.HoldBlocksRequest"):
        authz.check_request(malformed)
    huge = "x" * (1 << 20)
    with pytest.raises(InvalidArgument, match="engine_id is 1048576 characters") as caught:
        authz.check_request(engine_pb2.HoldBlocksRequest(engine_id=huge))
    assert len(caught.value.message) < 300  # never echoed whole
    nested = router_pb2.StartPullRequest(remote=common_pb2.KvTransferParams(lease_id=huge))
    with pytest.raises(InvalidArgument, match="remote.lease_id"):
        authz.check_request(nested)
    many = engine_pb2.HoldBlocksRequest()
    many.block_ids.extend(range(authz.MAX_REPEATED + 1))
    with pytest.raises(InvalidArgument, match="block_ids has"):
        authz.check_request(many)
    fine = engine_pb2.HoldBlocksRequest(engine_id="e", block_ids=[1, 2])
    assert authz.check_request(parse(fine.SerializeToString())) == fine


def test_bounds_hold_in_large_messages_and_at_the_limits() -> None:
    """Small messages skip the field walk (their encoding bounds every field): the limits stay exact,
    and a large message is still walked to the field past them, however deep."""
    at_limit = "x" * authz.MAX_STRING_BYTES
    authz.check_request(engine_pb2.HoldBlocksRequest(engine_id=at_limit))
    with pytest.raises(InvalidArgument, match="engine_id is 4097 characters"):
        authz.check_request(engine_pb2.HoldBlocksRequest(engine_id=at_limit + "x"))
    pulls = [
        router_pb2.StartPullRequest(engine_id="e", request_id=f"r{i}", remote=common_pb2.KvTransferParams(lease_id="l"))
        for i in range(400)
    ]
    step = router_pb2.StartPullsRequest(pulls=pulls)
    assert step.ByteSize() > authz.MAX_STRING_BYTES  # walked, and fine
    assert authz.check_request(step) is step
    step.pulls[399].remote.lease_id = at_limit + "x"
    with pytest.raises(InvalidArgument, match="pulls.remote.lease_id is 4097 characters"):
        authz.check_request(step)


def test_denials_name_the_role_needed() -> None:
    stranger = authz.Principal("certificate stranger", frozenset(), True)
    nobody = authz.Principal("plaintext ipv4:127.0.0.1:1 (uid 65534, not trusted)", frozenset(), False)
    denied = authz.denial("/kvd.v1.PeerService/Handshake", authz.RPC_ROLES["/kvd.v1.PeerService/Handshake"], stranger)
    assert denied.code.name == "PERMISSION_DENIED" and "needs role peer" in denied.message
    unauth = authz.denial("/kvd.v1.RouterService/StartPull", authz.RPC_ROLES["/kvd.v1.RouterService/StartPull"], nobody)
    assert unauth.code.name == "UNAUTHENTICATED" and "needs role engine or router" in unauth.message
    assert {r.value for r in Role} == {"engine", "peer", "router", "operator"}


def test_plaintext_tcp_beyond_loopback_is_refused_unless_allowed(caplog: pytest.LogCaptureFixture) -> None:
    startup.check_tcp_security(KvdConfig(host="127.0.0.1"))
    startup.check_tcp_security(KvdConfig(host="localhost"))
    with pytest.raises(startup.StartupError, match="not a loopback address") as caught:
        startup.check_tcp_security(KvdConfig(host="0.0.0.0"))
    assert caught.value.exit_code == startup.CONFIG_ERROR and "tls_cert" in caught.value.fix
    startup.check_tcp_security(KvdConfig(host="0.0.0.0", allow_insecure_tcp=True))
    assert "INSECURE" in caplog.text


def test_socket_dir_that_lets_others_in_is_refused(tmp_path: Path) -> None:
    good = tmp_path / "good"
    good.mkdir(mode=0o700)
    startup.check_socket_dir(good)
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(startup.StartupError, match="others may write it"):
        startup.check_socket_dir(open_dir)
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o777 | stat.S_ISVTX)
    startup.check_socket_dir(sticky)  # like /tmp: others cannot replace what the daemon made
    if os.getuid() == 0:
        foreign = tmp_path / "foreign"
        foreign.mkdir(mode=0o700)
        os.chown(foreign, 65534, 65534)
        with pytest.raises(startup.StartupError, match="belongs to uid 65534"):
            startup.check_socket_dir(foreign)


def test_socket_dir_is_created_owner_only(tmp_path: Path) -> None:
    undo = startup.Undo()
    startup.prepare_socket_dir(str(tmp_path / "new" / "engine.sock"), None, undo)
    assert stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o700


def test_ucx_memtype_cache_is_off_unless_the_operator_says_otherwise() -> None:
    # With the cache, VRAM opened through CUDA IPC after UCX started was taken for host memory and
    # NIXL refused to register it (seen on an H200: docs/gpu-check.md).
    env = {"UCX_MEMTYPE_CACHE": "y", "UCX_HANDLE_ERRORS": "none"}
    startup.apply_nixl_env(KvdConfig(), env)
    assert env == {"UCX_MEMTYPE_CACHE": "y", "UCX_HANDLE_ERRORS": "none"}


def test_a_crash_inside_ucx_leaves_its_native_backtrace_unless_the_operator_says_otherwise() -> None:
    env: dict[str, str] = {}
    startup.apply_nixl_env(KvdConfig(), env)
    assert env["UCX_HANDLE_ERRORS"] == "bt"


def test_nixl_net_devices_become_ucx_net_devices_in_one_place() -> None:
    env: dict[str, str] = {}
    startup.apply_nixl_env(KvdConfig(), env)
    assert env == {"UCX_MEMTYPE_CACHE": "n", "UCX_HANDLE_ERRORS": "bt"}
    startup.apply_nixl_env(KvdConfig(nixl_net_devices="lo"), env)
    assert env == {"UCX_MEMTYPE_CACHE": "n", "UCX_HANDLE_ERRORS": "bt", "UCX_NET_DEVICES": "lo"}
    with pytest.raises(ValueError, match="nixl_net_devices"):
        KvdConfig(nixl_net_devices="lo; rm -rf /")


class _Context:
    """The two things the policy reads from a grpc ServicerContext."""

    def __init__(self, auth: dict[str, list[bytes]], peer: str) -> None:
        self._auth, self._peer = auth, peer

    def auth_context(self) -> dict[str, list[bytes]]:
        return self._auth

    def peer(self) -> str:
        return self._peer


def test_principals_of_each_kind_of_caller(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("t0k3n\n")
    policy = _policy(tls_cert="c", tls_key="k", tls_peer_names=("spiffe://kvd/node/*",), router_token_file=str(tokens))
    ssl = {"transport_security_type": [b"ssl"], "peer_uri": [b"spiffe://kvd/node/a"], "peer_dns": [b"localhost"]}
    remote = "ipv4:10.0.0.9:4000"
    assert policy.principal(authz.TCP, _Context(ssl, remote), ()).roles == {PEER}  # type: ignore[arg-type]
    stranger = {**ssl, "peer_uri": [b"spiffe://other/x"]}
    p = policy.principal(authz.TCP, _Context(stranger, remote), ())  # type: ignore[arg-type]
    assert p.roles == set() and p.identified
    # TLS without a client certificate (no tls_ca) is no identity: nothing, unless a router token.
    anonymous = {"transport_security_type": [b"ssl"]}
    p = policy.principal(authz.TCP, _Context(anonymous, remote), ())  # type: ignore[arg-type]
    assert p.roles == set() and not p.identified
    p = policy.principal(authz.TCP, _Context(anonymous, remote), [("authorization", "Bearer t0k3n")])  # type: ignore[arg-type]
    assert p.roles == {ROUTER}
    p = policy.principal(authz.TCP, _Context(anonymous, remote), [("authorization", "Bearer nope")])  # type: ignore[arg-type]
    assert p.roles == set() and p.identified
    # Plaintext off loopback: only with allow_insecure_tcp.
    plain = {"transport_security_type": [b"insecure"]}
    assert not _policy().principal(authz.TCP, _Context(plain, remote), ()).roles  # type: ignore[arg-type]
    insecure = _policy(allow_insecure_tcp=True)
    assert insecure.principal(authz.TCP, _Context(plain, remote), ()).roles == {PEER, ROUTER, OPERATOR}  # type: ignore[arg-type]
    # The engine socket: engine, router, operator; never peer.
    assert _policy().principal(authz.UNIX, _Context(plain, "unix:"), ()).roles == {ENGINE, ROUTER, OPERATOR}  # type: ignore[arg-type]
