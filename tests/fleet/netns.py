"""The fleet's network: a hub namespace with a bridge, one namespace per node joined to it by a veth.

Everything lives in namespaces the run creates (named ``kvdf-<pid>-...``): no address, link or
route is ever added to the machine's own namespace, since every link is created inside the hub
with its peer end put straight into the node's namespace. The orchestrator itself moves into the
hub namespace (:func:`enter`) so that it reaches every node through the bridge, as a router on
the network would. :func:`clean_leftovers` removes what a run that died without cleaning up left
behind (its pid is in every name).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

logger = logging.getLogger(__name__)

PREFIX = "kvdf"
SUBNET = "10.252.0"
HUB_ADDR = f"{SUBNET}.254"
CLONE_NEWNET = 0x40000000
_NS_RE = re.compile(rf"^{PREFIX}-(\d+)-")
SHM_DIR = Path("/dev/shm")
KEPT = "KEPT"  # in a run folder: the run ended and kept it on purpose; later runs leave it alone


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS`` (raises with its stderr when ``check`` and it fails)."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
    return done


def tc(namespace: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``tc ARGS`` inside ``namespace``."""
    done = subprocess.run(["ip", "netns", "exec", namespace, "tc", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)} in {namespace} failed: {done.stderr.strip()}")
    return done


def _apt_install(*packages: str) -> None:
    subprocess.run(["apt-get", "update", "-qq"], check=False, capture_output=True)
    subprocess.run(
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages],
        check=True,
        capture_output=True,
        env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
    )


