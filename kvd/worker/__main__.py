"""``python -m kvd.worker``: the data-plane worker process ``kvd serve`` starts (kvd.core.workers).

Not a command for people: it serves one channel fd it inherited from the control process and
exits when that channel ends. It configures its own log handler (its stderr is the daemon's, so
systemd's journal gets both), turns on faulthandler (a crash in NIXL or UCX leaves a Python
stack in the log, and so does a hang the control process kills it for) and asks the kernel
to kill it if the control process dies first.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import ctypes.util
import faulthandler
import gc
import logging
import os
import signal
import socket
import sys

from kvd.dataplane_protocol import STACKS_SIGNAL

PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


async def _serve(fd: int, orders_fd: int | None, prefault: bool) -> None:
    from kvd.worker.service import WorkerService  # noqa: PLC0415 - after logging is set up

    sock = socket.socket(fileno=fd)
    orders = socket.socket(fileno=orders_fd) if orders_fd is not None else None
    reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 24)
    await WorkerService(reader, writer, prefault=prefault, orders=orders).serve()
    writer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvd.worker", description=__doc__)
    parser.add_argument("--channel-fd", type=int, required=True)
    parser.add_argument("--orders-fd", type=int, default=None, help="READ orders, read by the NIXL thread")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--switch-interval", type=float, default=0.0002)
    parser.add_argument("--parent-pid", type=int, default=0)
    parser.add_argument("--no-prefault", dest="prefault", action="store_false")
    args = parser.parse_args(argv)
    if args.parent_pid:
        _die_with_parent(args.parent_pid)
    faulthandler.enable()
    # The control process asks for every thread's stack before it kills a worker as hung: the
    # log then names the NIXL call its NIXL thread was in (written from the signal handler,
    # so a thread blocked in C, the GIL held or not, does not stop it).
    faulthandler.register(STACKS_SIGNAL, all_threads=True, chain=False)
    logging.basicConfig(
        level=args.log_level,
        format=f"%(asctime)s %(levelname)s kvd-worker[{os.getpid()}] %(name)s: %(message)s",
        stream=sys.stderr,
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the whole group: the control side decides
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # systemd's stop: the control side closes the channel
    sys.setswitchinterval(args.switch_interval)
    import torch  # noqa: F401, PLC0415 - imported before hello: a spare worker is ready to start at once
    from nixl import _api  # noqa: F401, PLC0415

    # What is loaded by now (torch, NIXL: most of the process's objects) lives as long as the
    # process: frozen, the collector never traverses it again. A full collection walked all of
    # it, ~10 ms of CPU each, landing on whatever call allocated at that moment (a first pull's
    # metadata load, say).
    gc.freeze()
    asyncio.run(_serve(args.channel_fd, args.orders_fd, args.prefault))
    return 0


if __name__ == "__main__":
    sys.exit(main())
