"""kvd.core.metrics: labelled children are cached by the values given, and behave exactly as
prometheus_client's own (what a scrape shows, removal, clearing, refusals)."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from kvd.core.metrics import Metrics


def _lines(metrics: Metrics, prefix: str) -> list[str]:
    return sorted(line for line in generate_latest(metrics.registry).decode().splitlines() if line.startswith(prefix))


def test_a_labelled_child_is_the_same_object_call_after_call() -> None:
    """labels() with the same values hands back one child, the one prometheus_client made for them."""
    metrics = Metrics()
    first = metrics.transfer_bytes.labels("peer:1", "serve")
    assert metrics.transfer_bytes.labels("peer:1", "serve") is first
    assert metrics.transfer_bytes.labels(peer="peer:1", direction="serve") is first  # by keyword: uncached, same child
    first.inc(3)
    metrics.transfer_bytes.labels("peer:1", "serve").inc(4)
    assert _lines(metrics, "kvd_transfer_bytes_total") == [
        'kvd_transfer_bytes_total{direction="serve",peer="peer:1"} 7.0'
    ]


def test_values_that_print_alike_share_one_child() -> None:
    """prometheus_client keys children by their strings: 0 and "0" are one series, cached or not."""
    metrics = Metrics()
    metrics.registered_bytes.labels("e", 0).set(5)
    metrics.registered_bytes.labels("e", "0").inc(1)
    assert metrics.registered_bytes.labels("e", 0) is metrics.registered_bytes.labels("e", "0")
    assert _lines(metrics, "kvd_registered_bytes{") == ['kvd_registered_bytes{engine_id="e",tp_rank="0"} 6.0']


@pytest.mark.parametrize("end", ["remove", "clear"])
def test_a_removed_series_comes_back_fresh_never_the_old_child(end: str) -> None:
    """After remove() or clear(), labels() makes a new child (starting from zero): a cached child
    of a removed series is never handed out again."""
    metrics = Metrics()
    old = metrics.held_bytes.labels("e", "0", "hard")
    old.set(9)
    if end == "remove":
        metrics.held_bytes.remove("e", "0", "hard")
    else:
        metrics.held_bytes.clear()
    assert _lines(metrics, "kvd_held_bytes{") == []
    new = metrics.held_bytes.labels("e", "0", "hard")
    assert new is not old
    new.inc(2)
    assert _lines(metrics, "kvd_held_bytes{") == ['kvd_held_bytes{engine_id="e",state="hard",tp_rank="0"} 2.0']


def test_wrong_labels_are_refused_every_time() -> None:
    """A wrong label count is refused as prometheus_client refuses it, and nothing is cached for it."""
    metrics = Metrics()
    for _ in range(2):
        with pytest.raises(ValueError, match="Incorrect label count"):
            metrics.transfers.labels("only-one")
    with pytest.raises(ValueError, match="No label names"):
        metrics.serving.labels("x")


def test_histogram_children_are_cached_too() -> None:
    metrics = Metrics()
    child = metrics.transfer_seconds.labels("pull")
    assert metrics.transfer_seconds.labels("pull") is child
    child.observe(0.002)
    assert 'kvd_transfer_duration_seconds_count{direction="pull"} 1.0' in _lines(metrics, "kvd_transfer_duration")
