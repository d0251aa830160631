"""What a worker's daemon link reports and takes: the events the step path polls, and a pull.

:class:`~kvd_engine.worker_link.DaemonLink` appends these events from its thread and the worker
(:mod:`kvd_engine.worker`) polls them between steps. Every pull event names the connection
``epoch`` its StartPulls was sent under, so the worker ends exactly the pulls a re-registration
fenced; :func:`start_pull_request` is a :class:`PullOrder`'s wire form. Plain frozen dataclasses:
importing this module loads neither grpc nor protobuf (a pull's request loads protobuf).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvd_client.records import from_fields, to_message
from kvd_client.v1.schema import KvTransferParams

if TYPE_CHECKING:
    from kvd_client.v1 import common_pb2, engine_pb2, router_pb2

__all__ = [
    "Connected",
    "DaemonGone",
    "DaemonMessage",
    "Disconnected",
    "LinkEvent",
    "PullFailed",
    "PullInDoubt",
    "PullOrder",
    "PullStarted",
    "start_pull_request",
]


@dataclasses.dataclass(frozen=True)
class Connected:
    """Registered with a daemon (first time or again); ``incarnation`` names that daemon run.

    ``epoch`` counts connections of this link: work started under an epoch belongs to it. A
    registration is made only once the previous one is gone (a new daemon run, the daemon
    dropped it, or the link unregistered it after AlreadyExists): every pull into the memory of
    an older epoch was cancelled and fenced, and every lease of it ended.
    """

    incarnation: str
    epoch: int = 0


@dataclasses.dataclass(frozen=True)
class Disconnected:
    """The engine stream of connection ``epoch`` ended. The daemon may still be alive and still
    serving its pulls and leases: they end for sure only at the next :class:`Connected`."""

    reason: str
    epoch: int = 0


@dataclasses.dataclass(frozen=True)
class DaemonGone:
    """Nothing listens on the daemon's socket any more: the daemon of connection ``epoch`` has
    exited (a daemon shutting down keeps its socket until its pulls and leases are over, and one
    that died lost them), so every pull and lease of that connection is over."""

    reason: str
    epoch: int = 0


@dataclasses.dataclass(frozen=True)
class PullStarted:
    """The daemon started the pull as ``transfer_id``, under connection ``epoch``."""

    request_id: str
    transfer_id: str
    epoch: int = 0


@dataclasses.dataclass(frozen=True)
class PullFailed:
    """The pull did not start (refused, or never sent): none of its bytes can land."""

    request_id: str
    message: str


@dataclasses.dataclass(frozen=True)
class PullInDoubt:
    """StartPulls went out under connection ``epoch`` but no answer came back, even to retries:
    the daemon may be writing. The link re-registers; the pull is over at the next
    :class:`Connected` (that fence cancels it), or when the daemon reports it ended."""

    request_id: str
    message: str
    epoch: int = 0


@dataclasses.dataclass(frozen=True)
class DaemonMessage:
    """A message the daemon sent down the engine stream."""

    message: engine_pb2.DaemonMessage


LinkEvent = Connected | Disconnected | DaemonGone | PullStarted | PullFailed | PullInDoubt | DaemonMessage


@dataclasses.dataclass(frozen=True)
class PullOrder:
    """One pull of :meth:`~kvd_engine.worker_link.DaemonLink.start_pulls`: into which local blocks, from which lease."""

    request_id: str
    local_block_ids: tuple[int, ...]
    remote: Mapping[str, Any]
    deadline_ms: int = 0
    local_groups: tuple[tuple[int, ...], ...] = ()  # a hybrid model's other groups' local blocks


def start_pull_request(engine_id: str, tp_rank: int, order: PullOrder) -> router_pb2.StartPullRequest:
    """The StartPullRequest of ``order`` for this rank."""
    from kvd_client.v1 import router_pb2  # noqa: PLC0415 - protobuf loads with the first pull

    return router_pb2.StartPullRequest(
        engine_id=engine_id,
        tp_rank=tp_rank,
        request_id=order.request_id,
        local_block_ids=order.local_block_ids,
        remote=_transfer_params(order.remote),
        deadline_ms=order.deadline_ms,
        local_group_block_ids=[b for ids in order.local_groups for b in ids],
        local_group_block_counts=[len(ids) for ids in order.local_groups],
    )


def _transfer_params(fields: Mapping[str, Any]) -> common_pb2.KvTransferParams:
    from kvd_client.v1 import common_pb2  # noqa: PLC0415 - protobuf loads with the first pull

    return to_message(from_fields(KvTransferParams, fields), common_pb2.KvTransferParams)
