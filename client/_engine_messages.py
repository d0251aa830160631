"""What an engine stream carries, for both front ends (:mod:`kvd_client._aio_engine_stream`, and
:mod:`kvd_client._engine_stream` generated from it).

An engine's sends are on its per-step critical path, so a send queues a plain tuple (an
:data:`Item`, a fraction of a microsecond) and the proto message is built later, when grpc takes
it (:func:`to_message`); the daemon's batches are unpacked into one message per event
(:func:`unpacked`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Final, cast

from kvd_client.v1 import engine_pb2, router_pb2

from . import errors

logger = logging.getLogger(__name__)

COMMIT: Final = 1
POST_FORWARD: Final = 2
START_PULLS: Final = 3
CLOSE: Final = object()
"""Queued to end the request stream (a half-close: the daemon then ends its side)."""

CommitItem = tuple[int, str, int]
"""(COMMIT, request_id, committed_tokens)"""
PostForwardItem = tuple[int, int, tuple[str, ...]]
"""(POST_FORWARD, step, finished_request_ids)"""
StartPullsItem = tuple[int, int, tuple[router_pb2.StartPullRequest, ...]]
"""(START_PULLS, seq, requests)"""
Item = CommitItem | PostForwardItem | StartPullsItem

DEFAULT_CLOSE_TIMEOUT_S = 5.0
"""How long close() waits for the daemon to end its side before cancelling the RPC."""


def hello_message(engine_id: str, tp_rank: int) -> engine_pb2.EngineMessage:
    """The first message of every engine stream: who is speaking, that it reads batches
    (:func:`unpacked` gives the engine one message per event all the same), and that it starts
    pulls on the stream once the daemon says it takes them (``ready``)."""
    return engine_pb2.EngineMessage(
        hello=engine_pb2.EngineHello(engine_id=engine_id, tp_rank=tp_rank, accepts_batches=True, starts_pulls=True)
    )


def takes_pulls(message: engine_pb2.DaemonMessage) -> bool:
    """Whether ``message`` is the daemon's ``ready`` saying it takes pulls on this stream."""
    return message.WhichOneof("kind") == "ready" and message.ready.takes_pulls


def unpacked(message: engine_pb2.DaemonMessage) -> Sequence[engine_pb2.DaemonMessage]:
    """The events one daemon message carries, in order: a batch's messages (the events that were
    ready together on the daemon), or the message itself. Callers see one message per event."""
    if message.WhichOneof("kind") == "batch":
        return message.batch.messages
    return (message,)


def to_message(item: Item) -> engine_pb2.EngineMessage | None:
    """The EngineMessage for a queued item; None (logged) when the caller passed bad values.

    A bad value is dropped rather than ending the stream: the stream carries every request's
    commits, and a watermark is caught up by the request's next commit.
    """
    try:
        if item[0] == COMMIT:
            _, request_id, tokens = cast(CommitItem, item)
            return engine_pb2.EngineMessage(commit=engine_pb2.Commit(request_id=request_id, committed_tokens=tokens))
        if item[0] == START_PULLS:
            _, seq, requests = cast(StartPullsItem, item)
            return engine_pb2.EngineMessage(start_pulls=engine_pb2.StartPullsOnStream(seq=seq, pulls=requests))
        _, step, finished = cast(PostForwardItem, item)
        return engine_pb2.EngineMessage(post_forward=engine_pb2.PostForward(step=step, finished_request_ids=finished))
    except (TypeError, ValueError) as exc:
        logger.error("dropping engine stream message %r: %s", item, exc)
        return None


def ended_by_daemon(engine_id: str, tp_rank: int) -> errors.KvdError:
    """The error for a stream the daemon ended without being asked (it is shutting down)."""
    return errors.Unavailable(f"the daemon ended the engine stream of {engine_id} rank {tp_rank}")
