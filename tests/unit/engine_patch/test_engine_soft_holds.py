"""The scheduler half's soft holds, heartbeats and releases, against a fake block pool and stream.

Soft: decode frees its blocks at finish (delay_free False) and records their identities; the
daemon's PIN is answered only while the identities still match (then the blocks are referenced),
VERIFY_UNPIN checks again and gives the reference back; a lost stream gives every pin back.
Releases: a request with a remote lease that is aborted, recomputed or below the threshold tells
the holder once. Heartbeats: requests waiting to pull renew their leases every interval.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from test_engine_scheduler import FakeHold, _remote

from kvd.demo.reference_engine import EngineRequest, RequestStatus
from kvd_client.v1 import engine_pb2
from kvd_client.v1.schema import HoldCheckAction
from kvd_engine.config import KvdConnectorConfig
from kvd_engine.engine_api import StepView, TransferResults
from kvd_engine.scheduler import KvdScheduler


class SoftHold(FakeHold):
    def hold_blocks(  # type: ignore[override]
        self,
        engine_id: str,
        request_id: str,
        block_ids: Any,
        num_tokens: int,
        ttl_ms: int = 0,
        group_block_ids: Any = (),
        soft: bool = False,
    ) -> dict[str, Any]:
        held = super().hold_blocks(engine_id, request_id, block_ids, num_tokens, ttl_ms, group_block_ids)
        self.calls[-1] = (*self.calls[-1], soft)
        return held


class FakePool:
    """Block identities and reference counts, as vLLM's BlockPool keeps them."""

    def __init__(self, blocks: int = 32) -> None:
        self.hashes: list[Hashable | None] = [f"h{b}" for b in range(blocks)]
        self.refs = [0] * blocks

    def identities(self, block_ids: Sequence[int]) -> list[Hashable | None]:
        return [self.hashes[b] for b in block_ids]

    def pin(self, block_ids: Sequence[int]) -> None:
        for b in block_ids:
            self.refs[b] += 1

    def unpin(self, block_ids: Sequence[int]) -> None:
        for b in block_ids:
            self.refs[b] -= 1


class FakeStream:
    def __init__(self) -> None:
        self.inbox: list[Any] = []
        self.lost = False
        self.results: list[tuple[int, bool, str]] = []
        self.renewals: list[list[tuple[str, str]]] = []
        self.releases: list[tuple[list[tuple[str, str]], str]] = []

    def poll_commands(self) -> tuple[list[Any], bool]:
        commands, self.inbox = self.inbox, []
        lost, self.lost = self.lost, False
        return commands, lost

    def send_check_result(self, seq: int, ok: bool, reason: str = "") -> bool:
        self.results.append((seq, ok, reason))
        return True

    def renew(self, leases: Sequence[tuple[str, str]]) -> bool:
        self.renewals.append(list(leases))
        return True

    def release(self, leases: Sequence[tuple[str, str]], reason: str) -> bool:
        self.releases.append((list(leases), reason))
        return True

    def check(self, seq: int, action: HoldCheckAction, request_id: str, pin_id: str, lease_id: str = "L1") -> None:
        check = engine_pb2.HoldCheck(seq=seq, request_id=request_id, lease_id=lease_id, pin_id=pin_id, action=action)
        self.inbox.append(engine_pb2.SchedulerCommand(check=check))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _sched(**config: Any) -> tuple[KvdScheduler, SoftHold, FakePool, FakeStream, Clock]:
    hold, pool, stream, clock = SoftHold(), FakePool(), FakeStream(), Clock()
    sched = KvdScheduler(
        KvdConnectorConfig(**config), "dec", block_size=4, hold_client=hold, stream=stream, clock=clock
    )
    sched.bind_block_identity(pool)
    return sched, hold, pool, stream, clock


def _finished_decode(rid: str = "t1", tokens: int = 14) -> EngineRequest:
    """A decode request that pulled its prompt and generated: ``tokens`` computed in blocks 3.."""
    req = EngineRequest(rid, list(range(10)), 5, _remote(10, [7, 8, 9]))
    req.kv_transfer_params["_kvd_pull_scheduled"] = True  # type: ignore[index]
    req.output_token_ids = list(range(tokens + 1 - 10))
    req.num_computed_tokens = tokens
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    return req


def _step(sched: KvdScheduler) -> None:
    sched.build_connector_meta(StepView(scheduled=[], finished_req_ids=frozenset()))


def test_decode_holds_softly_its_full_blocks_and_frees_them_at_once() -> None:
    sched, hold, pool, _, _ = _sched()
    delay_free, params = sched.request_finished(_finished_decode(tokens=14), [3, 4, 5, 6])
    assert delay_free is False  # vLLM frees the blocks into its prefix cache now
    assert params is not None and params["do_remote_decode"] is True
    assert hold.calls == [("dec", "t1", [3, 4, 5], 12, 0, True)]  # 3 full blocks of 4; the partial one is not held
    assert sum(pool.refs) == 0 and sched.has_pending_work()


def test_hard_mode_keeps_todays_hold() -> None:
    sched, hold, _, _, _ = _sched(decode_hold_mode="hard")
    delay_free, params = sched.request_finished(_finished_decode(tokens=14), [3, 4, 5, 6])
    assert delay_free is True and params is not None
    assert hold.calls == [("dec", "t1", [3, 4, 5, 6], 14, 0, False)]


def test_a_block_without_identity_is_not_held_softly() -> None:
    sched, hold, pool, _, _ = _sched()
    pool.hashes[4] = None  # not in the prefix cache
    assert sched.request_finished(_finished_decode(), [3, 4, 5, 6]) == (False, None)
    assert not hold.calls and not sched.has_pending_work()