def ensure_tools() -> None:
    """Install what the faults need when missing: iproute2 (ip, tc), nftables (nft, for packet
    loss where the kernel has no netem qdisc)."""
    missing = [
        pkg for tool, pkg in (("ip", "iproute2"), ("tc", "iproute2"), ("nft", "nftables")) if not shutil.which(tool)
    ]
    if missing:
        logger.warning("installing %s with apt-get", sorted(set(missing)))
        _apt_install(*sorted(set(missing)))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_leftovers() -> list[str]:
    """Remove namespaces, shm files and run folders of fleet runs whose process is gone.

    The processes still inside such a namespace are that run's daemons and engines: they are
    killed by pid first (a namespace outlives its name while a process is in it).
    """
    removed: list[str] = []
    listing = ip("netns", "list", check=False).stdout.split()
    for name in listing:
        match = _NS_RE.match(name)
        if match is None or _alive(int(match.group(1))):
            continue
        pids = ip("netns", "pids", name, check=False).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        ip("netns", "del", name, check=False)
        removed.append(name)
    for path in SHM_DIR.glob(f"{PREFIX}-*"):
        match = _NS_RE.match(path.name)
        if match is not None and not _alive(int(match.group(1))):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            removed.append(str(path))
    for path in Path("/tmp").glob("kvd-fleet-*"):
        tail = path.name.rsplit("-", 1)[-1]
        if (path / KEPT).exists():  # a run that ended and kept its logs (failed, or --keep): the operator's
            continue
        if tail.isdigit() and not _alive(int(tail)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    return removed


@dataclasses.dataclass
class Network:
    """A hub namespace with bridge ``kfbr`` and ``nodes`` node namespaces ``...-n<i>``."""

    nodes: int
    owner_pid: int = dataclasses.field(default_factory=os.getpid)
    created: list[str] = dataclasses.field(default_factory=list)
    has_netem: bool | None = None  # learned at the first slow-link fault

    @property
    def hub(self) -> str:
        return f"{PREFIX}-{self.owner_pid}-hub"

    def node_ns(self, i: int) -> str:
        return f"{PREFIX}-{self.owner_pid}-n{i}"

    @staticmethod
    def node_dev(i: int) -> str:
        """The node's end of its link (inside the node's namespace): UCX_NET_DEVICES."""
        return f"kfn{i}"

    @staticmethod
    def hub_dev(i: int) -> str:
        """The bridge's end of node ``i``'s link (inside the hub)."""
        return f"kfh{i}"

    @staticmethod
    def node_addr(i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def create(self) -> None:
        """Make the hub, the bridge and every node's namespace and link; all up, addresses set."""
        ip("netns", "add", self.hub)
        self.created.append(self.hub)
        ip("-n", self.hub, "link", "add", "kfbr", "type", "bridge")
        ip("-n", self.hub, "addr", "add", f"{HUB_ADDR}/24", "dev", "kfbr")
        ip("-n", self.hub, "link", "set", "kfbr", "up")
        ip("-n", self.hub, "link", "set", "lo", "up")
        for i in range(self.nodes):
            ns = self.node_ns(i)
            ip("netns", "add", ns)
            self.created.append(ns)
            ip(
                "-n",
                self.hub,
                "link",
                "add",
                self.hub_dev(i),
                "type",
                "veth",
                "peer",
                "name",
                self.node_dev(i),
                "netns",
                ns,
            )
            ip("-n", self.hub, "link", "set", self.hub_dev(i), "master", "kfbr")
            ip("-n", self.hub, "link", "set", self.hub_dev(i), "up")
            ip("-n", ns, "addr", "add", f"{self.node_addr(i)}/24", "dev", self.node_dev(i))
            ip("-n", ns, "link", "set", self.node_dev(i), "up")
            ip("-n", ns, "link", "set", "lo", "up")

    def cut(self, i: int) -> None:
        """Cut node ``i`` off the bridge (its link goes down at the bridge's end)."""
        ip("-n", self.hub, "link", "set", self.hub_dev(i), "down")

    def heal(self, i: int) -> None:
        ip("-n", self.hub, "link", "set", self.hub_dev(i), "up")

    def degrade(self, i: int, delay_ms: int, loss_pct: float) -> str:
        """A slow, lossy link on both of its ends; returns how it was made.

        ``tc netem`` (delay with jitter, random loss) where the kernel has it; else a token bucket
        (``tbf``: a slow link whose queue delays packets) and random drops by nftables.
        """
        spec = ["delay", f"{delay_ms}ms", f"{max(1, delay_ms // 4)}ms", "loss", f"{loss_pct}%"]
        ends = ((self.hub, self.hub_dev(i)), (self.node_ns(i), self.node_dev(i)))
        if self.has_netem is not False:
            done = tc(self.hub, "qdisc", "replace", "dev", self.hub_dev(i), "root", "netem", *spec, check=False)
            self.has_netem = done.returncode == 0
            if self.has_netem:
                tc(self.node_ns(i), "qdisc", "replace", "dev", self.node_dev(i), "root", "netem", *spec)
                return f"netem delay {delay_ms}ms loss {loss_pct}%"
        rate_mbit = max(2, 2000 // max(delay_ms, 1))  # the slower, the longer packets queue
        for ns, dev in ends:
            tc(
                ns,
                "qdisc",
                "replace",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                f"{rate_mbit}mbit",
                "burst",
                "16kb",
                "latency",
                f"{4 * delay_ms}ms",
            )
        per_mille = int(loss_pct * 10)
        rules = (
            "table inet kvdfleet {\n"
            f"  chain out {{ type filter hook output priority 0; policy accept; "
            f'oifname "{self.node_dev(i)}" numgen random mod 1000 < {per_mille} drop; }}\n'
            f"  chain in {{ type filter hook input priority 0; policy accept; "
            f'iifname "{self.node_dev(i)}" numgen random mod 1000 < {per_mille} drop; }}\n'
            "}\n"
        )
        subprocess.run(
            ["ip", "netns", "exec", self.node_ns(i), "nft", "-f", "-"],
            input=rules,
            text=True,
            check=True,
            capture_output=True,
        )
        return f"tbf {rate_mbit}mbit (queue up to {4 * delay_ms}ms) + nft drop {loss_pct}%"

    def restore(self, i: int) -> None:
        tc(self.hub, "qdisc", "del", "dev", self.hub_dev(i), "root", check=False)
        tc(self.node_ns(i), "qdisc", "del", "dev", self.node_dev(i), "root", check=False)
        subprocess.run(
            ["ip", "netns", "exec", self.node_ns(i), "nft", "delete", "table", "inet", "kvdfleet"], capture_output=True
        )

    def netns_prefix(self, i: int) -> tuple[str, ...]:
        """Command prefix that runs a program inside node ``i``'s namespace (exec: same pid)."""
        return ("ip", "netns", "exec", self.node_ns(i))

    def destroy(self) -> None:
        """Delete every namespace this run made (their links and the bridge go with them)."""
        for name in reversed(self.created):
            for pid in ip("netns", "pids", name, check=False).stdout.split():
                if pid.isdigit() and int(pid) != os.getpid():  # the orchestrator lives in the hub
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
            ip("netns", "del", name, check=False)
        self.created.clear()


def enter(namespace: str) -> None:
    """Move the calling thread (call it before any other thread exists) into ``namespace``.

    Threads started afterwards (grpc's, asyncio's executors) inherit it; Python 3.11 has no
    ``os.setns``, so this calls libc's.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {namespace}: {os.strerror(err)}")
    finally:
        os.close(fd)
