"""Who may call which RPC: identities, roles, the one table, and the interceptor that enforces it.

NIXL gives whoever holds an agent's metadata the power to read and write every region that agent
registered, so ``Handshake`` (which returns that metadata) must only answer other kvd daemons.
Every RPC is therefore authorized against a role here, before the servicer runs (servicers stay
thin and never see an unauthorized request). See docs/security.md for the threat model.

Identities, per listener:

* **Unix socket**: the kernel checks the caller at ``connect(2)`` against the socket's mode
  (0600 for the daemon's uid, 0660 with ``engine_group``) inside a directory only the daemon's
  uid may change. grpc's Python server exposes neither the connection's fd nor ``SO_PEERCRED``
  (its auth context for a Unix socket carries only ``transport_security_type``), so this
  connect-time check, made against the same credentials ``SO_PEERCRED`` would report, is the
  uid check. Whoever gets through holds ``engine``, ``router`` and ``operator``.
* **TCP with mTLS**: the client certificate's SANs (DNS names, URIs such as SPIFFE IDs) map to
  roles through ``tls_peer_names`` / ``tls_router_names`` / ``tls_operator_names``; with none
  of them set, every certificate ``tls_ca`` signed holds every TCP role.
* **Plaintext TCP on loopback**: the kernel (netlink ``sock_diag``, or ``/proc/net/tcp[6]``) names
  the uid that owns the caller's end of the connection: the daemon's uid (or one of
  ``loopback_uids``) holds ``peer``, ``router`` and ``operator``; anyone else holds nothing.
* **Plaintext TCP elsewhere**: only with ``allow_insecure_tcp``, and then every caller holds
  every TCP role (the operator said so, and is told at every start).
* **Bearer token** (any TCP caller): ``authorization: Bearer <token>`` matching a line of
  ``router_token_file`` (compared in constant time) adds ``router``.

A caller without the role gets PERMISSION_DENIED, or UNAUTHENTICATED when it presented no
identity at all; both name the role the RPC needs.

The interceptor also parses every request through kvd (kvd.server.request_bounds): a malformed
request becomes INVALID_ARGUMENT here, as does one whose ids or repeated fields are too long.
A loopback caller's uid comes from the kernel (kvd.server.loopback_uid).
"""

from __future__ import annotations

import dataclasses
import enum
import fnmatch
import hmac
import inspect
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import Message

from kvd.config import KvdConfig
from kvd.server.loopback_uid import is_loopback_peer, tcp_peer_uid
from kvd.server.loopback_uid import proc_address as _proc_address
from kvd.server.loopback_uid import proc_uid as _proc_uid
from kvd.server.request_bounds import (
    MAX_ECHO_CHARS,
    MAX_REPEATED,
    MAX_STRING_BYTES,
    Malformed,
    check_request,
    clip,
    parser_of,
)
from kvd_client.errors import KvdError, PermissionDenied, Unauthenticated
from kvd_client.grpc_errors import error_metadata, status_code

logger = logging.getLogger(__name__)
_parser = parser_of

# Defined here before kvd.server.loopback_uid and kvd.server.request_bounds: still importable from here.
__all__ = [
    "ANYONE",
    "ENGINE",
    "MAX_ECHO_CHARS",
    "MAX_REPEATED",
    "MAX_STRING_BYTES",
    "OPERATOR",
    "PEER",
    "ROUTER",
    "RPC_ROLES",
    "TCP",
    "UNIX",
    "AuthInterceptor",
    "Malformed",
    "Policy",
    "Principal",
    "Role",
    "_parser",
    "_proc_address",
    "_proc_uid",
    "bearer_token",
    "check_request",
    "clip",
    "is_loopback_peer",
    "read_tokens",
    "tcp_peer_uid",
]


class Role(enum.Enum):
    ENGINE = "engine"  # an engine rank on this node (Unix socket)
    PEER = "peer"  # another kvd daemon: gets NIXL metadata, reads held blocks
    ROUTER = "router"  # starts and watches pulls, looks up and releases leases
    OPERATOR = "operator"  # status and selftest


