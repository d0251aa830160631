"""The worker half and its daemon link, against a fake daemon: registration, signals, pulls, restarts."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import pytest
import torch
from engine_fakes import FakeDaemon, wait_until

from kvd_client import errors
from kvd_engine.cache_layout import CacheGeometry, KvFormat, KvLayout
from kvd_engine.config import KvdConnectorConfig
from kvd_engine.metadata import KvdConnectorMetadata, PullSpec
from kvd_engine.nwor import DeferredWriteManager
from kvd_engine.registration import build_registration, geometry_from_vllm_views
from kvd_engine.scheduler_link import SchedulerLink
from kvd_engine.shm import create_shm_region, move_storage_to_shm
from kvd_engine.worker import KvdWorker
from kvd_engine.worker_link import DaemonLink

GEOMETRY = CacheGeometry(num_layers=3, num_blocks=16, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float16)
CONFIG = KvdConnectorConfig(reconnect_initial_s=0.01, reconnect_max_s=0.05, pull_timeout_slack_s=0.5)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def daemon() -> FakeDaemon:
    return FakeDaemon()


@pytest.fixture
def caches() -> Any:
    region = create_shm_region(GEOMETRY.total_bytes, prefix="kvd-test")
    yield {f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(GEOMETRY.layer_views(region.tensor))}
    region.unlink()


def _worker(
    daemon: FakeDaemon,
    caches: Any,
    clock: Clock | None = None,
    config: KvdConnectorConfig = CONFIG,
    gone_check: Any = None,
    **kw: Any,
) -> KvdWorker:
    link = DaemonLink(
        "unix:///fake",
        "eng",
        0,
        reconnect_initial_s=0.01,
        reconnect_max_s=0.05,
        client_factory=daemon.client,
        gone_check=gone_check or (lambda: daemon.down),  # stop(): the daemon died
    )
    worker = KvdWorker(config, "eng", 0, geometry=GEOMETRY, link=link, clock=clock or Clock(), **kw)
    worker.register_kv_caches(caches)
    assert wait_until(lambda: link.connected)
    return worker


def _step(worker: KvdWorker, meta: KvdConnectorMetadata | None = None, finished: set[str] = frozenset()) -> Any:
    worker.bind_connector_metadata(meta or KvdConnectorMetadata())
    worker.start_load_kv()
    results = worker.get_transfer_results(set(finished))
    worker.wait_for_save()
    worker.clear_connector_metadata()
    return results


def test_registration_describes_the_shm_region_and_layers(daemon: FakeDaemon, caches: Any) -> None:
    worker = _worker(daemon, caches)
    reg = daemon.registrations[("eng", 0)]
    assert reg.require_commits and reg.engine_pid == os.getpid()
    assert reg.layout.kv_format == 1 and reg.layout.layout == 1 and reg.layout.num_blocks == 16
    (region,) = reg.regions
    assert os.path.exists(f"/dev/shm/{region.shm_name}") and region.size_bytes == GEOMETRY.total_bytes
    offsets = [(p.k_offset, p.v_offset) for p in reg.layers]
    assert offsets == GEOMETRY.placements()
    worker.shutdown()
    assert ("eng", 0) not in daemon.registrations  # unregistered on shutdown


def test_cpu_tensors_move_into_shm_in_place_and_every_view_follows() -> None:
    backing = torch.zeros(GEOMETRY.total_bytes, dtype=torch.uint8)
    layers = GEOMETRY.layer_views(backing)
    other_view = backing[:16]  # a view the connector is not given (vLLM binds its own)
    layers[0].view(torch.uint8).flatten()[:4] = 7
    region = move_storage_to_shm(layers)
    assert region.name and os.path.exists(f"/dev/shm/{region.name}")
    mapped = torch.from_file(f"/dev/shm/{region.name}", shared=True, size=region.size_bytes, dtype=torch.uint8)
    data = mapped[region.data_offset :]
    assert int(data[0]) == 7  # contents kept
    other_view[5] = 9
    assert int(data[5]) == 9  # a view that was not passed in writes into shm too
    assert move_storage_to_shm([backing]) is region  # once: a second call finds the same region


def test_vllm_033_views_are_read_as_packed_kv() -> None:
    blocks, heads, bs, d = 6, 2, 4, 8
    raw = torch.zeros(3 * blocks * heads * bs * 2 * d * 2, dtype=torch.int8)
    per_layer = blocks * heads * bs * 2 * d
    views = {
        f"model.layers.{i}.attn": raw.view(torch.float16)[i * per_layer : (i + 1) * per_layer].view(
            blocks, heads, bs, 2 * d
        )
        for i in range(3)
    }
    g = geometry_from_vllm_views(views, tp_rank=0, tp_size=1)
    assert (g.kv_format, g.layout, g.block_size, g.num_kv_heads, g.head_dim) == (KvFormat.PACKED, KvLayout.HND, 4, 2, 8)
    nhd = {k: v.view(blocks, bs, heads, 2 * d).transpose(1, 2) for k, v in views.items()}
    assert geometry_from_vllm_views(nhd, tp_rank=0, tp_size=1).layout is KvLayout.NHD
    req = build_registration("e", views, g)
    assert [p.k_offset for p in req.layers] == [64 + i * per_layer * 2 for i in range(3)]  # torch shm header


def test_commits_then_post_forward_in_step_order(daemon: FakeDaemon, caches: Any) -> None:
    worker = _worker(daemon, caches, config=dataclasses.replace(CONFIG, commit_every_steps=1))
    meta = KvdConnectorMetadata(host_commits={"a": 16, "b": 3}, finished_req_ids=frozenset({"z"}))
    _step(worker, meta)
    worker.set_step_watermarks(["a", "c"], torch.tensor([20, 5]))
    _step(worker, KvdConnectorMetadata(host_commits={"b": 3}))
    sent = daemon.stream("eng").sent
    assert sent == [
        ("commit", "a", 16),
        ("commit", "b", 3),
        ("post_forward", 1, ("z",)),
        ("commit", "a", 20),  # b unchanged: not resent
        ("commit", "c", 5),
        ("post_forward", 2, ()),
    ]


def test_running_requests_commits_are_batched_finished_ones_go_at_once(daemon: FakeDaemon, caches: Any) -> None:
    worker = _worker(daemon, caches, config=dataclasses.replace(CONFIG, commit_every_steps=4))
    ids = [f"r{i}" for i in range(8)]
    for step in range(1, 5):
        worker.set_step_watermarks(ids, torch.arange(8) + 10 * step)
        _step(worker)
        commits = [m for m in daemon.stream("eng").sent if m[0] == "commit"]
        assert len(commits) == 2 * step  # one slice of 8 / 4 requests per step
    # After commit_every_steps steps every request was committed once, none twice.
    assert sorted(m[1] for m in commits) == sorted(ids)
    before = len(daemon.stream("eng").sent)
    worker.set_step_watermarks(ids, torch.arange(8) + 50)
    _step(worker, KvdConnectorMetadata(finished_req_ids=frozenset({"r7"}), final_watermarks={"r7": 57}))
    step5 = daemon.stream("eng").sent[before:]
    # The finished request's exact count goes at once, first; the signal closes the step.
    assert step5[0] == ("commit", "r7", 57) and step5[-1] == ("post_forward", 5, ("r7",))
    assert len(step5) == 1 + 2 + 1  # final, one slice of the running requests, the signal


def test_post_forward_is_refused_while_the_nwor_window_is_open(daemon: FakeDaemon, caches: Any) -> None:
    worker = _worker(daemon, caches)
    nwor = DeferredWriteManager("stage")
    worker.bind_nwor(nwor)
    nwor.begin_window(4)
    worker.bind_connector_metadata(KvdConnectorMetadata(finished_req_ids=frozenset({"f"}), final_watermarks={"f": 9}))
    worker.wait_for_save()  # the proposer has not run: refused
    assert daemon.stream("eng").sent == [] and worker.stats.ordering_refusals == 1
    nwor.commit(torch.ones(4, dtype=torch.bool))
    worker.bind_connector_metadata(KvdConnectorMetadata())
    worker.wait_for_save()
    assert daemon.stream("eng").sent == [("commit", "f", 9), ("post_forward", 1, ("f",))]


def test_a_pull_completes_through_the_stream(daemon: FakeDaemon, caches: Any) -> None:
    worker = _worker(daemon, caches)
    pull = PullSpec("r1", (3, 4), {"lease_id": "L", "block_ids": [9, 10], "num_tokens": 8, "engine_id": "p"})
    _step(worker, KvdConnectorMetadata(pulls=[pull]))
    assert wait_until(lambda: len(daemon.pulls) == 1)
    (fake,) = daemon.pulls
    assert fake.local_block_ids == [3, 4] and list(fake.remote.block_ids) == [9, 10]
    _step(worker)  # learn the transfer id
    daemon.finish_pull(fake)
    res = _step(worker)
    assert res.finished_recving == {"r1"} and res.failed_recving == set()
    assert worker.get_block_ids_with_load_errors() == set()


def test_a_failed_load_is_received_failed_and_its_blocks_reported(daemon: FakeDaemon, caches: Any) -> None:
    worker = _worker(daemon, caches)
    _step(
        worker,
        KvdConnectorMetadata(pulls=[PullSpec("r1", (3, 4), {"lease_id": "L", "block_ids": [1], "num_tokens": 4})]),
    )
    assert wait_until(lambda: len(daemon.pulls) == 1)
    _step(worker)
    daemon.finish_pull(daemon.pulls[0], error="peer died")
    res = _step(worker)
    assert res.finished_recving == {"r1"} and res.failed_recving == {"r1"}
    assert worker.get_block_ids_with_load_errors() == {3, 4}


def test_a_pull_the_daemon_refuses_fails_over_to_recompute(daemon: FakeDaemon, caches: Any) -> None:
    worker = _worker(daemon, caches)
    daemon.pull_error = errors.NotFound("no such lease")
    _step(
        worker, KvdConnectorMetadata(pulls=[PullSpec("r1", (3,), {"lease_id": "L", "block_ids": [1], "num_tokens": 4})])
    )
    assert wait_until(lambda: _step(worker).failed_recving == {"r1"}, timeout_s=2)


def test_a_pull_past_its_deadline_is_cancelled_and_fails_once_the_daemon_confirms(
    daemon: FakeDaemon, caches: Any
) -> None:
    """The deadline goes out with the pull; past it (+ slack) the worker cancels, and reports the
    pull failed only on the daemon's load_failed: until then its bytes may still land."""
    clock = Clock()
    worker = _worker(daemon, caches, clock)
    daemon.cancel_confirms = False
    _step(
        worker,
        KvdConnectorMetadata(
            pulls=[PullSpec("r1", (3,), {"lease_id": "L", "block_ids": [1], "num_tokens": 4}, deadline_ms=1000)]
        ),
    )
    assert wait_until(lambda: len(daemon.pulls) == 1)
    assert daemon.pulls[0].deadline_ms == 1000
    assert _step(worker).finished_recving == set()  # learns the transfer id
    clock.now += 1.6
    assert _step(worker).failed_recving == set()  # cancelled, not failed
    assert wait_until(lambda: daemon.cancels == [daemon.pulls[0].transfer_id])
    for _ in range(3):
        assert _step(worker).failed_recving == set()  # no confirmation: still not failed
    daemon.finish_pull(daemon.pulls[0], error="cancelled", error_class="Aborted")  # the daemon's word
    assert _step(worker).failed_recving == {"r1"}
    assert worker.get_block_ids_with_load_errors() == {3}


