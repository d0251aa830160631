"""kvd.server.edge.bounded: a status message fits grpc's metadata limit whatever it quotes."""

from __future__ import annotations

import urllib.parse

import pytest

from kvd.server.edge import MAX_DETAILS_WIRE_BYTES, bounded


def _wire(message: str) -> int:
    """The message's size as grpc sends it (``grpc-message``: percent-encoded UTF-8)."""
    return len(urllib.parse.quote(message, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~"))


@pytest.mark.parametrize("char", ["a", "\u2603", "\U0001f600", "%", "\n"])
def test_a_message_quoting_a_long_id_fits_the_metadata_limit_and_keeps_both_ends(char: str) -> None:
    message = f"no lease {char * 4096!r} is held here (released, expired and swept, or never granted)"
    cut = bounded(message)
    assert _wire(cut) <= MAX_DETAILS_WIRE_BYTES + 64  # the elision note itself is ASCII
    assert cut.startswith("no lease '") and cut.endswith("or never granted)")
    assert "characters elided" in cut


def test_a_short_message_is_sent_whole() -> None:
    for message in ("lease 'abc' expired", "request '\u2603\u2603' is unknown", "50% of the blocks"):
        assert bounded(message) == message