ENGINE, PEER, ROUTER, OPERATOR = Role.ENGINE, Role.PEER, Role.ROUTER, Role.OPERATOR
ANYONE: frozenset[Role] = frozenset()
"""Marks methods open to every caller that reaches the listener (health checks only)."""

RPC_ROLES: dict[str, frozenset[Role]] = {
    # EngineService: Unix socket only. An engine registers its own memory and holds its own blocks.
    "/kvd.v1.EngineService/RegisterKvCache": frozenset({ENGINE}),
    "/kvd.v1.EngineService/UnregisterKvCache": frozenset({ENGINE}),
    "/kvd.v1.EngineService/EngineStream": frozenset({ENGINE}),
    "/kvd.v1.EngineService/HoldBlocks": frozenset({ENGINE}),
    # The scheduler's stream: the daemon asks it to verify and pin a soft hold's blocks.
    "/kvd.v1.EngineService/SchedulerStream": frozenset({ENGINE}),
    # PeerService: NIXL metadata and reads of held blocks. Peers only, nobody else, ever.
    "/kvd.v1.PeerService/Handshake": frozenset({PEER}),
    "/kvd.v1.PeerService/PreparePull": frozenset({PEER}),
    "/kvd.v1.PeerService/AbandonPull": frozenset({PEER}),
    # A reader daemon ends its soft read, and renews / releases leases for its engines' requests.
    "/kvd.v1.PeerService/FinishRead": frozenset({PEER}),
    "/kvd.v1.PeerService/RenewLeases": frozenset({PEER}),
    "/kvd.v1.PeerService/ReleaseLeases": frozenset({PEER}),
    "/kvd.v1.PeerService/PeerStream": frozenset({PEER}),
    # RouterService: pulls are started by routers or by the engine's connector on this node.
    "/kvd.v1.RouterService/StartPull": frozenset({ROUTER, ENGINE}),
    "/kvd.v1.RouterService/StartPulls": frozenset({ROUTER, ENGINE}),
    "/kvd.v1.RouterService/GetTransfer": frozenset({ROUTER, ENGINE}),
    "/kvd.v1.RouterService/WatchTransfer": frozenset({ROUTER, ENGINE}),
    "/kvd.v1.RouterService/WatchTransfers": frozenset({ROUTER, ENGINE}),
    "/kvd.v1.RouterService/CancelTransfer": frozenset({ROUTER, ENGINE}),
    # Lease ids are capabilities: the holder's engines, its peers and routers only.
    "/kvd.v1.RouterService/LookupHeld": frozenset({ROUTER, ENGINE, PEER}),
    "/kvd.v1.RouterService/RenewLease": frozenset({ROUTER, ENGINE, PEER}),
    "/kvd.v1.RouterService/ReleaseLease": frozenset({ROUTER, ENGINE, PEER}),
    "/kvd.v1.RouterService/GetStatus": frozenset({OPERATOR, ROUTER, ENGINE}),
    "/kvd.v1.RouterService/SelftestHold": frozenset({OPERATOR}),
    # Standard services.
    "/grpc.health.v1.Health/Check": ANYONE,
    "/grpc.health.v1.Health/Watch": ANYONE,
    "/grpc.health.v1.Health/List": ANYONE,
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": frozenset({OPERATOR, ROUTER, PEER}),
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo": frozenset({OPERATOR, ROUTER, PEER}),
}
"""The one table: every RPC a kvd listener serves -> the roles allowed to call it. A method that
is missing is refused to everyone (tests/unit/daemon/server/test_authz.py checks every RPC of
the proto has an entry)."""

UNIX, TCP = "unix", "tcp"


@dataclasses.dataclass(frozen=True)
class Principal:
    """Who a call comes from, as far as the daemon can tell, and the roles that grants."""

    description: str
    roles: frozenset[Role]
    identified: bool  # presented some identity (certificate, trusted uid, token), accepted or not