def test_the_connector_s_deadline_goes_out_when_none_is_configured(daemon: FakeDaemon, caches: Any) -> None:
    """pull_deadline_ms 0 must not mean "the daemon's transfer_deadline_s" on one side and 30 s on
    the other: the connector sends its own default, so both time the pull alike."""
    clock = Clock()
    worker = _worker(daemon, caches, clock)
    _step(worker, KvdConnectorMetadata(pulls=[_pull("r1", (3,))]))
    assert wait_until(lambda: len(daemon.pulls) == 1)
    assert daemon.pulls[0].deadline_ms == 30_000
    _step(worker)
    clock.now += 30 + CONFIG.pull_timeout_slack_s - 0.1
    _step(worker)
    assert daemon.cancels == []
    clock.now += 0.2
    _step(worker)
    assert wait_until(lambda: daemon.cancels == [daemon.pulls[0].transfer_id])
    assert wait_until(lambda: _step(worker).failed_recving == {"r1"}, timeout_s=2)  # the fake confirms


def test_an_unconfirmed_cancel_fails_the_pull_only_at_the_last_resort(daemon: FakeDaemon, caches: Any) -> None:
    clock = Clock()
    config = dataclasses.replace(CONFIG, pull_last_resort_s=60.0)
    worker = _worker(daemon, caches, clock, config=config)
    daemon.cancel_confirms = False
    _step(worker, KvdConnectorMetadata(pulls=[_pull("r1", (3,))]))
    assert wait_until(lambda: len(daemon.pulls) == 1)
    _step(worker)
    clock.now += 30 + config.pull_timeout_slack_s + 1
    for _ in range(5):
        assert _step(worker).failed_recving == set()
        clock.now += 10  # the cancel is asked again every slack
    assert wait_until(lambda: len(daemon.cancels) >= 2)
    clock.now += 20
    assert _step(worker).failed_recving == {"r1"} and worker.stats.last_resort_failures == 1


