"""The control process <-> data-plane worker channel (kvd.dataplane_protocol): frames carry numpy
arrays out of band and intact, messages follow each other on a real stream, errors come back as
their exact class, and a corrupt header is refused instead of read. :class:`FrameBuffer` (bytes
read by a thread with no event loop) gives exactly what :func:`read_frame` gives, however the
bytes are cut.
"""

from __future__ import annotations

import asyncio
import pickle
import socket
from typing import Any

import numpy as np
import pytest

from kvd.dataplane_protocol import (
    BUFFER,
    CALL,
    HEADER,
    MAX_BODY,
    NOTIFS,
    REPLY,
    SETTLED,
    AgentIdentity,
    CudaIpcSpec,
    FrameBuffer,
    MappedRegion,
    MemoryKind,
    NixlRegion,
    RegionRequest,
    XferState,
    decode_error,
    encode_error,
    frame,
    read_frame,
)
from kvd_client import errors
from kvd_client.errors import Internal, KvdError, Unavailable


def _stream(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


def _bytes(message: tuple[Any, ...]) -> bytes:
    return b"".join(bytes(part) for part in frame(message))


def _decode(data: bytes, eof: bool = True) -> tuple[Any, ...]:
    async def go() -> tuple[Any, ...]:
        return await read_frame(_stream(data, eof))

    return asyncio.run(go())


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    readonly = np.arange(12, dtype=np.uint16).reshape(3, 4)
    readonly.flags.writeable = False
    return {
        "rows": rng.integers(0, 1 << 40, size=(1000, 3), dtype=np.int64),  # (addr, len, dev) descriptor rows
        "indices": np.arange(4096, dtype=np.int32)[::-1].copy(),
        "floats": rng.standard_normal((5, 7, 2)).astype(np.float32),
        "fortran": np.asfortranarray(rng.integers(0, 255, size=(6, 9), dtype=np.uint8)),
        "readonly": readonly,
        "empty": np.zeros((0, 3), dtype=np.int64),
    }


def test_the_header_is_what_the_docstring_says() -> None:
    assert HEADER.size == 12 and BUFFER.size == 8


def test_numpy_arrays_travel_out_of_band_and_arrive_intact_and_writable() -> None:
    arrays = _arrays()
    message = (CALL, 42, "prepare_table", ("peer-agent", arrays, "DRAM"))
    parts = frame(message)
    size, count = HEADER.unpack(bytes(parts[0]))
    body = bytes(parts[1])
    assert size == len(body)
    assert count == len(arrays)  # every contiguous array is a raw buffer: none is pickled into the body
    assert len(body) < 2000 < arrays["rows"].nbytes
    assert arrays["rows"].tobytes() not in body
    raw = [bytes(p) for p in parts[2:]]
    assert [BUFFER.unpack(raw[i])[0] for i in range(0, len(raw), 2)] == [len(r) for r in raw[1::2]]

    kind, call_id, op, (agent, got, mem_type) = _decode(b"".join(bytes(p) for p in parts))
    assert (kind, call_id, op, agent, mem_type) == (CALL, 42, "prepare_table", "peer-agent", "DRAM")
    assert got.keys() == arrays.keys()
    for name, sent in arrays.items():
        received = got[name]
        assert received.dtype == sent.dtype, name
        assert received.shape == sent.shape, name
        assert np.array_equal(received, sent), name
        if name == "readonly":  # pickle 5 keeps a read-only buffer read-only (NIXL takes either)
            assert not received.flags.writeable
            continue
        assert received.flags.writeable, name  # in a buffer of its own: the worker may fill it in place
        if received.size:
            received.flat[0] = received.flat[-1]
            assert received.flat[0] == sent.flat[-1] and sent.flat[0] != sent.flat[-1], name  # not the sender's memory
    assert got["fortran"].flags.f_contiguous


def test_a_non_contiguous_array_is_copied_into_the_body_and_still_arrives_intact() -> None:
    base = np.arange(100, dtype=np.int64).reshape(10, 10)
    view = base[::2, 1::3]
    (received,) = _decode(_bytes((view,)))
    assert received.dtype == view.dtype and received.shape == view.shape
    assert np.array_equal(received, view)


def test_the_messages_dataclasses_and_enums_round_trip() -> None:
    identity = AgentIdentity(b"\x00meta\xff" * 100, (NixlRegion(0x7F0000000000, 1 << 20, 0, False, 3),))
    region = MappedRegion(5, 0x7F0000100000, 4096, 1, True)
    requests = (
        RegionRequest(MemoryKind.SHM, 8192, shm_name="kvd-engine-1"),
        RegionRequest(
            MemoryKind.CUDA_IPC,
            1 << 20,
            cuda_ipc=CudaIpcSpec(0, b"handle", 1 << 21, 64, b"ref", 8, b"event", True),
        ),
    )
    sent = [
        (REPLY, 1, (7, identity), None),
        (REPLY, 2, [region], None),
        (CALL, 3, "open_regions", (requests,)),
        (SETTLED, 9, XferState.DONE.value, None),
        (NOTIFS, {"holder": [b"n1", b"n2"], "other": [b""]}),
    ]
    for message in sent:
        received = _decode(_bytes(message))
        assert received == message
    assert XferState(_decode(_bytes((SETTLED, 9, XferState.ERROR.value, None)))[2]) is XferState.ERROR
    assert _decode(_bytes((REPLY, 2, [region], None)))[2][0].mem_type == "VRAM"


def test_many_messages_back_to_back_on_a_socketpair_arrive_whole_and_in_order() -> None:
    """Frames written in a burst (some larger than the socket's buffer) are read one by one."""
    rng = np.random.default_rng(11)
    big = rng.integers(0, 1 << 62, size=(1 << 20, 3), dtype=np.int64)  # 24 MiB of descriptor rows
    messages: list[tuple[Any, ...]] = []
    for i in range(200):
        payload = big if i % 50 == 7 else rng.integers(0, 1000, size=i, dtype=np.int32)
        messages.append((CALL, i, "read", (i, payload, b"notif-%d" % i)))
        messages.append((NOTIFS, {f"agent-{i}": [bytes([i % 256]) * i]}))

    async def go() -> list[tuple[Any, ...]]:
        left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        _, writer = await asyncio.open_connection(sock=left)
        reader, other = await asyncio.open_connection(sock=right, limit=1 << 24)

        async def send() -> None:
            for message in messages:
                writer.writelines(frame(message))
            await writer.drain()
            writer.close()

        sender = asyncio.create_task(send())
        received = []
        with pytest.raises(asyncio.IncompleteReadError):  # the end of the stream after the last frame
            while True:
                received.append(await read_frame(reader))
        await sender
        other.close()
        return received

    received = asyncio.run(go())
    assert len(received) == len(messages)
    for got, sent in zip(received, messages, strict=True):
        if sent[0] == NOTIFS:
            assert got == sent
            continue
        assert got[:3] == sent[:3]
        (index, payload, notif), (sent_index, sent_payload, sent_notif) = got[3], sent[3]
        assert (index, notif) == (sent_index, sent_notif)
        assert payload.dtype == sent_payload.dtype and payload.shape == sent_payload.shape
        assert np.array_equal(payload, sent_payload)


def _kvd_error_classes() -> list[type[KvdError]]:
    found: list[type[KvdError]] = []
    pending: list[type[KvdError]] = [KvdError]
    while pending:
        cls = pending.pop()
        found.append(cls)
        pending.extend(cls.__subclasses__())
    return sorted(found, key=lambda c: c.__name__)


def test_an_error_subclass_outside_the_hierarchy_travels_as_its_nearest_known_class() -> None:
    class StartFailedHere(Unavailable):
        pass

    assert encode_error(StartFailedHere("no worker")) == ("Unavailable", "no worker")
    assert type(decode_error(encode_error(StartFailedHere("no worker")))) is Unavailable


@pytest.mark.parametrize(
    "cls", [c for c in _kvd_error_classes() if c.__module__ == "kvd_client.errors"], ids=lambda c: c.__name__
)
def test_every_kvd_error_comes_back_as_its_exact_class(cls: type[KvdError]) -> None:
    wire = encode_error(cls(f"a {cls.__name__} happened: ü"))
    assert wire == (cls.__name__, f"a {cls.__name__} happened: ü")
    (_, _, _, error) = _decode(_bytes((REPLY, 1, None, wire)))  # and through a frame
    decoded = decode_error(error)
    assert type(decoded) is cls
    assert decoded.message == f"a {cls.__name__} happened: ü"
    assert decoded.code == cls.code


def test_the_error_classes_cover_the_hierarchy() -> None:
    """The parametrization above sees the specific classes the daemon raises most."""
    names = {c.__name__ for c in _kvd_error_classes()}
    assert {"Unavailable", "PeerUnavailable", "NotFound", "MemoryOpenError", "Internal", "InvalidArgument"} <= names
    assert errors.PeerUnavailable in _kvd_error_classes()


def test_an_unknown_class_name_becomes_internal_with_its_message() -> None:
    decoded = decode_error(("NoSuchKvdError", "something broke"))
    assert type(decoded) is Internal
    assert decoded.message == "something broke"


def test_an_exception_outside_the_hierarchy_becomes_internal_naming_its_type() -> None:
    wire = encode_error(ZeroDivisionError("division by zero"))
    assert wire[0] == "Internal"
    assert "ZeroDivisionError" in wire[1] and "division by zero" in wire[1]
    assert type(decode_error(wire)) is Internal


@pytest.mark.parametrize("size", [MAX_BODY + 1, (1 << 32) - 1])
def test_a_corrupt_header_with_a_huge_length_is_refused_without_reading_on(size: int) -> None:
    """The length is checked before anything is read: no stream is left waiting for 4 GiB."""
    data = HEADER.pack(size, 0) + b"x" * 100
    with pytest.raises(ValueError, match="corrupt"):
        _decode(data, eof=False)  # no end of stream: a reader that tried to read the body would hang


def test_a_frame_cut_short_is_the_end_of_the_stream() -> None:
    whole = _bytes((REPLY, 1, np.arange(100, dtype=np.int64), None))
    for cut in (0, 5, HEADER.size, HEADER.size + 3, len(whole) - 1):
        with pytest.raises(asyncio.IncompleteReadError):
            _decode(whole[:cut])


def test_a_body_that_is_not_pickle_raises() -> None:
    body = b"this is not a pickle"
    with pytest.raises(pickle.UnpicklingError):
        _decode(HEADER.pack(len(body), 0) + body)


def _orders() -> list[tuple[Any, ...]]:
    """Messages of several shapes: no buffer, two arrays out of band, an empty body's worth."""
    return [
        (CALL, 7, "reads", (np.arange(64, dtype=np.int32), np.arange(64, 128, dtype=np.int32), b"notif")),
        (CALL, 8, "reads", ()),
        (REPLY, 9, [("posted", XferState.DONE.value, None)], None),
        (CALL, 10, "reads", (np.zeros(0, dtype=np.int32),)),
    ]


@pytest.mark.parametrize("piece", [1, 3, 12, 100, 1 << 20])
def test_a_frame_buffer_fed_any_pieces_gives_every_message_whole_in_order_and_writable(piece: int) -> None:
    """Bytes arrive as a non-blocking socket gives them: cut anywhere, header and buffers too."""
    sent = _orders()
    data = b"".join(_bytes(m) for m in sent)
    decoder = FrameBuffer()
    got: list[tuple[Any, ...]] = []
    for start in range(0, len(data), piece):
        got.extend(decoder.feed(memoryview(data)[start : start + piece]))
    assert len(got) == len(sent)
    for message, original in zip(got, sent, strict=True):
        assert message[:3] == original[:3]
        if original[0] == REPLY:
            assert message == original
            continue
        for a, b in zip(message[3], original[3], strict=True):
            if isinstance(b, np.ndarray):
                assert a.dtype == b.dtype and np.array_equal(a, b)
                a[...] = 0  # writable, as read_frame's: the worker may hand them to NIXL as they are
            else:
                assert a == b
    assert decoder.feed(b"") == []  # nothing left over


def test_a_frame_buffer_keeps_a_partial_frame_until_the_rest_arrives() -> None:
    whole = _bytes((REPLY, 1, np.arange(100, dtype=np.int64), None))
    decoder = FrameBuffer()
    assert decoder.feed(whole[:-1]) == []
    (message,) = decoder.feed(whole[-1:])
    assert np.array_equal(message[2], np.arange(100, dtype=np.int64))


@pytest.mark.parametrize(
    "corrupt",
    [
        HEADER.pack(MAX_BODY + 1, 0),
        HEADER.pack(10, 1 << 20),
        HEADER.pack(0, 1) + BUFFER.pack(1 << 40),
    ],
    ids=["body", "buffer-count", "buffer-length"],
)
def test_a_frame_buffer_refuses_a_corrupt_header_at_once_as_read_frame_does(corrupt: bytes) -> None:
    """Refused from the header alone: a thread never waits for (or keeps) gigabytes."""
    with pytest.raises(ValueError, match="corrupt"):
        FrameBuffer().feed(corrupt)