@dataclasses.dataclass
class Policy:
    """The roles each kind of caller holds, from the config (built once at start-up)."""

    uid: int
    trusted_uids: frozenset[int]
    tls: bool
    allow_insecure_tcp: bool
    san_roles: tuple[tuple[str, Role], ...]
    router_tokens: tuple[bytes, ...]
    tcp_port: int = 0  # set once the TCP listener is bound (port 0 picks one)

    @classmethod
    def from_config(cls, config: KvdConfig) -> Policy:
        uid = os.getuid()
        san_roles = tuple(
            (pattern, role)
            for names, role in (
                (config.tls_peer_names, PEER),
                (config.tls_router_names, ROUTER),
                (config.tls_operator_names, OPERATOR),
            )
            for pattern in names
        )
        return cls(
            uid=uid,
            trusted_uids=frozenset({uid, *(int(u) for u in config.loopback_uids)}),
            tls=config.tls_enabled,
            allow_insecure_tcp=config.allow_insecure_tcp,
            san_roles=san_roles,
            router_tokens=read_tokens(config.router_token_file) if config.router_token_file else (),
        )

    def roles_of_names(self, names: Sequence[str]) -> frozenset[Role]:
        """The roles a verified certificate with these SANs holds."""
        if not self.san_roles:
            return frozenset({PEER, ROUTER, OPERATOR})
        return frozenset(
            role for pattern, role in self.san_roles for name in names if fnmatch.fnmatchcase(name, pattern)
        )

    def principal(self, listener: str, context: grpc.aio.ServicerContext, metadata: Iterable[Any]) -> Principal:
        if listener == UNIX:
            return Principal("an engine-socket caller", frozenset({ENGINE, ROUTER, OPERATOR}), True)
        return self.tcp_principal(context.auth_context() or {}, context.peer() or "", metadata, self.tcp_port)

    def tcp_principal(
        self, auth: Mapping[str, Iterable[bytes]], peer: str, metadata: Iterable[Any], server_port: int
    ) -> Principal:
        """A TCP caller's roles from what gRPC's auth context says of it (``auth``: the SANs of a
        verified client certificate), its address, its metadata (a bearer token), and the port it
        called (whose loopback connections name their uid): the gRPC port's callers, and the
        framed peer port's (kvd.server.peer_frames), by one rule."""
        roles: set[Role] = set()
        what: list[str] = []
        identified = False
        names = [v.decode("utf-8", "replace") for k in ("peer_dns", "peer_uri") for v in auth.get(k, [])]
        if auth.get("transport_security_type") == [b"ssl"] and names:
            identified = True
            roles |= self.roles_of_names(names)
            what.append(f"certificate {clip(', '.join(names), 120)}")
        else:  # plaintext, or TLS without a client certificate (no tls_ca): no identity from TLS
            uid = tcp_peer_uid(peer, server_port) if is_loopback_peer(peer) else None
            if uid is not None and uid in self.trusted_uids:
                roles |= {PEER, ROUTER, OPERATOR}
                identified = True
                what.append(f"loopback uid {uid}")
            elif uid is None and self.allow_insecure_tcp and not is_loopback_peer(peer):
                roles |= {PEER, ROUTER, OPERATOR}
                identified = True
                what.append(f"plaintext {peer} (allow_insecure_tcp)")
            else:
                what.append(f"plaintext {peer}" + (f" (uid {uid}, not trusted)" if uid is not None else ""))
        token = bearer_token(metadata)
        if token is not None:
            identified = True
            if self.router_tokens and any(hmac.compare_digest(token, t) for t in self.router_tokens):
                roles.add(ROUTER)
                what.append("a valid router token")
            else:
                what.append("an unknown bearer token")
        return Principal(" with ".join(what), frozenset(roles), identified)


def read_tokens(path: str) -> tuple[bytes, ...]:
    """The router tokens of ``path``: one per line, blank lines and ``#`` comments skipped."""
    lines = Path(path).read_text().splitlines()
    tokens = tuple(line.strip().encode() for line in lines if line.strip() and not line.strip().startswith("#"))
    if not tokens:
        raise ValueError(f"router_token_file {path} holds no token")
    return tokens


def bearer_token(metadata: Iterable[Any]) -> bytes | None:
    for item in metadata or ():
        key, value = item[0], item[1]
        if key == "authorization":
            text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
            scheme, _, token = text.partition(" ")
            return token.strip().encode() if scheme.lower() == "bearer" else b""
    return None


# -- the interceptor -----------------------------------------------------------------------------