def test_daemon_restart_fails_pulls_releases_holds_and_reregisters(daemon: FakeDaemon, caches: Any) -> None:
    worker = _worker(daemon, caches)
    _step(worker, KvdConnectorMetadata(held={"h1": 0}, host_commits={"live": 12}))
    _step(
        worker, KvdConnectorMetadata(pulls=[PullSpec("r1", (3,), {"lease_id": "L", "block_ids": [1], "num_tokens": 4})])
    )
    assert wait_until(lambda: len(daemon.pulls) == 1)
    old = daemon.incarnation
    daemon.restart()
    assert wait_until(lambda: daemon.register_calls == 2 and ("eng", 0) in daemon.streams)
    results = [_step(worker) for _ in range(3)]
    assert any(r.failed_recving == {"r1"} for r in results)
    assert any(r.finished_sending == {"h1"} for r in results)  # its lease died with the daemon
    assert daemon.incarnation != old and worker.stats.reconnects == 1
    # The new daemon learns the live watermark again without waiting for a new step.
    assert ("commit", "live", 12) in daemon.stream("eng").sent


def test_pulls_fail_at_once_while_the_daemon_is_down(daemon: FakeDaemon, caches: Any) -> None:
    worker = _worker(daemon, caches)
    daemon.stop()
    assert wait_until(lambda: not worker.link.connected)
    res = _step(
        worker, KvdConnectorMetadata(pulls=[PullSpec("r1", (3,), {"lease_id": "L", "block_ids": [1], "num_tokens": 4})])
    )
    assert res.failed_recving == {"r1"}  # in the same step: no waiting on a dead daemon
    # Commits and signals while down are dropped, not raised; the engine goes on.
    _step(worker, KvdConnectorMetadata(host_commits={"x": 3}))
    daemon.start()
    assert wait_until(lambda: worker.link.connected)
    worker.shutdown()


