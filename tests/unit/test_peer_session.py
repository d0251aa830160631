"""PeerSession.engine_ranks: what every pull asks of a handshake, answered from an index that a
re-handshake (a new ``engines`` dict) rebuilds."""

from __future__ import annotations

from typing import Any, cast

from kvd.core.peer_protocol import RemoteEngine
from kvd.core.peers import PeerSession


def _engine(engine_id: str, rank: int) -> RemoteEngine:
    # engine_ranks reads only the key; the value stands for the rank's descriptor.
    return cast(RemoteEngine, (engine_id, rank))


def _session(engines: dict[tuple[str, int], RemoteEngine]) -> PeerSession:
    return PeerSession(address="peer:1", incarnation="i1", agent=cast(Any, None), engines=engines)


def test_ranks_of_each_engine_and_none_of_an_unknown_one() -> None:
    session = _session({("a", 0): _engine("a", 0), ("a", 1): _engine("a", 1), ("b", 0): _engine("b", 0)})
    assert session.engine_ranks("a") == {0: _engine("a", 0), 1: _engine("a", 1)}
    assert session.engine_ranks("b") == {0: _engine("b", 0)}
    assert session.engine_ranks("c") == {}
    assert session.engine_ranks("a") is session.engine_ranks("a")  # built once, not per pull


def test_a_rehandshake_that_replaces_the_engines_is_seen_at_once() -> None:
    session = _session({("a", 0): _engine("a", 0)})
    assert list(session.engine_ranks("a")) == [0]
    session.engines = {("a", 0): _engine("a", 0), ("a", 1): _engine("a", 1)}  # as Peers._handshake does
    assert list(session.engine_ranks("a")) == [0, 1]
    session.engines = {("b", 0): _engine("b", 0)}
    assert session.engine_ranks("a") == {} and list(session.engine_ranks("b")) == [0]


def test_an_unknown_engines_answer_is_not_shared() -> None:
    session = _session({})
    session.engine_ranks("x")[0] = _engine("x", 0)
    assert session.engine_ranks("x") == {}