async def _refuse(context: grpc.aio.ServicerContext, error: KvdError) -> None:
    context.set_trailing_metadata(error_metadata(error))
    await context.abort(status_code(error.code), error.message)


def denial(method: str, allowed: frozenset[Role] | None, principal: Principal) -> KvdError:
    """The error a caller without the roles ``method`` needs gets (unauthenticated: no identity)."""
    short = method.rsplit("/", 2)[-2].rsplit(".", 1)[-1] + "/" + method.rsplit("/", 1)[-1]
    if allowed is None:
        return PermissionDenied(f"{clip(short)} is not served to anyone")
    needed = " or ".join(sorted(r.value for r in allowed))
    held = ", ".join(sorted(r.value for r in principal.roles)) or "none"
    if not principal.identified:
        return Unauthenticated(
            f"{short} needs role {needed}; the caller ({principal.description}) presented no identity: "
            "connect with a client certificate, a router token, or from a trusted uid (docs/security.md)"
        )
    return PermissionDenied(f"{short} needs role {needed}; the caller ({principal.description}) holds: {held}")


async def _results(call: Any) -> AsyncIterator[Any]:
    """A streaming behavior's responses, whether it yields them or writes them (``context.write``)."""
    if inspect.isasyncgen(call):
        async for item in call:
            yield item
    else:
        await call


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Authorizes every call against :data:`RPC_ROLES` and parses every request through kvd."""

    def __init__(self, policy: Policy, listener: str, on_denied: Callable[[str, str], None] | None = None) -> None:
        self.policy = policy
        self.listener = listener
        self.on_denied = on_denied
        self._wrapped: dict[str, Any] = {}  # method -> its wrapped handler (built once per method)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        method = handler_call_details.method
        wrapped = self._wrapped.get(method)
        if wrapped is not None:
            return wrapped
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        wrapped = self._wrap(handler, method)
        if method in RPC_ROLES:  # bounded: unknown method names are not cached
            self._wrapped[method] = wrapped
        return wrapped

    async def _authorize(self, method: str, context: grpc.aio.ServicerContext) -> None:
        allowed = RPC_ROLES.get(method)
        if allowed is not None and not allowed:  # ANYONE
            return
        principal = self.policy.principal(self.listener, context, context.invocation_metadata() or ())
        if allowed is not None and principal.roles & allowed:
            return
        error = denial(method, allowed, principal)
        logger.info("refused %s from %s: %s", clip(method), principal.description, error.message)
        if self.on_denied is not None:
            self.on_denied(method, error.code.name)
        await _refuse(context, error)

    def _wrap(self, handler: Any, method: str) -> Any:
        original = handler.request_deserializer
        cls = getattr(original, "__self__", None)
        parse = parser_of(cls) if isinstance(cls, type) and issubclass(cls, Message) else original
        serialize = handler.response_serializer
        authorize = self._authorize

        async def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                return check_request(request)
            except KvdError as exc:
                await _refuse(context, exc)
                raise  # not reached: abort raises

        async def checked_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
            async for request in requests:
                yield check_request(request)  # InvalidArgument ends the stream through the servicer's edge

        if handler.unary_unary is not None:
            unary_unary = handler.unary_unary

            async def uu(request: Any, context: grpc.aio.ServicerContext) -> Any:
                await authorize(method, context)
                return await unary_unary(await checked(request, context), context)

            return grpc.unary_unary_rpc_method_handler(uu, parse, serialize)
        if handler.unary_stream is not None:
            unary_stream = handler.unary_stream

            async def us(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                await authorize(method, context)
                async for item in _results(unary_stream(await checked(request, context), context)):
                    yield item

            return grpc.unary_stream_rpc_method_handler(us, parse, serialize)
        if handler.stream_unary is not None:
            stream_unary = handler.stream_unary

            async def su(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
                await authorize(method, context)
                return await stream_unary(checked_stream(requests), context)

            return grpc.stream_unary_rpc_method_handler(su, parse, serialize)
        stream_stream = handler.stream_stream

        async def ss(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await authorize(method, context)
            async for item in _results(stream_stream(checked_stream(requests), context)):
                yield item

        return grpc.stream_stream_rpc_method_handler(ss, parse, serialize)
