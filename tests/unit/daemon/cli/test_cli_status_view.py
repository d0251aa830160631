"""`kvd status`'s person-readable view and JSON, from a GetStatus and a metrics page."""

from __future__ import annotations

import json

import kvd
from kvd.cli.status import Snapshot, message_to_dict, metrics_address_for, render
from kvd_client.v1 import common_pb2, router_pb2


def _status(**overrides: object) -> router_pb2.GetStatusResponse:
    layout = common_pb2.KvLayoutSpec(
        num_layers=32, kv_format=common_pb2.KV_FORMAT_SPLIT, layout=common_pb2.KV_LAYOUT_HND, block_size=16,
        num_kv_heads=4, total_num_kv_heads=8, head_dim=128, dtype=common_pb2.DTYPE_BFLOAT16, num_blocks=1000,
        tp_rank=1, tp_size=2,
    )  # fmt: skip
    fields: dict[str, object] = {
        "incarnation": "0123456789abcdef",
        "agent_name": "kvd-node-0123456789abcdef",
        "peer_address": "10.0.0.1:50151",
        "engines": [
            router_pb2.EngineSummary(
                engine_id="prefill",
                tp_rank=1,
                tp_size=2,
                registered_bytes=3 << 30,
                stream_connected=True,
                layout=layout,
            )
        ],  # fmt: skip
        "peers": [
            router_pb2.PeerSummary(
                address="10.0.0.2:50151", incarnation="fedcba9876543210", agent_name="kvd-b", last_contact_s_ago=125.0
            )
        ],  # fmt: skip
        "transfers_in_flight": 2,
        "leases_held": 5,
        "leases_draining": 1,
        "serving": True,
        "uptime_s": 7300.0,
        "metrics_address": "127.0.0.1:9464",
    }
    fields.update(overrides)
    return router_pb2.GetStatusResponse(**fields)  # type: ignore[arg-type]


METRICS = {
    "kvd_transfer_bytes_total|direction=pull": 4e9,
    "kvd_transfer_bytes_total|direction=serve": 0.0,
    "kvd_transfers_total|direction=pull|outcome=done": 40.0,
    "kvd_transfers_total|direction=pull|outcome=failed": 2.0,
    "kvd_errors_total|operation=StartPull|code=UNAVAILABLE": 2.0,
    "kvd_handshakes_total|outcome=ok": 3.0,
}


def test_the_view_names_engines_layouts_peers_leases_transfers_and_errors() -> None:
    text = render(Snapshot(_status(), METRICS, "", 100.0), None, "unix:///run/kvd/engine.sock")
    assert text.startswith("kvd 01234567 at unix:///run/kvd/engine.sock: serving, up 2h01m")
    assert "engines: 1 rank, 3.0 GiB registered" in text
    assert "prefill  1/2   connected  3.0 GiB" in text
    assert "32 layers, split K/V HND, 1000 blocks of 16, 4/8 heads x 128 bf16" in text
    assert "10.0.0.2:50151  fedcba98     2m05s ago" in text
    assert "leases: 5 held, 1 draining" in text and "transfers in flight: 2" in text
    pulled = next(line for line in text.splitlines() if line.strip().startswith("pulled"))
    assert "3.7 GiB" in pulled and "40 done, 2 failed, 0 aborted" in pulled
    assert "errors: 2" in text and "StartPull" in text and "UNAVAILABLE" in text


def test_watch_rates_are_over_the_refresh_interval() -> None:
    before = Snapshot(_status(), {**METRICS, "kvd_transfer_bytes_total|direction=pull": 1e9}, "", 100.0)
    now = Snapshot(_status(), METRICS, "", 102.0)
    text = render(now, before, "x:1")
    assert "rate over the last 2.0 s" in text
    assert "1.50 GB/s" in next(line for line in text.splitlines() if line.strip().startswith("pulled"))


def test_unreachable_metrics_and_a_stopping_daemon_are_said_plainly() -> None:
    snapshot = Snapshot(
        _status(serving=False, engines=[], peers=[]), {}, "metrics at 127.0.0.1:9464 unreachable: refused", 1.0
    )
    text = render(snapshot, None, "x:1")
    assert "NOT serving (shutting down)" in text
    assert "engines: none registered" in text and "peers: none contacted" in text
    assert "traffic: metrics at 127.0.0.1:9464 unreachable" in text


def test_json_has_every_field_and_numbers_as_numbers() -> None:
    empty = json.loads(json.dumps(message_to_dict(router_pb2.GetStatusResponse())))
    assert empty["transfers_in_flight"] == 0 and empty["leases_held"] == 0 and empty["serving"] is False
    assert empty["engines"] == [] and empty["metrics_address"] == ""
    full = message_to_dict(_status())
    assert full["engines"][0]["registered_bytes"] == 3 << 30  # uint64 as a number, not "3221225472"
    assert full["engines"][0]["layout"]["kv_format"] == "KV_FORMAT_SPLIT"
    assert full["peers"][0]["last_contact_s_ago"] == 125.0


def test_metrics_address_with_a_wildcard_host_uses_the_targets_host() -> None:
    assert metrics_address_for("0.0.0.0:9464", "10.0.0.7:50151") == "10.0.0.7:9464"
    assert metrics_address_for("0.0.0.0:9464", "unix:///run/kvd/engine.sock") == "127.0.0.1:9464"
    assert metrics_address_for("127.0.0.1:9464", "10.0.0.7:50151") == "127.0.0.1:9464"
    assert metrics_address_for("", "10.0.0.7:50151") == ""


def test_the_first_line_names_the_daemons_version_and_this_clis_where_they_differ() -> None:
    status = _status()
    for daemon_version, shown in (
        (kvd.__version__, f"version {kvd.__version__}"),
        ("0.1.9", f"version 0.1.9 (this kvd status: {kvd.__version__})"),
        ("", "version unknown (older than 0.2.0)"),
    ):
        status.version = daemon_version
        first = render(Snapshot(status, METRICS, "", 100.0), None, "127.0.0.1:50151").splitlines()[0]
        assert first.endswith(f"up 2h01m, {shown}"), first