def test_registration_waits_for_a_daemon_that_starts_later(caches: Any) -> None:
    daemon = FakeDaemon()
    daemon.down = True
    link = DaemonLink(
        "unix:///fake", "eng", 0, reconnect_initial_s=0.01, reconnect_max_s=0.02, client_factory=daemon.client
    )
    worker = KvdWorker(CONFIG, "eng", 0, geometry=GEOMETRY, link=link)
    worker.register_kv_caches(caches)  # returns at once, the daemon is down
    _step(worker, KvdConnectorMetadata(host_commits={"a": 1}))
    daemon.down = False
    assert wait_until(lambda: link.connected and daemon.register_calls == 1)
    worker.shutdown()


def test_release_messages_wait_for_the_hold_announcement(daemon: FakeDaemon, caches: Any) -> None:
    worker = _worker(daemon, caches)
    from kvd_client.v1 import engine_pb2

    daemon.stream("eng").push(
        engine_pb2.DaemonMessage(finished_sending=engine_pb2.FinishedSending(request_id="h", lease_id="L"))
    )
    assert _step(worker).finished_sending == set()  # not known as held yet
    assert _step(worker, KvdConnectorMetadata(held={"h": 0})).finished_sending == {"h"}


def test_scheduler_link_trips_a_circuit_breaker() -> None:
    daemon = FakeDaemon()
    clock = Clock()
    link = SchedulerLink("unix:///fake", retry_after_s=5, client_factory=daemon.client, clock=clock)
    held = link.hold_blocks("eng", "r", [1, 2], 7)
    assert held["num_tokens"] == 7 and held["block_ids"] == [1, 2] and held["daemon_address"] == "fake:1"
    daemon.down = True
    with pytest.raises(errors.Unavailable):
        link.hold_blocks("eng", "r", [1], 3)
    daemon.down = False
    assert not link.available()
    with pytest.raises(errors.Unavailable, match="retrying later"):
        link.hold_blocks("eng", "r", [1], 3)
    clock.now += 5
    assert link.hold_blocks("eng", "r", [1], 3)["num_tokens"] == 3


