"""What the router-stream tests share (tests/integration/test_watch_transfers.py and
test_router_stream_pulls.py): two registered engines, a hold of two blocks, and a
``WatchTransfers`` stream opened by hand, with no client logic, to see what the daemon itself
answers."""

from __future__ import annotations

import queue
from collections.abc import Iterator

import grpc
from kvtest import ShmEngine, small_spec

from kvd_client.v1 import common_pb2, router_pb2, router_pb2_grpc

TOKENS = 16 + 9  # two blocks, the last partial
PULLS = 32
FILL = 0xAB  # every byte of the reader's blocks before a pull
DONE = common_pb2.TRANSFER_STATE_DONE
FINAL = (DONE, common_pb2.TRANSFER_STATE_FAILED, common_pb2.TRANSFER_STATE_ABORTED)


def hold(holder: ShmEngine, request_id: str, first_block: int) -> common_pb2.KvTransferParams:
    """The holder's blocks ``first_block`` and the next, held for ``request_id``."""
    return holder.client.hold_blocks(
        engine_id="holder", request_id=request_id, block_ids=[first_block, first_block + 1], num_tokens=TOKENS
    ).kv_transfer_params


def start_pulls(holder: ShmEngine, reader: ShmEngine, prefix: str, count: int) -> list[str]:
    """``count`` pulls started on the reader's daemon, pull i (request ``<prefix><i>``) of the
    holder's blocks 2i, 2i+1 into the reader's blocks 2i+1, 2i+2; their transfer ids."""
    return [
        reader.client.start_pull(
            engine_id="reader",
            request_id=f"{prefix}{i}",
            local_block_ids=[1 + 2 * i, 2 + 2 * i],
            remote=hold(holder, f"{prefix}{i}", 2 * i),
        ).transfer_id
        for i in range(count)
    ]


def engines(holder_daemon, reader_daemon, *, seed: int, require_commits: bool = False) -> tuple[ShmEngine, ShmEngine]:
    """A holder engine of random bytes and a reader engine of FILL, room for PULLS pulls."""
    spec = small_spec(num_blocks=2 * PULLS + 8)
    holder = ShmEngine(holder_daemon.unix_target, "holder", spec, require_commits=require_commits)
    reader = ShmEngine(reader_daemon.unix_target, "reader", spec)
    holder.register()
    reader.register()
    holder.fill_random(seed=seed)
    reader.fill(FILL)
    return holder, reader


class RawWatch:
    """A WatchTransfers stream opened by hand (no client logic): what the daemon itself answers."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target)
        self._outbox: queue.SimpleQueue[router_pb2.WatchTransfersRequest | None] = queue.SimpleQueue()
        self.call = router_pb2_grpc.RouterServiceStub(self.channel).WatchTransfers(self._requests(), timeout=60)

    def _requests(self) -> Iterator[router_pb2.WatchTransfersRequest]:
        while (item := self._outbox.get()) is not None:
            yield item

    def send(self, *ids: str, unwatch: tuple[str, ...] = ()) -> None:
        """One message watching ``ids`` (and unwatching ``unwatch``)."""
        self._outbox.put(router_pb2.WatchTransfersRequest(transfer_ids=ids, unwatch_transfer_ids=unwatch))

    def start(self, *starts: tuple[int, router_pb2.StartPullRequest]) -> None:
        """One message starting ``starts`` ((seq, pull) each)."""
        self._outbox.put(
            router_pb2.WatchTransfersRequest(
                start_pulls=[router_pb2.WatchedPullStart(seq=seq, pull=pull) for seq, pull in starts]
            )
        )

    def half_close(self) -> None:
        self._outbox.put(None)

    def next(self) -> router_pb2.WatchTransfersResponse:
        return next(self.call)

    def answers(self, count: int) -> dict[str, common_pb2.TransferStatus | router_pb2.TransferWatchRefusal]:
        """The next ``count`` answers, by transfer id (several may come in one message)."""
        got: dict[str, common_pb2.TransferStatus | router_pb2.TransferWatchRefusal] = {}
        while len(got) < count:
            response = self.next()
            for item in [*response.finished, *response.refused]:
                assert item.transfer_id not in got, f"{item.transfer_id} answered twice"
                got[item.transfer_id] = item
        assert len(got) == count
        return got

    def outcomes(
        self, seqs: set[int]
    ) -> tuple[dict[int, router_pb2.StartPullResult], dict[str, common_pb2.TransferStatus]]:
        """Every start of ``seqs`` answered, and every pull that started ended: the starts' results
        by seq and the final statuses by transfer id. Each start is answered once, and no pull's
        end comes before its start's answer (in an earlier message, or the same one)."""
        started: dict[int, router_pb2.StartPullResult] = {}
        finished: dict[str, common_pb2.TransferStatus] = {}

        def pending() -> bool:
            return set(started) != seqs or any(
                r.transfer_id and r.transfer_id not in finished for r in started.values()
            )

        while pending():
            response = self.next()
            assert not response.refused and not response.incarnation, response
            for item in response.started:
                assert item.seq in seqs and item.seq not in started, f"start {item.seq} answered twice or unasked"
                started[item.seq] = item.result
            ids = {r.transfer_id for r in started.values() if r.transfer_id}
            for status in response.finished:
                assert status.transfer_id in ids, f"{status.transfer_id} ended before its start was answered"
                assert status.transfer_id not in finished, f"{status.transfer_id} answered twice"
                assert status.state in FINAL, status
                finished[status.transfer_id] = status
        return started, finished

    def close(self) -> None:
        self.call.cancel()
        self.channel.close()
