"""What /proc says about a daemon: RSS (and the part of it that is the staging pool), fds, shm maps.

The staging pool (``staging_pool_bytes``, 256 MiB by default) is one anonymous allocation made at
the first layout conversion; its pages become resident as pulls use deeper parts of it, so a
daemon's RSS climbs towards ``baseline + staging_pool_bytes`` under load and then stops. The
fleet reports that part separately (the mapping of that size in ``/proc/PID/smaps``) and asks
the rest of the RSS to be flat. The engines' shm pages the daemon has touched (reading them for a
peer, or writing a pull into them) count in its RSS too (``RssShmem``): they are the engines'
memory, reported apart as well.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path

PAGE = 4096


@dataclasses.dataclass(frozen=True)
class Sample:
    """One look at a daemon: when (seconds into the run), RSS, its staging-pool share, fds."""

    t: float
    rss: int
    staging_rss: int
    fds: int
    shmem: int = 0  # RssShmem: engines' /dev/shm pages the daemon touched (the engines' memory)

    @property
    def rest(self) -> int:
        """The daemon's own memory: RSS less the staging pool and less the engines' shm pages."""
        return self.rss - self.staging_rss - self.shmem


def status_bytes(pid: int, *keys: str) -> list[int]:
    """Fields of /proc/PID/status in bytes (``VmRSS``, ``RssShmem``...), 0 when absent."""
    values = dict.fromkeys(keys, 0)
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in values:
            values[key] = int(rest.split()[0]) * 1024
    return [values[k] for k in keys]


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


TCP_STATES = {"01": "established", "06": "time_wait", "08": "close_wait", "0A": "listen"}


def _tcp_sockets(pid: int) -> dict[str, str]:
    """inode -> "tcp <serving :port, or out> <remote address> <state>" for the TCP sockets in ``pid``'s netns."""
    out = {}
    lines = []
    for table in ("tcp", "tcp6"):  # gRPC's sockets may be IPv6 ones with IPv4-mapped addresses
        with contextlib.suppress(OSError):
            lines += Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
    for line in lines:
        f = line.split()
        if len(f) > 9:
            local_port = int(f[1].split(":")[1], 16)
            remote_hex = f[2].split(":")[0][-8:]  # IPv4, or the IPv4 of a mapped IPv6 address
            remote = ".".join(str(int(remote_hex[i : i + 2], 16)) for i in (6, 4, 2, 0))
            state = TCP_STATES.get(f[3], f[3])
            side = f"serving :{local_port}" if local_port in (50151, 9464) else "out"
            out[f[9]] = f"tcp {side} {remote if state != 'listen' else ''} {state}".replace("  ", " ")
    return out


def fd_kinds(pid: int) -> dict[str, int]:
    """``pid``'s open fds by kind: a TCP socket by its side, peer address and state, ``socket``
    (unix and others), ``pipe``, ``anon_inode:[eventfd]``..., or the file's path."""
    kinds: dict[str, int] = {}
    tcp = _tcp_sockets(pid)
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                kind = tcp.get(target[8:-1], "socket")
            else:
                kind = target.split(":[", 1)[0] if target.startswith("pipe:") else target
            kinds[kind] = kinds.get(kind, 0) + 1
    return dict(sorted(kinds.items(), key=lambda kv: -kv[1]))


def mapping_rss(pid: int, size: int) -> int:
    """Resident bytes of the anonymous mapping(s) of ``size`` bytes (up to a few pages more:
    the allocator's header) in ``pid``: the staging pool."""
    total = 0
    current_match = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if not head:
            continue
        if "-" in head[0] and not head[0].endswith(":"):
            start, end = (int(x, 16) for x in head[0].split("-"))
            anonymous = len(head) < 6
            current_match = anonymous and size <= end - start <= size + 16 * PAGE
        elif current_match and head[0] == "Rss:":
            total += int(head[1]) * 1024
    return total


def sample(pid: int, t: float, staging_pool_bytes: int) -> Sample | None:
    try:
        rss, shmem = status_bytes(pid, "VmRSS", "RssShmem")
        if rss == 0:  # exiting (a zombie has no VmRSS): no sample
            return None
        return Sample(t, rss, mapping_rss(pid, staging_pool_bytes), fd_count(pid), shmem)
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None


def shm_maps(pid: int) -> set[str]:
    """Names of the /dev/shm files ``pid`` has mapped (" (deleted)" kept: an unlinked file)."""
    names = set()
    try:
        text = Path(f"/proc/{pid}/maps").read_text()
    except FileNotFoundError:
        return names
    for line in text.splitlines():
        if "/dev/shm/" in line:
            names.add(line.split("/dev/shm/", 1)[1])
    return names