def _pull(rid: str, blocks: tuple[int, ...]) -> PullSpec:
    return PullSpec(rid, blocks, {"lease_id": f"L-{rid}", "block_ids": [1], "num_tokens": 4})


def test_a_pull_the_scheduler_refused_fails_at_once_and_is_never_sent(daemon: FakeDaemon, caches: Any) -> None:
    """The scheduler promised vLLM external tokens, then could not pull them: the worker reports
    the request failed in this step (vLLM recomputes it), its blocks named; nothing goes out."""
    worker = _worker(daemon, caches)
    refused = PullSpec("r1", (3, 4), {}, refused="2 blocks allocated for 12 external tokens")
    res = _step(worker, KvdConnectorMetadata(pulls=[refused, _pull("r2", (5,))]))
    assert res.finished_recving == {"r1"} and res.failed_recving == {"r1"}
    assert worker.get_block_ids_with_load_errors() == {3, 4}
    assert wait_until(lambda: len(daemon.pulls) == 1)
    assert daemon.batches == [["r2"]]  # only the pull the scheduler did not refuse


def test_a_step_s_loads_go_in_one_start_pulls_and_a_bad_one_fails_alone(daemon: FakeDaemon, caches: Any) -> None:
    """One StartPulls per step; the pull the daemon refused fails over to recompute (its blocks
    reported, as for a refused StartPull), the others start and complete."""
    worker = _worker(daemon, caches)
    daemon.pull_item_errors["r2"] = errors.UnknownLease("no lease L-r2")
    _step(worker, KvdConnectorMetadata(pulls=[_pull("r1", (3,)), _pull("r2", (4,)), _pull("r3", (5,))]))
    assert wait_until(lambda: len(daemon.pulls) == 2)
    assert daemon.batches == [["r1", "r2", "r3"]]
    failed: set[str] = set()
    assert wait_until(lambda: failed.update(_step(worker).failed_recving) or failed == {"r2"}, timeout_s=2)
    for fake in list(daemon.pulls):
        daemon.finish_pull(fake)
    done: set[str] = set()
    assert wait_until(lambda: done.update(_step(worker).finished_recving) or done == {"r1", "r3"}, timeout_s=2)
    assert worker.link.connected  # one refused pull does not drop the link


def test_a_daemon_without_start_pulls_gets_one_start_pull_per_load(daemon: FakeDaemon, caches: Any) -> None:
    worker = _worker(daemon, caches)
    daemon.batches_unimplemented = True
    _step(worker, KvdConnectorMetadata(pulls=[_pull("r1", (3,)), _pull("r2", (4,))]))
    assert wait_until(lambda: [p.request_id for p in daemon.pulls] == ["r1", "r2"])
    assert daemon.batches == []
    _step(worker, KvdConnectorMetadata(pulls=[_pull("r3", (5,))]))
    assert wait_until(lambda: len(daemon.pulls) == 3)
    assert worker.link._one_by_one


def test_a_whole_start_pulls_refused_fails_each_of_its_pulls(daemon: FakeDaemon, caches: Any) -> None:
    worker = _worker(daemon, caches)
    daemon.pull_error = errors.ResourceExhausted("busy")
    _step(worker, KvdConnectorMetadata(pulls=[_pull("r1", (3,)), _pull("r2", (4,))]))
    failed: set[str] = set()
    assert wait_until(lambda: failed.update(_step(worker).failed_recving) or failed == {"r1", "r2"}, timeout_s=2)
    assert worker.get_block_ids_with_load_errors() == {3, 4}


