"""The scheduler half: who pulls (threshold, block alignment), who holds, what workers are told."""

from __future__ import annotations

from typing import Any

import pytest

from kvd.demo.reference_engine import EngineRequest, RequestStatus
from kvd_client import errors
from kvd_engine.config import KvdConnectorConfig
from kvd_engine.engine_api import ScheduledRequest, StepView
from kvd_engine.params import make_params, remote_kv
from kvd_engine.scheduler import KvdScheduler


class FakeHold:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.error: errors.KvdError | None = None
        self.up = True

    def available(self) -> bool:
        return self.up

    def hold_blocks(
        self,
        engine_id: str,
        request_id: str,
        block_ids: Any,
        num_tokens: int,
        ttl_ms: int = 0,
        group_block_ids: Any = (),
    ) -> dict[str, Any]:
        self.calls.append((engine_id, request_id, list(block_ids), num_tokens, ttl_ms))
        if self.error is not None:
            raise self.error
        return {
            "daemon_address": "10.0.0.1:7400",
            "daemon_incarnation": "inc-1",
            "engine_id": engine_id,
            "tp_size": 1,
            "lease_id": "L1",
            "block_ids": list(block_ids),
            "num_tokens": num_tokens,
            "request_id": request_id,
            "lease_expires_unix_ms": 123,
        }

    def close(self) -> None:
        pass


def _remote(num_tokens: int, blocks: list[int], block_size: int = 4, pull_prefill: bool = True) -> dict[str, Any]:
    held = {
        "daemon_address": "peer:7400",
        "daemon_incarnation": "x",
        "engine_id": "other",
        "tp_size": 1,
        "lease_id": "LX",
        "block_ids": blocks,
        "num_tokens": num_tokens,
        "request_id": "r",
        "lease_expires_unix_ms": 0,
    }
    return make_params(held, block_size=block_size, receiver_pulls_prefill=pull_prefill)


def _sched(**config: Any) -> tuple[KvdScheduler, FakeHold]:
    hold = FakeHold()
    return KvdScheduler(KvdConnectorConfig(**config), "eng", block_size=4, hold_client=hold), hold


def test_decode_pulls_the_whole_prompt_whatever_its_size() -> None:
    sched, _ = _sched(pull_threshold_tokens=1000)
    req = EngineRequest("r", list(range(10)), 5, _remote(10, [7, 8, 9]))
    assert sched.get_num_new_matched_tokens(req, 0) == (10, True)
    sched.update_state_after_alloc(req, [1, 2, 3], 10)
    meta = sched.build_connector_meta(StepView())
    (pull,) = meta.pulls
    assert pull.local_block_ids == (1, 2, 3)
    assert pull.remote["block_ids"] == [7, 8, 9] and pull.remote["num_tokens"] == 10
    # One transfer per request: asking again (e.g. after preemption) pulls nothing.
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert sched.build_connector_meta(StepView()).pulls == []


@pytest.mark.parametrize("remote_tokens,expected", [(63, (0, False)), (64, (64, True)), (200, (100, True))])
def test_prefill_pulls_back_from_decode_only_above_the_threshold(
    remote_tokens: int, expected: tuple[int, bool]
) -> None:
    sched, _ = _sched(pull_threshold_tokens=64)
    params = _remote(remote_tokens, list(range(50)), pull_prefill=False)
    req = EngineRequest("r", list(range(100)), 1, params)
    assert sched.get_num_new_matched_tokens(req, 0) == expected


def test_a_local_prefix_hit_skips_whole_remote_blocks() -> None:
    sched, _ = _sched(pull_threshold_tokens=0)
    params = _remote(20, [10, 11, 12, 13, 14], pull_prefill=False)
    req = EngineRequest("r", list(range(30)), 1, params)
    assert sched.get_num_new_matched_tokens(req, 8) == (12, True)
    sched.update_state_after_alloc(req, [5, 6, 7, 9], 12)
    (pull,) = sched.build_connector_meta(StepView()).pulls
    assert pull.local_block_ids == (5, 6, 7)
    assert pull.remote["block_ids"] == [12, 13, 14] and pull.remote["num_tokens"] == 12


def test_too_few_blocks_for_the_promised_tokens_is_a_refused_pull_not_a_silent_wait() -> None:
    """vLLM waits for the load of any request the scheduler promised external tokens: if it
    allocated too few blocks for them, the pull goes to the worker refused (failed at once)."""
    sched, _ = _sched(pull_threshold_tokens=1000)
    params = _remote(10, [7, 8, 9])
    req = EngineRequest("r", list(range(10)), 5, params)
    assert sched.get_num_new_matched_tokens(req, 0) == (10, True)
    sched.update_state_after_alloc(req, [1, 2], 10)
    (pull,) = sched.build_connector_meta(StepView()).pulls
    assert pull.refused and "2 blocks allocated for 10 external tokens" in pull.refused
    assert pull.local_block_ids == (1, 2) and pull.remote == {}
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # not promised again


