"""Who owns the other end of a loopback TCP connection: the uid kvd's authorization trusts.

grpc names a TCP caller only by its address (``ipv4:127.0.0.1:5000``); on loopback the kernel
knows which uid owns the caller's socket. :func:`tcp_peer_uid` asks it over netlink
(``sock_diag``) for exactly that socket, or, where netlink is unavailable, scans
``/proc/net/tcp[6]``. kvd.server.authz turns the uid into roles (docs/security.md).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import struct
from pathlib import Path

logger = logging.getLogger(__name__)


def _peer_endpoint(peer: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int] | None:
    """``ipv4:127.0.0.1:5000`` / ``ipv6:[::1]:5000`` -> (address, port); None for anything else."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    rest = rest.replace("%5B", "[").replace("%5D", "]")
    host, _, port = rest.rpartition(":")
    try:
        address = ipaddress.ip_address(host.strip("[]").split("%")[0])
        return address, int(port)
    except ValueError:
        return None


def is_loopback_peer(peer: str) -> bool:
    endpoint = _peer_endpoint(peer)
    if endpoint is None:
        return False
    address = endpoint[0]
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def proc_address(text: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """An address of /proc/net/tcp (``0100007F:1F90``: little-endian 32-bit words, hex port)."""
    hex_address, _, hex_port = text.partition(":")
    raw = bytes.fromhex(hex_address)
    packed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(packed), int(hex_port, 16)


def tcp_peer_uid(peer: str, server_port: int, proc_net: str = "/proc/net") -> int | None:
    """The uid owning the client end of a loopback connection ``peer`` -> our ``server_port``.

    Asks the kernel for exactly that socket over netlink (``sock_diag``: a hash lookup, ~0.1 ms);
    where netlink is unavailable, scans ``/proc/net/tcp[6]`` (its ``uid`` column), which walks the
    whole connection table (milliseconds). None when no such socket exists (the caller closed
    already) or ``peer`` is not an IP endpoint.
    """
    endpoint = _peer_endpoint(peer)
    if endpoint is None:
        return None
    address, port = endpoint
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    try:
        return _diag_uid(address, port, server_port)
    except OSError:
        logger.debug("sock_diag unavailable; scanning /proc/net/tcp", exc_info=True)
    return proc_uid(address, port, server_port, proc_net)


_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLMSG_ERROR = 2
_INET_DIAG_NOCOOKIE = 0xFFFFFFFF
_UID_OFFSET = 16 + 64  # nlmsghdr, then inet_diag_msg's family..id, expires, rqueue, wqueue


def _diag_uid(address: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int, server_port: int) -> int | None:
    """sock_diag lookup of the TCP socket (address:port -> loopback:server_port); its owner's uid."""
    family = socket.AF_INET if address.version == 4 else socket.AF_INET6
    destinations = [address, ipaddress.ip_address("127.0.0.1" if address.version == 4 else "::1")]
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(1.0)
        for destination in dict.fromkeys(destinations):
            request = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF)
            request += struct.pack(">HH", port, server_port)
            request += address.packed.ljust(16, b"\0") + destination.packed.ljust(16, b"\0")
            request += struct.pack("=III", 0, _INET_DIAG_NOCOOKIE, _INET_DIAG_NOCOOKIE)
            header = struct.pack("=IHHII", 16 + len(request), _SOCK_DIAG_BY_FAMILY, 1, 1, 0)  # NLM_F_REQUEST
            nl.sendto(header + request, (0, 0))
            reply = nl.recv(65536)
            (kind,) = struct.unpack_from("=H", reply, 4)
            if kind == _SOCK_DIAG_BY_FAMILY and len(reply) >= _UID_OFFSET + 4:
                return int(struct.unpack_from("=I", reply, _UID_OFFSET)[0])
            if kind != _NLMSG_ERROR:
                raise OSError(f"unexpected sock_diag reply type {kind}")
    return None


def proc_uid(
    address: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int, server_port: int, proc_net: str
) -> int | None:
    wanted = {address}
    if isinstance(address, ipaddress.IPv4Address):
        wanted.add(ipaddress.IPv6Address(f"::ffff:{address}"))
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(proc_net, name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 8:
                continue
            local, remote = proc_address(fields[1]), proc_address(fields[2])
            if local[1] == port and local[0] in wanted and remote[1] == server_port:
                return int(fields[7])
    return None