def test_an_unanswered_start_pulls_is_asked_again_and_learns_the_transfer_id(daemon: FakeDaemon, caches: Any) -> None:
    """DEADLINE_EXCEEDED after the daemon started the pull: failing it then (no transfer id, no
    cancel) would let vLLM reuse blocks the transfer still writes. The same StartPulls is asked
    again (idempotent) and answers the running transfer's id."""
    worker = _worker(daemon, caches)
    daemon.lost_answers = 1
    _step(worker, KvdConnectorMetadata(pulls=[_pull("r1", (3, 4))]))
    assert wait_until(lambda: len(daemon.batches) == 2)
    assert len(daemon.pulls) == 1  # one transfer, asked for twice
    assert wait_until(
        lambda: not _step(worker).failed_recving and worker._pulls["r1"].transfer_id == daemon.pulls[0].transfer_id
    )
    daemon.finish_pull(daemon.pulls[0])
    assert wait_until(lambda: _step(worker).finished_recving == {"r1"}, timeout_s=2)
    assert worker.stats.pulls_failed == 0 and worker.link.epoch == 1  # no re-registration needed


def test_a_start_pulls_never_answered_fails_only_after_the_re_registration_fenced_it(
    daemon: FakeDaemon, caches: Any
) -> None:
    worker = _worker(daemon, caches)
    daemon.lost_answers = 100
    _step(worker, KvdConnectorMetadata(pulls=[_pull("r1", (3, 4))]))
    failed: set[str] = set()

    def settled() -> bool:
        failed.update(_step(worker).failed_recving)
        if failed:
            # Reported failed only once the daemon's transfer can no longer write.
            assert all(p.done for p in daemon.pulls)
        return failed == {"r1"}

    assert wait_until(settled, timeout_s=5)
    assert len(daemon.batches) == 3 and len(daemon.pulls) == 1  # asked START_ATTEMPTS times
    assert daemon.register_calls == 2 and worker.link.epoch == 2  # the fence: re-registered
    assert worker.get_block_ids_with_load_errors() == {3, 4}


def test_a_whole_call_deadline_is_not_a_refusal(daemon: FakeDaemon, caches: Any) -> None:
    """A refusal (the daemon answered) fails each pull at once; a lost answer is asked again."""
    from kvd_engine.link_client import answer_lost

    assert answer_lost(errors.DeadlineExceeded("x")) and answer_lost(errors.Unavailable("x"))
    assert answer_lost(errors.Internal("x"))
    for refusal in (errors.ResourceExhausted("x"), errors.PeerUnavailable("x"), errors.LeaseExpired("x")):
        assert not answer_lost(refusal)