def test_params_that_stop_parsing_after_the_match_are_a_refused_pull() -> None:
    sched, _ = _sched(pull_threshold_tokens=1000)
    params = _remote(10, [7, 8, 9])
    req = EngineRequest("r", list(range(10)), 5, params)
    assert sched.get_num_new_matched_tokens(req, 0) == (10, True)
    params["kvd"]["block_ids"] = "not a list"
    sched.update_state_after_alloc(req, [1, 2, 3], 10)
    (pull,) = sched.build_connector_meta(StepView()).pulls
    assert pull.refused and pull.local_block_ids == (1, 2, 3)


def test_a_local_hit_off_the_remote_block_grid_recomputes() -> None:
    sched, _ = _sched(pull_threshold_tokens=0)
    req = EngineRequest("r", list(range(30)), 1, _remote(20, [1, 2, 3], block_size=16, pull_prefill=False))
    assert sched.get_num_new_matched_tokens(req, 8) == (0, False)


def test_no_pull_while_the_daemon_is_known_down() -> None:
    sched, hold = _sched()
    hold.up = False
    req = EngineRequest("r", list(range(10)), 1, _remote(10, [1, 2, 3]))
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)


def test_malformed_params_mean_no_pull() -> None:
    sched, _ = _sched()
    for params in (None, {}, {"do_remote_prefill": True}, {"kvd": {"lease_id": "x"}}, {"kvd": "nope"}):
        assert sched.get_num_new_matched_tokens(EngineRequest("r", [1, 2], 1, params), 0) == (0, False)
    assert remote_kv({"kvd": {"daemon_address": "a", "lease_id": "l", "block_ids": ["x"], "num_tokens": 3}}) is None