def test_pin_verify_unpin_and_eviction() -> None:
    sched, _, pool, stream, _ = _sched()
    sched.request_finished(_finished_decode("t1"), [3, 4, 5, 6])
    stream.check(1, HoldCheckAction.PIN, "t1", "p1")
    _step(sched)
    assert stream.results == [(1, True, "")] and pool.refs[3:6] == [1, 1, 1] and sched.pinned_blocks == 3
    stream.check(2, HoldCheckAction.VERIFY_UNPIN, "t1", "p1")
    _step(sched)
    assert stream.results[-1] == (2, True, "") and sum(pool.refs) == 0

    # Evicted before the next read: refused, and the hold is forgotten.
    pool.hashes[5] = "someone-else"
    stream.check(3, HoldCheckAction.PIN, "t1", "p2")
    _step(sched)
    seq, ok, why = stream.results[-1]
    assert (seq, ok) == (3, False) and "evicted" in why and sum(pool.refs) == 0
    assert not sched.has_pending_work()


def test_a_block_changed_during_the_read_fails_the_verification_and_is_unpinned() -> None:
    sched, _, pool, stream, _ = _sched()
    sched.request_finished(_finished_decode("t1"), [3, 4, 5, 6])
    stream.check(1, HoldCheckAction.PIN, "t1", "p1")
    _step(sched)
    pool.hashes[4] = None  # evicted despite the pin
    stream.check(2, HoldCheckAction.VERIFY_UNPIN, "t1", "p1")
    _step(sched)
    seq, ok, why = stream.results[-1]
    assert (seq, ok) == (2, False) and "changed during the read" in why
    assert sum(pool.refs) == 0


def test_unpin_and_a_lost_stream_give_every_reference_back() -> None:
    sched, _, pool, stream, _ = _sched()
    sched.request_finished(_finished_decode("t1"), [3, 4, 5, 6])
    sched.request_finished(_finished_decode("t2"), [10, 11, 12, 13])
    stream.check(1, HoldCheckAction.PIN, "t1", "p1")
    stream.check(2, HoldCheckAction.PIN, "t2", "p2")
    stream.check(3, HoldCheckAction.UNPIN, "t1", "p1")
    _step(sched)
    assert [r[0] for r in stream.results] == [1, 2]  # an UNPIN needs no answer
    assert pool.refs[3:6] == [0, 0, 0] and pool.refs[10:13] == [1, 1, 1]
    stream.lost = True
    _step(sched)
    assert sum(pool.refs) == 0 and not sched.has_pending_work()


def test_a_hold_ended_by_the_daemon_is_forgotten() -> None:
    sched, _, _, stream, _ = _sched()
    sched.request_finished(_finished_decode("t1"), [3, 4, 5, 6])
    ended = engine_pb2.HoldEnded(request_id="t1", lease_id="L1", reason="expired")
    stream.inbox.append(engine_pb2.SchedulerCommand(hold_ended=ended))
    _step(sched)
    assert not sched.has_pending_work()


def test_an_aborted_reader_releases_the_remote_lease_once() -> None:
    sched, _, _, stream, _ = _sched()
    req = EngineRequest("r", list(range(10)), 5, _remote(10, [7, 8, 9]))
    sched.on_new_request(req)
    req.status = RequestStatus.FINISHED_ABORTED
    assert sched.request_finished(req, []) == (False, None)
    sched.request_finished(req, [])
    assert stream.releases == [([("peer:7400", "LX")], "request finished (FINISHED_ABORTED) without pulling")]


def test_a_pulled_request_does_not_release_and_stops_renewing() -> None:
    sched, _, _, stream, clock = _sched(lease_renew_interval_ms=500)
    req = EngineRequest("r", list(range(10)), 5, _remote(10, [7, 8, 9]))
    sched.on_new_request(req)
    _step(sched)
    clock.now += 0.2
    _step(sched)  # within the interval: no second heartbeat
    assert stream.renewals == [[("peer:7400", "LX")]]
    assert sched.get_num_new_matched_tokens(req, 0) == (10, True)
    sched.update_state_after_alloc(req, [1, 2, 3], 10)
    clock.now += 1.0
    _step(sched)
    assert stream.renewals == [[("peer:7400", "LX")]]  # the admitted read holds the lease now
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    req.num_computed_tokens = 10
    sched.request_finished(req, [1, 2, 3])
    assert stream.releases == []


def test_a_pull_below_the_threshold_releases_at_once() -> None:
    sched, _, _, stream, _ = _sched(pull_threshold_tokens=64)
    req = EngineRequest("t2", list(range(20)), 1, _remote(16, [7, 8, 9, 10], pull_prefill=False))
    sched.on_new_request(req)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # asked again: released once
    assert stream.releases == [([("peer:7400", "LX")], "below the pull threshold: recomputed")]
    _step(sched)
    assert stream.renewals == []  # nothing to renew any more


def test_a_failed_pull_releases_the_lease_it_was_reading() -> None:
    sched, _, _, stream, _ = _sched()
    ok = EngineRequest("ok", list(range(10)), 5, _remote(10, [7, 8, 9]))
    bad = EngineRequest("bad", list(range(10)), 5, _remote(10, [7, 8, 9]))
    for req in (ok, bad):
        sched.on_new_request(req)
        assert sched.get_num_new_matched_tokens(req, 0) == (10, True)
        sched.update_state_after_alloc(req, [1, 2, 3], 10)
    sched.update_connector_output(TransferResults(finished_recving={"ok", "bad"}, failed_recving={"bad"}))
    assert stream.releases == [([("peer:7400", "LX")], "the pull failed: recomputed")]
