"""The engine stream over the daemon's framed socket (``<unix_socket>.stream``), real daemons.

Engines use it by default where the daemon serves it: the same stream as gRPC's EngineStream
(pulls on it move exact bytes, commits and post-forward signals go up, a second stream supersedes
the first), on a file with the gRPC socket's mode. Where it is not served (``engine_stream_socket
= false``, or ``framed=False``) the stream runs over gRPC, unchanged. Hostile bytes end that stream
alone with a precise status (its exact class in the end frame) and change nothing: the daemon
serves on. A daemon that stops ends its framed streams UNAVAILABLE.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import struct
import time

import pytest
from kvtest import ShmEngine, engine_pair, eventually, small_spec
from test_stream_pulls import Heard, assert_exact, hold_each, pull, wait_takes_pulls

from kvd_client import errors, pull_results
from kvd_client._frames import MAGIC, MAX_FRAME_BYTES, encode, end_error, stream_socket_path
from kvd_client.v1 import common_pb2, engine_pb2

pytestmark = pytest.mark.integration


def stream_path(daemon: object) -> str:
    path = stream_socket_path(daemon.unix_target)  # type: ignore[attr-defined]
    assert path is not None
    return path


def raw_stream(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(15)
    sock.connect(path)
    return sock


def read_frames(sock: socket.socket) -> list[engine_pb2.DaemonFrame]:
    """Every frame the daemon sends until it closes the connection."""
    data = b""
    while chunk := sock.recv(1 << 16):
        data += chunk
    frames = []
    while data:
        (length,) = struct.unpack(">I", data[:4])
        frames.append(engine_pb2.DaemonFrame.FromString(data[4 : 4 + length]))
        data = data[4 + length :]
    return frames


def ended_with(sock: socket.socket) -> errors.KvdError | None:
    frames = read_frames(sock)
    assert frames and frames[-1].WhichOneof("kind") == "end", frames
    return end_error(frames[-1].end)


@contextlib.contextmanager
def one_engine(target: str, engine_id: str = "alone"):  # type: ignore[no-untyped-def]
    engine = ShmEngine(target, engine_id, small_spec(num_blocks=8))
    try:
        engine.register()
        yield engine
    finally:
        engine.close()


def hello(engine_id: str = "reader", tp_rank: int = 0) -> engine_pb2.EngineMessage:
    return engine_pb2.EngineMessage(
        hello=engine_pb2.EngineHello(engine_id=engine_id, tp_rank=tp_rank, starts_pulls=True, accepts_batches=True)
    )


@pytest.mark.parametrize("transports", ["default", "tcp"])
def test_engine_streams_run_framed_and_their_pulls_move_exact_bytes(spawn_daemon, transports: str) -> None:
    env = {**os.environ, "UCX_TLS": "tcp"} if transports == "tcp" else None
    a, b = spawn_daemon(name="a", env=env), spawn_daemon(name="b", env=env)
    spec = small_spec(num_blocks=48)
    with engine_pair(a.unix_target, b.unix_target, spec, seed=31) as (holder, reader):
        stream = reader.client.open_engine_stream("reader", 0)
        try:
            wait_takes_pulls(stream)
            assert stream.framed, "the daemon serves its framed socket: the client uses it"
            assert stream.send_commit("req-x", 5) and stream.send_post_forward(1, ["req-x"])
            rids = [f"req-{i}" for i in range(5)]
            held, local, params = hold_each(holder, rids)
            seq = stream.send_start_pulls([pull(rid, local[rid], params[rid]) for rid in rids])
            heard = Heard(stream)
            heard.until(lambda: seq in heard.answers() and set(rids) <= set(heard.finished()), what="every pull")
            transfer_ids = pull_results(heard.answers()[seq][1], len(rids))
            for rid, transfer_id in zip(rids, transfer_ids, strict=True):
                assert isinstance(transfer_id, str)
                assert reader.client.get_transfer(transfer_id).state == common_pb2.TRANSFER_STATE_DONE
                assert_exact(holder, reader, held[rid], local[rid], rid)
            assert not stream.closed and stream.error is None
        finally:
            stream.close()
        assert stream.closed and stream.error is None, "a clean close is not an error"


def test_without_the_framed_socket_the_stream_runs_over_grpc(spawn_daemon) -> None:
    """A daemon that serves no framed socket (engine_stream_socket = false; an older daemon has
    none either), and a client that asks for gRPC: the same stream, over gRPC."""
    a = spawn_daemon(name="a", env={**os.environ, "KVD_ENGINE_STREAM_SOCKET": "false"})
    b = spawn_daemon(name="b")
    assert not os.path.exists(stream_path(a)) and os.path.exists(stream_path(b))
    spec = small_spec(num_blocks=48)
    with engine_pair(b.unix_target, a.unix_target, spec, seed=32) as (holder, reader):
        for framed in (True, False):
            stream = reader.client.open_engine_stream("reader", 0, framed=framed)
            try:
                wait_takes_pulls(stream)
                assert not stream.framed
                rid = f"req-grpc-{framed}"
                held, local, params = hold_each(holder, [rid])
                seq = stream.send_start_pulls([pull(rid, local[rid], params[rid])])
                heard = Heard(stream)
                heard.until(
                    lambda rid=rid, seq=seq, heard=heard: seq in heard.answers() and rid in heard.finished(),
                    what="the pull",
                )
                assert_exact(holder, reader, held[rid], local[rid], rid)
            finally:
                stream.close()
            assert stream.error is None
    with one_engine(b.unix_target) as engine:
        stream = engine.client.open_engine_stream("alone", 0, framed=False)
        try:
            wait_takes_pulls(stream)
            assert not stream.framed, "framed=False keeps the stream on gRPC"
        finally:
            stream.close()


def test_the_framed_socket_has_the_grpc_sockets_owner_and_mode(spawn_daemon) -> None:
    a = spawn_daemon(name="a")
    grpc_socket, framed_socket = os.stat(a.unix_socket), os.stat(stream_path(a))
    assert stat.S_ISSOCK(framed_socket.st_mode)
    assert stat.S_IMODE(framed_socket.st_mode) == stat.S_IMODE(grpc_socket.st_mode) == 0o600
    assert (framed_socket.st_uid, framed_socket.st_gid) == (grpc_socket.st_uid, grpc_socket.st_gid)


HOSTILE = {
    "wrong magic": (b"GET / HTTP/1.1\r\n", errors.InvalidArgument, "not a kvd engine stream"),
    "a frame over the limit": (MAGIC + struct.pack(">I", MAX_FRAME_BYTES + 1), errors.InvalidArgument, "over the"),
    "bytes that are no EngineMessage": (
        MAGIC + struct.pack(">I", 6) + b"\xff\xff\xff\xff\xff\xff",
        errors.InvalidArgument,
        "malformed kvd.v1.EngineMessage",
    ),
    "a commit before the hello": (
        MAGIC + encode(engine_pb2.EngineMessage(commit=engine_pb2.Commit(request_id="r", committed_tokens=1))),
        errors.InvalidArgument,
        "first message of an engine stream must be hello",
    ),
    "a hello of an engine nobody registered": (MAGIC + encode(hello("nobody")), errors.UnknownEngine, "nobody"),
    "a stream cut inside a frame": (MAGIC + struct.pack(">I", 100) + b"\x0a", errors.InvalidArgument, "inside a frame"),
    "a stream cut inside a frame's length": (MAGIC + b"\x00\x00", errors.InvalidArgument, "inside a frame's length"),
    "an oversized engine id": (
        MAGIC + encode(hello("e" * 5000)),
        errors.InvalidArgument,
        "at most 4096 are accepted",
    ),
}


def test_hostile_bytes_end_that_stream_alone_with_a_precise_status_and_change_nothing(spawn_daemon) -> None:
    a, b = spawn_daemon(name="a"), spawn_daemon(name="b")
    spec = small_spec(num_blocks=48)
    with engine_pair(a.unix_target, b.unix_target, spec, seed=33) as (holder, reader):
        good = reader.client.open_engine_stream("reader", 0)
        try:
            wait_takes_pulls(good)
            for case, (payload, cls, words) in HOSTILE.items():
                with raw_stream(stream_path(b)) as sock:
                    sock.sendall(payload)
                    sock.shutdown(socket.SHUT_WR)
                    error = ended_with(sock)
                assert type(error) is cls and words in error.message, (case, error)
            # The daemon serves on, and the engine's own stream was never touched.
            assert good.framed and not good.closed and good.error is None
            rid = "req-after"
            held, local, params = hold_each(holder, [rid])
            seq = good.send_start_pulls([pull(rid, local[rid], params[rid])])
            heard = Heard(good)
            heard.until(lambda: seq in heard.answers() and rid in heard.finished(), what="a pull after hostile bytes")
            assert_exact(holder, reader, held[rid], local[rid], rid)
            assert reader.client.get_status().serving
        finally:
            good.close()


def test_a_second_stream_supersedes_the_first_and_a_vanished_engine_leaves_the_daemon_serving(spawn_daemon) -> None:
    a, b = spawn_daemon(name="a"), spawn_daemon(name="b")
    spec = small_spec(num_blocks=48)
    with engine_pair(a.unix_target, b.unix_target, spec, seed=34) as (holder, reader):
        # An engine that vanishes mid-stream (its process died): the connection just closes.
        with raw_stream(stream_path(b)) as sock:
            sock.sendall(MAGIC + encode(hello()))
            (length,) = struct.unpack(">I", sock.recv(4, socket.MSG_WAITALL))
            first = engine_pb2.DaemonFrame.FromString(sock.recv(length, socket.MSG_WAITALL))
            assert first.message.ready.takes_pulls
        first_stream = reader.client.open_engine_stream("reader", 0)
        wait_takes_pulls(first_stream)
        second = reader.client.open_engine_stream("reader", 0)
        try:
            wait_takes_pulls(second)
            assert eventually(lambda: first_stream.closed, True) is True, "a superseded stream ends"
            rid = "req-second"
            held, local, params = hold_each(holder, [rid])
            seq = second.send_start_pulls([pull(rid, local[rid], params[rid])])
            heard = Heard(second)
            heard.until(lambda: seq in heard.answers() and rid in heard.finished(), what="the pull")
            assert_exact(holder, reader, held[rid], local[rid], rid)
        finally:
            second.close()
            first_stream.close()


def test_a_daemon_that_stops_ends_its_framed_streams_unavailable(spawn_daemon) -> None:
    a = spawn_daemon(name="a")
    with one_engine(a.unix_target) as engine:
        stream = engine.client.open_engine_stream("alone", 0)
        wait_takes_pulls(stream)
        assert stream.framed
        assert a.terminate() == 0
        deadline = time.monotonic() + 20
        while not stream.closed:
            assert time.monotonic() < deadline, "the stream did not end with its daemon"
            time.sleep(0.01)
        assert isinstance(stream.error, errors.Unavailable), stream.error
        stream.close()
        engine.registered = False  # its daemon is gone


def test_the_asyncio_client_runs_framed_too(spawn_daemon) -> None:
    import asyncio

    from kvd_client.aio import AsyncKvdClient

    a = spawn_daemon(name="a")

    async def main() -> None:
        with one_engine(a.unix_target):
            async with AsyncKvdClient(a.unix_target) as client:
                stream = client.open_engine_stream("alone", 0)
                deadline = time.monotonic() + 10
                while not stream.takes_pulls:
                    assert not stream.closed and time.monotonic() < deadline, stream.error
                    await asyncio.sleep(0.005)
                assert stream.framed and stream.send_commit("r", 1)
                await stream.close()
                assert stream.error is None

    asyncio.run(main())