def test_a_pull_queued_when_the_stream_drops_goes_out_on_the_new_registration(
    daemon: FakeDaemon, caches: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pull's epoch is the one its StartPulls went out under, not the one at queue time: a
    command still queued at the drop goes out after the re-registration and must not be failed
    by it (that failure had no transfer id to cancel: the daemon wrote into reused blocks)."""
    import threading

    worker = _worker(daemon, caches)
    gate = threading.Event()
    real_cancel = worker.link._client.cancel_transfer

    def slow_cancel(transfer_id: str, **kw: Any) -> Any:
        if transfer_id == "busy":
            gate.wait(5)  # keeps the link thread busy, as any slow call would
            return None
        return real_cancel(transfer_id, **kw)

    monkeypatch.setattr(worker.link._client, "cancel_transfer", slow_cancel)
    worker.link.cancel_pull("busy")
    _step(worker, KvdConnectorMetadata(pulls=[_pull("r1", (3,))]))  # queued behind the cancel
    daemon.stream("eng").kill(errors.Unavailable("stream reset"))
    gate.set()
    assert wait_until(lambda: worker.link.epoch == 2 and len(daemon.pulls) == 1)
    results = [_step(worker) for _ in range(3)]
    assert not any(r.failed_recving for r in results)
    assert wait_until(lambda: worker._pulls["r1"].epoch == 2 or bool(_step(worker).failed_recving))
    daemon.finish_pull(daemon.pulls[0])
    assert wait_until(lambda: _step(worker).finished_recving == {"r1"}, timeout_s=2)
    assert worker.stats.pulls_failed == 0


def test_a_dropped_stream_ends_nothing_before_the_re_registration(daemon: FakeDaemon, caches: Any) -> None:
    """While the link cannot re-register, the daemon may still be writing the pull and serving
    the lease: neither is reported over. The re-registration (the fence) ends both."""
    worker = _worker(daemon, caches, gone_check=lambda: False)  # its socket still answers
    _step(worker, KvdConnectorMetadata(held={"h1": 0}, pulls=[_pull("r1", (3,))]))
    assert wait_until(lambda: len(daemon.pulls) == 1)
    _step(worker)
    daemon.down = True  # calls fail UNAVAILABLE (a daemon in its shutdown grace still writes)
    daemon.stream("eng").kill(errors.Unavailable("stream reset"))
    assert wait_until(lambda: not worker.link.connected)
    for _ in range(10):  # the link notices the drop, posts Disconnected, fails to reconnect...
        res = _step(worker)
        assert res.failed_recving == set() and res.finished_sending == set()
        time.sleep(0.05)
    daemon.down = False
    results: list[Any] = []
    assert wait_until(lambda: results.append(_step(worker)) or worker.link.epoch == 2)
    results += [_step(worker) for _ in range(3)]
    assert any(r.failed_recving == {"r1"} for r in results)
    assert any(r.finished_sending == {"h1"} for r in results)
    assert daemon.pulls[0].done  # fenced by the unregistration before it was reported


def test_a_hold_ends_on_the_daemon_s_word_not_at_its_original_lease_expiry(daemon: FakeDaemon, caches: Any) -> None:
    """Reader heartbeats renew the lease at the daemon: the expiry heard at hold time is no
    bound. The blocks go back to vLLM on finished_sending (expired included), or at the last resort."""
    from kvd_client.v1 import engine_pb2

    clock = Clock()
    worker = _worker(daemon, caches, clock)
    long_ago = 1_000  # unix ms: the lease's first expiry passed long ago
    _step(worker, KvdConnectorMetadata(held={"h1": long_ago, "h2": long_ago}))
    clock.now += 600
    for _ in range(3):
        assert _step(worker).finished_sending == set()
    daemon.stream("eng").push(
        engine_pb2.DaemonMessage(
            finished_sending=engine_pb2.FinishedSending(request_id="h1", lease_id="L", expired=True)
        )
    )
    assert _step(worker).finished_sending == {"h1"}
    clock.now += CONFIG.hold_last_resort_s
    assert _step(worker).finished_sending == {"h2"} and worker.stats.last_resort_failures == 1


def test_a_daemon_known_gone_ends_its_pulls_and_holds_without_a_reconnect(daemon: FakeDaemon, caches: Any) -> None:
    """Nothing listens on the daemon's socket: it exited, its pulls and leases with it."""
    worker = _worker(daemon, caches)
    _step(worker, KvdConnectorMetadata(held={"h1": 0}, pulls=[_pull("r1", (3,))]))
    assert wait_until(lambda: len(daemon.pulls) == 1)
    _step(worker)
    daemon.stop()
    results: list[Any] = []
    assert wait_until(lambda: results.append(_step(worker)) or any(r.finished_sending for r in results))
    assert any(r.failed_recving == {"r1"} for r in results) and worker.link.epoch == 1


def test_the_socket_check_tells_a_dead_daemon_from_a_live_one(tmp_path: Any) -> None:
    import socket

    from kvd_engine.link_client import socket_gone

    path = str(tmp_path / "d.sock")
    assert socket_gone(f"unix://{path}")  # no socket file
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    assert not socket_gone(f"unix://{path}") and not socket_gone(f"unix:{path}")
    listener.close()  # the process died: its socket file stays, refusing connections
    assert socket_gone(f"unix://{path}")
    assert not socket_gone("dns:///localhost:1")  # never concluded for TCP
