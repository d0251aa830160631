"""The worker's sending end of the channel (kvd.worker.channel) on a real socketpair.

Frames from several threads at once arrive whole and each thread's in its order; a control
process that reads nothing for a while never blocks a sender (what the socket does not take
waits, later frames behind it, and the event loop drains it once the reader reads); a reader
that is gone makes sends drop silently; a closed writer sends nothing, and its duplicate fd is
closed while the channel's own socket stays open.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvd.dataplane_protocol import read_frame
from kvd.worker.channel import ChannelWriter
from kvd_client.errors import Internal

pytestmark = pytest.mark.timeout(60)

JOIN_S = 20.0  # a sender that has not returned by then waited for the reader: a failure


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    worker_end, control_end = socket.socketpair()
    worker_end.setblocking(False)
    yield worker_end, control_end
    for sock in (worker_end, control_end):
        sock.close()


_KEEP: list[asyncio.StreamWriter] = []  # a StreamWriter collected closes its transport and socket


async def _reader_of(sock: socket.socket) -> asyncio.StreamReader:
    reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 24)
    _KEEP.append(writer)
    return reader


def _start_senders(writer: ChannelWriter, senders: int, per_sender: int, payload: int) -> list[threading.Thread]:
    def send(sender: int) -> None:
        for seq in range(per_sender):
            block = np.full(payload, (sender * 31 + seq) % 251, dtype=np.uint8)
            writer.send(("msg", sender, seq, block))

    threads = [threading.Thread(target=send, args=(s,)) for s in range(senders)]
    for thread in threads:
        thread.start()
    return threads


def test_frames_from_many_threads_arrive_whole_and_each_threads_in_order(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    worker_end, control_end = pair
    senders, per_sender = 4, 300

    async def main() -> None:
        writer = ChannelWriter(worker_end, asyncio.get_running_loop())
        reader = await _reader_of(control_end)
        # 64 KiB out-of-band buffers: the socket's buffer fills, so partial writes and the
        # loop's draining are part of every run.
        threads = _start_senders(writer, senders, per_sender, 64 << 10)
        seen = {s: -1 for s in range(senders)}
        for _ in range(senders * per_sender):
            kind, sender, seq, block = await asyncio.wait_for(read_frame(reader), JOIN_S)
            assert kind == "msg" and seq == seen[sender] + 1
            seen[sender] = seq
            assert block.nbytes == 64 << 10 and (block == (sender * 31 + seq) % 251).all()
        for thread in threads:
            await asyncio.to_thread(thread.join, JOIN_S)
            assert not thread.is_alive()
        assert writer.queued_bytes == 0
        writer.close()

    asyncio.run(main())


def test_a_reader_that_reads_nothing_never_blocks_a_sender(pair: tuple[socket.socket, socket.socket]) -> None:
    worker_end, control_end = pair

    async def main() -> None:
        writer = ChannelWriter(worker_end, asyncio.get_running_loop())
        # 8 MiB from a thread while nobody reads: far more than the socket's buffer takes.
        threads = _start_senders(writer, 1, 128, 64 << 10)
        await asyncio.to_thread(threads[0].join, JOIN_S)
        assert not threads[0].is_alive(), "a send waited for the reader"
        assert writer.queued_bytes > 0  # the socket did not take it all: the rest waits in order
        reader = await _reader_of(control_end)
        for seq in range(128):
            _, _, got, block = await asyncio.wait_for(read_frame(reader), JOIN_S)
            assert got == seq and (block == seq % 251).all()
        assert writer.queued_bytes == 0
        writer.send(("after", 1))  # written directly again
        assert await asyncio.wait_for(read_frame(reader), JOIN_S) == ("after", 1)
        writer.close()

    asyncio.run(main())


def test_a_gone_reader_makes_sends_drop_and_close_leaves_the_channels_socket_open(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    worker_end, control_end = pair

    async def main() -> None:
        writer = ChannelWriter(worker_end, asyncio.get_running_loop())
        duplicate = writer._fd
        threads = _start_senders(writer, 1, 64, 64 << 10)  # some of it queued
        await asyncio.to_thread(threads[0].join, JOIN_S)
        control_end.close()  # the control process died
        for _ in range(50):
            writer.send(("late", np.zeros(64 << 10, np.uint8)))
            await asyncio.sleep(0)  # the loop's drain meets the broken socket too
        assert not threads[0].is_alive()
        writer.close()
        writer.close()  # twice is fine
        writer.send(("closed",))  # nothing, no error
        with pytest.raises(OSError):
            os.fstat(duplicate)  # the writer's own fd is closed ...
        assert worker_end.fileno() >= 0 and os.fstat(worker_end.fileno())  # ... the channel's is not

    asyncio.run(main())


def test_a_message_that_cannot_be_framed_raises_and_sends_nothing(pair: tuple[socket.socket, socket.socket]) -> None:
    worker_end, control_end = pair

    async def main() -> None:
        writer = ChannelWriter(worker_end, asyncio.get_running_loop())
        too_many: list[Any] = [np.zeros(1, np.uint8) for _ in range(2000)]
        with pytest.raises(Internal):
            writer.send(("big", too_many))
        writer.send(("small", 1))
        reader = await _reader_of(control_end)
        assert await asyncio.wait_for(read_frame(reader), JOIN_S) == ("small", 1)
        writer.close()

    asyncio.run(main())
