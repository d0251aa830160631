"""The framed engine stream's codec and paths (kvd_client._frames): what both ends agree on."""

from __future__ import annotations

import struct

import pytest

from kvd_client import errors
from kvd_client._frames import HEADER, MAX_FRAME_BYTES, SUFFIX, encode, end_error, frame_length, stream_socket_path
from kvd_client.v1 import common_pb2, engine_pb2


@pytest.mark.parametrize(
    ("target", "path"),
    [
        ("unix:///run/kvd/engine.sock", "/run/kvd/engine.sock" + SUFFIX),
        ("unix:/run/kvd/engine.sock", "/run/kvd/engine.sock" + SUFFIX),
        ("/run/kvd/engine.sock", "/run/kvd/engine.sock" + SUFFIX),
        ("unix:rel/engine.sock", "rel/engine.sock" + SUFFIX),
        ("127.0.0.1:50151", None),
        ("dns:///kvd.local:50151", None),
        ("unix-abstract:kvd", None),
        ("", None),
    ],
)
def test_the_framed_socket_sits_beside_a_unix_target_only(target: str, path: str | None) -> None:
    assert stream_socket_path(target) == path


def test_a_frame_is_its_length_then_its_bytes_and_the_length_is_bounded() -> None:
    message = engine_pb2.EngineMessage(hello=engine_pb2.EngineHello(engine_id="e", tp_rank=3))
    framed = encode(message)
    assert framed[: HEADER.size] == struct.pack(">I", message.ByteSize())
    assert engine_pb2.EngineMessage.FromString(framed[HEADER.size :]) == message
    assert frame_length(struct.pack(">I", MAX_FRAME_BYTES)) == MAX_FRAME_BYTES
    with pytest.raises(errors.InvalidArgument, match="over the"):
        frame_length(struct.pack(">I", MAX_FRAME_BYTES + 1))


def test_an_end_frame_names_the_exact_error_class_or_nothing_for_a_clean_end() -> None:
    assert end_error(common_pb2.StreamEnd()) is None
    ended = end_error(common_pb2.StreamEnd(code=5, message="no engine 'x'", error_class="UnknownEngine"))
    assert type(ended) is errors.UnknownEngine and ended.message == "no engine 'x'"
    plain = end_error(common_pb2.StreamEnd(code=14, message="gone"))
    assert type(plain) is errors.Unavailable
    odd = end_error(common_pb2.StreamEnd(code=99, message="?"))
    assert isinstance(odd, errors.KvdError) and odd.code is errors.ErrorCode.UNKNOWN
