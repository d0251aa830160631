"""The control path's floor: the hops a pull crosses, with nothing of kvd in them.

A 2 MiB pull costs a few ms more than the raw NIXL read of its bytes. How much of that is kvd's
own work, and how much the shape of the path (Python processes talking over sockets)? This
section answers by running the same hops with no logic at all, beside the pulls, in the same run:

    client --one frame on a Unix socket--> reader --one frame on TCP--> holder --the same frame
    back--> reader --one frame on a Unix socket--> worker --the frame back--> reader --one frame
    back on the client's socket--> client

which is a pull's critical path in kvd: its start on the engine stream (``start_pulls``, on the
daemon's framed socket: kvd_client._frames), the holder's admission (``PreparePull`` on the peer
stream, on the holder's framed port: kvd.server.peer_frames), the READ order to the data-plane
worker and its reply, the completion on the engine stream. Each process is Python with an asyncio
loop, as kvd's are; the messages carry ~200 bytes in length-prefixed frames and nobody parses
them; there are no bytes to copy, no TLS and no servicer. So what it measures is a floor: no
control path of this shape can cost less on the machine. The bench prints it beside the goals
(:mod:`kvd.bench.goals`). (Until the engine and peer streams left gRPC, the floor's first two hops
were gRPC streams too, as kvd's were: docs/performance.md keeps those figures.)

That is the floor of a design with one message per pull on every hop. Its second mode is the
floor of a design with one message per engine *step* on every hop: the client's message carries
a step's B pulls (B entries of the same ~200 bytes), and the reader forwards it as one admission
message to the holder, one frame (B orders) to the worker and one completion message (B
completions) to the client, whose answers are as large. The processes are the same: they never
look inside a message, so a step is a pull with a B-times larger message. Steps run one after the
other, as an engine's do.

Each role runs as ``python -m kvd.bench.floor ROLE ...`` and prints one ``ready`` line; it exits
when its standard input closes (the bench holds the other end), so none outlives the bench.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import functools
import itertools
import os
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import IO, Any, ParamSpec

PAYLOAD = b"p" * 192  # about the size of a StartPull / PreparePull message
_FRAME = struct.Struct("<I")
READY_TIMEOUT_S = 30.0
_Params = ParamSpec("_Params")


class FloorFailure(Exception):
    """The floor could not be measured (a role did not start, died, or did not answer): the bench
    reports it as not measured and goes on, since kvd's own figures do not depend on it."""


