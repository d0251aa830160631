"""systemd's notify protocol (sd_notify), in a few lines of Python instead of a libsystemd binding.

A ``Type=notify`` unit is "started" only when the daemon says ``READY=1``, so ``After=kvd.service``
really waits for every listener. ``WATCHDOG=1`` is sent by a task *on the event loop* every half
of ``WatchdogSec=``: if the loop wedges (a blocking call, a deadlock) the pings stop and systemd
restarts the daemon, which a ping from a separate thread would never notice. ``STATUS=`` lines
show in ``systemctl status kvd``; ``STOPPING=1`` tells systemd a SIGTERM is being honoured.

The protocol: one ``AF_UNIX`` datagram per message, ``KEY=VALUE`` lines, to the path in
``NOTIFY_SOCKET`` (``@name``: the abstract namespace). Without a socket every call is a no-op.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable

logger = logging.getLogger(__name__)


class Notifier:
    """Sends notify messages to one socket; never raises (systemd being away must not stop kvd)."""

    def __init__(self, notify_socket: str) -> None:
        self.address = "\0" + notify_socket[1:] if notify_socket.startswith("@") else notify_socket
        self.enabled = bool(notify_socket)
        self._sock: socket.socket | None = None
        self._warned = False

    def send(self, **fields: str | int) -> bool:
        """Send ``KEY=value`` lines (keyword names are upper-cased); True if the datagram went out."""
        if not self.enabled:
            return False
        payload = "\n".join(f"{key.upper()}={value}" for key, value in fields.items()).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(payload, self.address)
        except OSError as exc:
            if not self._warned:  # once: a missing socket would otherwise log every watchdog tick
                logger.warning("cannot notify systemd at %s: %s", self.address.lstrip("\0"), exc.strerror or exc)
                self._warned = True
            return False
        return True

    def ready(self, status: str) -> bool:
        return self.send(ready=1, status=status, mainpid=os.getpid())

    def status(self, status: str) -> bool:
        return self.send(status=status)

    def stopping(self, status: str) -> bool:
        return self.send(stopping=1, status=status)

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None


async def watchdog(notifier: Notifier, period_s: float, status: Callable[[], str] | None = None) -> None:
    """Ping ``WATCHDOG=1`` every ``period_s / 2`` from the event loop, until cancelled.

    Each ping carries the current ``STATUS=`` line when ``status`` is given, so
    ``systemctl status`` shows live counts without a separate timer.
    """
    interval = period_s / 2
    while True:
        fields: dict[str, str | int] = {"watchdog": 1}
        if status is not None:
            try:
                fields["status"] = status()
            except Exception:
                logger.debug("status line for the watchdog ping failed", exc_info=True)
        notifier.send(**fields)
        await asyncio.sleep(interval)