@pytest.mark.parametrize(
    "kvd,block_size",
    [
        ({"num_tokens": float("inf")}, 4),  # JSON 1e400
        ({"num_tokens": float("-inf")}, 4),
        ({"num_tokens": float("nan")}, 4),
        ({"num_tokens": 2**64}, 4),  # beyond uint64
        ({"num_tokens": 8, "block_ids": [1, 2**32]}, 4),  # a block id beyond uint32
        ({"num_tokens": 8, "block_ids": [1, -2]}, 4),
        ({"num_tokens": 8, "tp_size": float("inf")}, 4),
        ({"num_tokens": 8, "lease_expires_unix_ms": float("inf")}, 4),
        ({"num_tokens": 8}, float("inf")),  # kvd_block_size
        ({"num_tokens": 8}, float("nan")),
        ({"num_tokens": 8}, -4),
        ({"num_tokens": 8}, 2**40),
    ],
)
def test_non_finite_or_out_of_range_numbers_mean_no_pull_never_an_exception(
    kvd: dict[str, Any], block_size: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """int(float("inf")) raises OverflowError: it must not escape into vLLM's scheduler (which
    would kill the engine core); the request has no remote KV and is recomputed, with a warning."""
    sched, _ = _sched()
    params = {
        "do_remote_prefill": True,
        "kvd": {"daemon_address": "a", "lease_id": "l", "block_ids": [1, 2], **kvd},
        "kvd_block_size": block_size,
    }
    assert remote_kv(params) is None
    req = EngineRequest("r", list(range(10)), 1, params)
    with caplog.at_level("WARNING", logger="kvd_engine.params"):
        sched.on_new_request(req)
    assert "malformed kvd kv_transfer_params" in caplog.text
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    req.status = RequestStatus.FINISHED_ABORTED
    assert sched.request_finished(req, [1, 2]) == (False, None)


def _finished(
    req: EngineRequest, computed: int, outputs: int, status: RequestStatus = RequestStatus.FINISHED_LENGTH_CAPPED
) -> EngineRequest:
    req.output_token_ids = list(range(outputs))
    req.num_computed_tokens = computed
    req.status = status
    return req


def test_prefill_holds_its_blocks_and_returns_params_for_decode() -> None:
    sched, hold = _sched()
    req = _finished(EngineRequest("r", list(range(10)), 1, {"do_remote_decode": True}), 10, 1)
    delay, params = sched.request_finished(req, [4, 5, 6, 7])
    assert delay is True
    assert hold.calls == [("eng", "r", [4, 5, 6], 10, 0)]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["kvd"]["lease_id"] == "L1" and params["kvd_block_size"] == 4
    meta = sched.build_connector_meta(StepView(finished_req_ids=frozenset({"r"})))
    assert meta.held == {"r": 123} and meta.final_watermarks == {"r": 10}
    assert meta.finished_req_ids == {"r"}


def test_decode_holds_for_the_next_turn_only_when_configured() -> None:
    for hold_on_decode, expect in ((True, True), (False, False)):
        sched, _ = _sched(hold_on_decode=hold_on_decode)
        req = _finished(EngineRequest("r", list(range(8)), 4, _remote(8, [1, 2])), 11, 4)
        delay, params = sched.request_finished(req, [1, 2, 3])
        assert delay is expect
        if expect:
            assert params["do_remote_decode"] is True and params["kvd"]["num_tokens"] == 11


def test_aborted_requests_and_failed_holds_free_their_blocks_at_once() -> None:
    sched, hold = _sched()
    req = _finished(
        EngineRequest("r", list(range(8)), 1, {"do_remote_decode": True}), 8, 1, RequestStatus.FINISHED_ABORTED
    )
    assert sched.request_finished(req, [1, 2]) == (False, None)
    hold.error = errors.Unavailable("daemon down")
    req2 = _finished(EngineRequest("r2", list(range(8)), 1, {"do_remote_decode": True}), 8, 1)
    assert sched.request_finished(req2, [1, 2]) == (False, None)
    assert sched.hold_failures == 1


def test_host_commits_only_without_speculative_decoding() -> None:
    step = StepView(scheduled=[ScheduledRequest("a", 10, 5), ScheduledRequest("b", 3, 1)])
    sched, _ = _sched()
    assert sched.build_connector_meta(step).host_commits == {"a": 15, "b": 4}
    spec = KvdScheduler(KvdConnectorConfig(), "eng", block_size=4, hold_client=FakeHold(), speculative=True)
    assert spec.build_connector_meta(step).host_commits == {}


def test_config_validation_and_extra_config_parsing() -> None:
    cfg = KvdConnectorConfig.from_extra_config(
        {"kvd_socket": "/tmp/k.sock", "pull_threshold_tokens": 128, "hold_on_decode": False}
    )
    assert cfg.pull_threshold_tokens == 128 and cfg.hold_on_decode is False
    assert cfg.target == "unix:///tmp/k.sock"
    with pytest.raises(ValueError, match="unknown kvd connector option"):
        KvdConnectorConfig.from_extra_config({"kvd_sockett": "x"})
    with pytest.raises(ValueError, match="pull_threshold_tokens"):
        KvdConnectorConfig(pull_threshold_tokens=-1)
    with pytest.raises(ValueError, match="nwor_mode"):
        KvdConnectorConfig(nwor_mode="maybe")


class _VllmLikeRequest:
    """The fields of vLLM's Request the prefill truncation touches."""

    def __init__(self, prompt: list[int] | None, embeds: list[float] | None = None, skip_cache: bool = False) -> None:
        self.request_id = "r"
        self.prompt_token_ids = None if prompt is None else list(prompt)
        self.prompt_embeds = embeds
        self._all_token_ids = list(prompt if prompt is not None else range(len(embeds or [])))
        self.num_prompt_tokens = len(self._all_token_ids)
        self.max_tokens = 16
        self.kv_transfer_params: dict[str, Any] = {"do_remote_decode": True}
        self._skip = skip_cache

    def get_skip_reading_prefix_cache(self) -> bool:
        return self._skip


@pytest.mark.parametrize(
    "has_state,backoff,expected",
    [(False, None, 0), (True, None, 1), (False, 3, 3), (True, 3, 3)],
    ids=["plain", "state", "mtp-lookahead", "state-and-mtp"],
)
def test_a_prefill_for_a_remote_decode_stops_short_by_its_backoff(
    has_state: bool, backoff: int | None, expected: int
) -> None:
    """Mamba state: one token short (the decode engine derives the last state); a multi-module
    MTP drafter's lookahead: that many tokens short; once only, whatever happens after."""
    sched = KvdScheduler(
        KvdConnectorConfig(), "eng", block_size=4, hold_client=None, has_state=has_state, prefill_backoff=backoff
    )
    req = _VllmLikeRequest(list(range(10)))
    sched.on_new_request(req)
    assert req.num_prompt_tokens == 10 - expected and req.prompt_token_ids == list(range(10 - expected))
    assert req._all_token_ids == list(range(10 - expected))
    assert req.max_tokens == (1 if expected else 16)
    sched.on_new_request(req)  # preempted and scheduled again: not truncated twice
    assert req.num_prompt_tokens == 10 - expected


def test_prompt_embeds_are_truncated_and_a_request_skipping_the_prefix_cache_is_not() -> None:
    sched = KvdScheduler(KvdConnectorConfig(), "eng", block_size=4, hold_client=None, prefill_backoff=2)
    embedded = _VllmLikeRequest(None, embeds=[0.5] * 8)
    sched.on_new_request(embedded)
    assert embedded.prompt_embeds == [0.5] * 6 and embedded.num_prompt_tokens == 6
    skipping = _VllmLikeRequest(list(range(8)), skip_cache=True)  # prompt logprobs: decode loads nothing
    sched.on_new_request(skipping)
    assert skipping.num_prompt_tokens == 8 and skipping.max_tokens == 16
    short = _VllmLikeRequest([1, 2])  # no longer than the backoff: left whole
    sched.on_new_request(short)
    assert short.num_prompt_tokens == 2