def _exit_with_parent() -> None:
    """End this process when the bench's end of its standard input closes (the bench ended)."""

    def watch() -> None:
        with contextlib.suppress(OSError):
            while sys.stdin.buffer.read(1):
                pass
        os._exit(0)

    threading.Thread(target=watch, name="kvd-floor-parent", daemon=True).start()


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer every frame of a connection with itself."""
    with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
        while True:
            header = await reader.readexactly(_FRAME.size)
            body = await reader.readexactly(_FRAME.unpack(header)[0])
            writer.write(header + body)


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    return await reader.readexactly(_FRAME.unpack(await reader.readexactly(_FRAME.size))[0])


async def _holder() -> None:
    """Answers every message of the peer stream with itself: the admission with no admission."""
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    print(f"ready {server.sockets[0].getsockname()[1]}", flush=True)
    await server.serve_forever()


async def _worker(socket_path: str) -> None:
    """Answers every frame with itself: the READ order with no READ."""
    server = await asyncio.start_unix_server(_echo, socket_path)
    print("ready", flush=True)
    await server.serve_forever()


async def _reader(holder_address: str, worker_path: str, socket_path: str) -> None:
    """A pull with nothing but its hops: each frame of the engine's connection starts one; the
    pull's task sends one frame to the holder and waits for its answer, one frame to the worker
    and waits for its answer, and sends the request back to the engine. Replies come back in
    order on each connection, so a FIFO of waiters matches them (as kvd's channels match by id)."""
    loop = asyncio.get_running_loop()
    host, _, port = holder_address.rpartition(":")
    holder_in, holder_out = await asyncio.open_connection(host, int(port))
    worker_in, worker_out = await asyncio.open_unix_connection(worker_path)
    holder_waiters: collections.deque[asyncio.Future[bytes]] = collections.deque()
    worker_waiters: collections.deque[asyncio.Future[bytes]] = collections.deque()

    async def answers(reader: asyncio.StreamReader, waiters: collections.deque[asyncio.Future[bytes]]) -> None:
        while True:
            body = await _read_frame(reader)
            waiters.popleft().set_result(body)

    async def ask(
        writer: asyncio.StreamWriter, waiters: collections.deque[asyncio.Future[bytes]], message: bytes
    ) -> None:
        answer: asyncio.Future[bytes] = loop.create_future()
        waiters.append(answer)
        writer.write(_FRAME.pack(len(message)) + message)
        await answer

    background = [
        asyncio.create_task(answers(holder_in, holder_waiters)),
        asyncio.create_task(answers(worker_in, worker_waiters)),
    ]
    running: set[asyncio.Task[None]] = set()

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async def pull(request: bytes) -> None:
            await ask(holder_out, holder_waiters, request)
            await ask(worker_out, worker_waiters, request)
            writer.write(_FRAME.pack(len(request)) + request)

        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                task = asyncio.create_task(pull(await _read_frame(reader)))
                running.add(task)
                task.add_done_callback(running.discard)

    server = await asyncio.start_unix_server(engine, socket_path)
    print("ready", flush=True)
    try:
        await server.serve_forever()
    finally:
        for task in background:
            task.cancel()


class FloorProcesses:
    """The three processes of the floor (holder, worker, reader), started and ended together."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.reader_path = ""  # the reader's engine socket, once started

    def start(self) -> None:
        worker_path, reader_path = str(self.workdir / "floor-worker.sock"), str(self.workdir / "floor-reader.sock")
        port = self._spawn("holder")
        self._spawn("worker", "--socket", worker_path)
        self._spawn("reader", "--holder", f"127.0.0.1:{port}", "--worker", worker_path, "--socket", reader_path)
        self.reader_path = reader_path

    def _spawn(self, role: str, *args: str) -> str:
        """Start ``role`` and wait for its ``ready`` line; what follows ``ready`` (the holder's port)."""
        process = subprocess.Popen(
            [sys.executable, "-m", "kvd.bench.floor", role, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        self.processes[role] = process
        assert process.stdout is not None
        line = _read_line(process.stdout, READY_TIMEOUT_S)
        if not line.startswith("ready"):
            raise RuntimeError(f"the floor's {role} did not start (exit {process.poll()}, said {line!r})")
        return line[len("ready") :].strip()

    def pids(self) -> dict[str, int]:
        return {role: process.pid for role, process in self.processes.items()}

    def stop(self) -> None:
        for process in self.processes.values():
            with contextlib.suppress(OSError):
                assert process.stdin is not None
                process.stdin.close()  # the role exits on it
        for process in self.processes.values():
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _read_line(stream: IO[bytes], timeout_s: float) -> str:
    """One line from a child's stdout, or "" after ``timeout_s`` (a child that never starts must
    not hang the bench)."""
    box: list[bytes] = []
    reader = threading.Thread(target=lambda: box.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    return box[0].decode(errors="replace").strip() if box else ""


def _as_floor_failure(
    run: Callable[_Params, Awaitable[dict[str, Any]]],
) -> Callable[_Params, Awaitable[dict[str, Any]]]:
    """``run``, with what can go wrong in the floor's processes and channels as a FloorFailure."""

    @functools.wraps(run)
    async def guarded(*args: _Params.args, **kwargs: _Params.kwargs) -> dict[str, Any]:
        try:
            return await run(*args, **kwargs)
        except (OSError, RuntimeError, TimeoutError, asyncio.IncompleteReadError) as exc:
            raise FloorFailure(str(exc) or type(exc).__name__) from exc

    return guarded


@_as_floor_failure
async def measure(
    workdir: Path,
    one_at_a_time: int,
    in_flight: int,
    pulls: int,
    cpu_seconds: Callable[[int], float],
    progress: Callable[[str, float], None],
    step_pulls: int = 0,
    steps: int = 0,
) -> dict[str, Any]:
    """Run the hops: ``one_at_a_time`` pulls one after the other (their latencies), then ``pulls``
    with ``in_flight`` at once (pulls/s, latencies, and each process's CPU over that window;
    ``client`` is this process); then, where ``step_pulls`` and ``steps`` are set, ``steps``
    engine steps of ``step_pulls`` pulls one after the other, one message per step on every hop
    (``step``: its pulls/s, each step's latency, each process's CPU). Anything that keeps the
    floor from running is a FloorFailure."""
    floor = FloorProcesses(workdir)
    step: dict[str, Any] = {}
    try:
        floor.start()
        completions, starts = await asyncio.open_unix_connection(floor.reader_path)
        waiting: dict[bytes, asyncio.Future[None]] = {}
        loop = asyncio.get_running_loop()
        numbers = itertools.count()

        async def deliver() -> None:
            while True:
                waiting.pop(await _read_frame(completions)).set_result(None)

        delivering = asyncio.create_task(deliver())

        async def one(entries: int = 1) -> float:
            """A pull (``entries`` 1) or a step of ``entries`` pulls: one message per hop, the
            completion back on the client's stream, each carrying ``entries`` entries."""
            request = PAYLOAD * entries + str(next(numbers)).encode()
            done = loop.create_future()
            waiting[request] = done
            t0 = time.perf_counter()
            starts.write(_FRAME.pack(len(request)) + request)
            await asyncio.wait_for(done, 30)
            return time.perf_counter() - t0

        pids = floor.pids()

        async def window(run: Callable[[], Awaitable[list[float]]]) -> tuple[list[float], float, dict[str, float]]:
            """``run``'s latencies, its wall time and each process's CPU seconds over it."""
            cpu0 = {role: cpu_seconds(pid) for role, pid in pids.items()}
            client0 = time.process_time()
            t0 = time.perf_counter()
            latencies = await run()
            wall = time.perf_counter() - t0
            client = time.process_time() - client0
            cpu = {role: cpu_seconds(pid) - cpu0[role] for role, pid in pids.items()}
            cpu["client"] = client
            cpu["all"] = sum(cpu.values())
            return latencies, wall, cpu

        try:
            for _ in range(min(100, one_at_a_time)):  # warm every channel and code path
                await one()
            single = []
            for n in range(one_at_a_time):
                single.append(await one())
                if n % 50 == 0:
                    progress("floor", 0.4 * n / max(1, one_at_a_time))
            latencies, wall, cpu = await window(
                lambda: _in_flight(one, in_flight, pulls, lambda done: progress("floor", 0.4 + 0.4 * done))
            )
            if step_pulls > 0 and steps > 0:
                for _ in range(min(20, steps)):  # warm the larger messages' path
                    await one(step_pulls)

                async def run_steps() -> list[float]:
                    out = []
                    for n in range(steps):
                        out.append(await one(step_pulls))
                        progress("floor (steps)", 0.8 + 0.2 * (n + 1) / steps)
                    return out

                step_s, step_wall, step_cpu = await window(run_steps)
                step = {
                    "batch": step_pulls,
                    "steps": steps,
                    "pulls": steps * step_pulls,
                    "wall_s": step_wall,
                    "step_s": step_s,
                    "cpu_s": step_cpu,
                }
        finally:
            delivering.cancel()
            with contextlib.suppress(asyncio.CancelledError, asyncio.IncompleteReadError, ConnectionError):
                await delivering
            starts.close()
    finally:
        floor.stop()
    return {
        "one_at_a_time_s": single,
        "in_flight": in_flight,
        "pulls": pulls,
        "wall_s": wall,
        "latency_s": latencies,
        "cpu_s": cpu,
        **({"step": step} if step else {}),
    }


async def _in_flight(one: Callable[[], Any], in_flight: int, pulls: int, tick: Callable[[float], None]) -> list[float]:
    """``pulls`` calls of ``one`` with ``in_flight`` running at a time; their latencies."""
    latencies: list[float] = []
    remaining = iter(range(pulls))

    async def lane() -> None:
        for n in remaining:
            latencies.append(await one())
            if n % 200 == 0:
                tick(n / pulls)

    await asyncio.gather(*(lane() for _ in range(in_flight)))
    return latencies


def _arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m kvd.bench.floor", description=__doc__.split("\n")[0])
    parser.add_argument("role", choices=("holder", "worker", "reader"))
    parser.add_argument("--socket", default="")
    parser.add_argument("--holder", default="")
    parser.add_argument("--worker", default="")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _arguments(sys.argv[1:] if argv is None else argv)
    _exit_with_parent()
    if args.role == "holder":
        asyncio.run(_holder())
    elif args.role == "worker":
        asyncio.run(_worker(args.socket))
    else:
        asyncio.run(_reader(args.holder, args.worker, args.socket))
    return 0


if __name__ == "__main__":
    sys.exit(main())
