"""deploy/prometheus (alert rules and their unit tests) and deploy/grafana (the dashboard) stay true:
every metric they name is one the daemon exports, with labels it has; every alert has a summary
and a runbook section in docs/operations.md; promtool accepts the rules, their unit tests pass
(series that fire and series that must not), and it parses every dashboard query."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from kvd.core.metrics import Metrics

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "prometheus" / "kvd-alerts.yml"
RULE_TESTS = REPO / "deploy" / "prometheus" / "kvd-alerts.test.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "kvd-dashboard.json"
OPERATIONS = REPO / "docs" / "operations.md"

ANNOUNCED_METRICS: dict[str, frozenset[str]] = {
    # Metrics an open change announces before the daemon exports them (none today): the alert
    # rules and the dashboard may name them so that they work the day it lands. Remove one from
    # here when kvd/core/metrics.py exports it (test_announced_metrics_are_not_exported_yet fails
    # then, as a reminder), so that from then on it is checked like every other.
}
"""Sample name -> its label names, for metrics the assets may name before the daemon exports them."""

TARGET_METRICS: dict[str, frozenset[str]] = {"up": frozenset()}
"""Series Prometheus itself writes per scrape target."""

TARGET_LABELS = frozenset({"instance", "job"})
"""Labels Prometheus adds to every scraped series."""

PROMQL_WORDS = frozenset(
    [
        "sum",
        "min",
        "max",
        "avg",
        "count",
        "stddev",
        "stdvar",
        "topk",
        "bottomk",
        "quantile",
        "count_values",
        "group",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "and",
        "or",
        "unless",
        "bool",
        "offset",
        "rate",
        "irate",
        "increase",
        "delta",
        "idelta",
        "deriv",
        "histogram_quantile",
        "min_over_time",
        "max_over_time",
        "avg_over_time",
        "sum_over_time",
        "count_over_time",
        "quantile_over_time",
        "last_over_time",
        "absent",
        "absent_over_time",
        "changes",
        "resets",
        "predict_linear",
        "clamp_min",
        "clamp_max",
        "clamp",
        "abs",
        "ceil",
        "floor",
        "round",
        "time",
        "vector",
        "scalar",
        "label_replace",
        "label_join",
        "sort",
        "sort_desc",
        "label_values",
        "inf",
        "nan",
    ]
)

needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool is not installed (scripts/setup.sh installs it, Debian package prometheus, "
    "with apt-get when run as root; elsewhere install prometheus to run these checks)",
)


def exported_metrics() -> dict[str, frozenset[str]]:
    """Every sample name the daemon's registry exports -> its label names."""
    out: dict[str, frozenset[str]] = {}
    for metric in vars(Metrics()).values():
        if not isinstance(metric, MetricWrapperBase):
            continue
        name, kind, labels = metric._name, metric._type, frozenset(metric._labelnames)
        if kind == "counter":
            out |= {f"{name}_total": labels, f"{name}_created": labels}
        elif kind == "histogram":
            out |= {f"{name}_bucket": labels | {"le"}, f"{name}_sum": labels, f"{name}_count": labels}
            out[f"{name}_created"] = labels
        else:
            out[name] = labels
    return out


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _panels(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for panel in items:
        out.append(panel)
        out += _panels(panel.get("panels", []))
    return out


def dashboard_queries() -> list[str]:
    board = dashboard()
    queries = [t["expr"] for p in _panels(board["panels"]) for t in p.get("targets", [])]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            queries.append(variable["query"]["query"])
    return queries


def as_promql(query: str) -> str:
    """A dashboard query as plain PromQL: Grafana's variables replaced by what they stand for."""
    query = re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", query)  # label_values(series, label): a selector
    return query.replace("$__rate_interval", "5m").replace("$__range", "1h").replace("$instance", ".*")


def names_in(expr: str) -> tuple[set[str], list[tuple[str, set[str]]], set[str]]:
    """(metric names, [(metric, matcher label names)], grouping label names) of a PromQL expression."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)
    selectors = [
        (name, {m.split("=")[0].split("!")[0].strip() for m in body.split(",") if m.strip()})
        for name, body in re.findall(r"([a-zA-Z_:][\w:]*)\s*\{([^}]*)\}", expr)
    ]
    expr = re.sub(r"\{[^}]*\}", " ", expr)
    expr = re.sub(r"\[[^\]]*\]", " ", expr)
    grouping: set[str] = set()
    for body in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", expr):
        grouping |= {label.strip() for label in body.split(",") if label.strip()}
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    metrics = {word for word in re.findall(r"\b[a-zA-Z_:][\w:]*", expr) if word not in PROMQL_WORDS}
    return metrics, selectors, grouping


def unknown_names(expr: str, known: dict[str, frozenset[str]]) -> list[str]:
    """What ``expr`` names that ``known`` (sample name -> labels) lacks: metrics, and labels of them."""
    metrics, selectors, grouping = names_in(expr)
    problems = [f"metric {m}" for m in sorted(metrics) if m not in known]
    for metric, labels in selectors:
        if metric in known:
            problems += [f"label {label} of {metric}" for label in sorted(labels - known[metric] - TARGET_LABELS)]
    available = set(TARGET_LABELS).union(*(known.get(m, frozenset()) for m in metrics))
    problems += [f"label {label} (by/on)" for label in sorted(grouping - available)]
    return problems


def _known() -> dict[str, frozenset[str]]:
    return exported_metrics() | TARGET_METRICS | ANNOUNCED_METRICS


# --- every name is one the daemon exports ----------------------------------------------------------


@pytest.mark.parametrize("asset", ["alert rules", "dashboard"])
def test_assets_name_only_metrics_and_labels_the_daemon_exports(asset: str) -> None:
    queries = [r["expr"] for r in alert_rules()] if asset == "alert rules" else map(as_promql, dashboard_queries())
    known = _known()
    problems = {expr: found for expr in queries if (found := unknown_names(expr, known))}
    assert problems == {}, f"{asset} name what the daemon does not export (kvd/core/metrics.py)"


def test_the_name_check_catches_a_misspelled_metric_or_label() -> None:
    known = _known()
    assert unknown_names('rate(kvd_transfer_byte_total{direction="pull"}[5m])', known) == [
        "metric kvd_transfer_byte_total"
    ]
    assert unknown_names('kvd_held_bytes{engine="e"}', known) == ["label engine of kvd_held_bytes"]
    assert unknown_names("sum by (node) (kvd_peers)", known) == ["label node (by/on)"]
    assert (
        unknown_names('sum by (instance, le) (rate(kvd_transfer_duration_seconds_bucket{direction="pull"}[5m]))', known)
        == []
    )


def test_announced_metrics_are_not_exported_yet() -> None:
    """Once the daemon exports an announced metric, drop it from ANNOUNCED_METRICS (checked as any other)."""
    assert set(ANNOUNCED_METRICS) & set(exported_metrics()) == set()


def test_the_dashboard_covers_what_operators_watch_per_node() -> None:
    board = dashboard()
    queries = dashboard_queries()
    text = "\n".join(queries)
    for needed in (
        "kvd_transfer_bytes_total",  # throughput
        'kvd_transfers_total{direction="pull"',  # pulls by outcome
        "histogram_quantile(0.99, sum by (instance, le) (rate(kvd_transfer_duration_seconds_bucket",  # latency
        "kvd_leases_held",
        "kvd_held_bytes",  # holds
        "kvd_quarantined_bytes",
        "kvd_peers",
        "kvd_engines_registered",
        "kvd_build_info",
    ):
        assert needed in text, needed
    panels = [p for p in _panels(board["panels"]) if p["type"] != "row"]
    ids = [p["id"] for p in _panels(board["panels"])]
    assert len(ids) == len(set(ids))
    for panel in panels:
        assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert 'instance=~"$instance"' in target["expr"], (panel["title"], target["expr"])  # per node
            assert "{{instance}}" in target["legendFormat"], panel["title"]
    nodes = next(v for v in board["templating"]["list"] if v["name"] == "instance")
    assert nodes["query"]["query"] == "label_values(kvd_build_info, instance)" and nodes["includeAll"]


# --- alerts: summaries and runbooks ---------------------------------------------------------------------


def _anchors(markdown: str) -> dict[str, str]:
    """GitHub's anchor of every heading -> the section's text."""
    sections: dict[str, str] = {}
    current = None
    for line in markdown.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            current = re.sub(r"[^a-z0-9 _-]", "", title).replace(" ", "-")
            sections[current] = ""
        elif current is not None:
            sections[current] += line + "\n"
    return sections


def test_every_alert_has_a_severity_a_summary_and_a_runbook_section() -> None:
    sections = _anchors(OPERATIONS.read_text())
    rules = alert_rules()
    assert len({r["alert"] for r in rules}) == len(rules)
    for rule in rules:
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"].strip(), rule["alert"]
        doc, _, anchor = rule["annotations"]["runbook"].partition("#")
        assert doc == "docs/operations.md" and anchor in sections, rule["alert"]
        assert rule["alert"] in sections[anchor] or anchor == rule["alert"].lower(), rule["alert"]


def test_the_alerts_cover_what_an_operator_must_act_on() -> None:
    text = "\n".join(r["expr"] for r in alert_rules())
    for needed in (
        'up{job="kvd"}',
        "kvd_serving == 0",
        'kvd_errors_total{operation="pull"',
        "sum by (instance, code)",  # by class
        'kvd_leases_ended_total{reason="expired"}',
        "kvd_quarantined_bytes",
        "kvd_dataplane_restarts_total",
        "kvd_engines_registered",
    ):
        assert needed in text, needed


# --- promtool ----------------------------------------------------------------------------------------


def _promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["promtool", *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False)


@needs_promtool
def test_promtool_accepts_the_rules() -> None:
    result = _promtool("check", "rules", RULES.name, cwd=RULES.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in result.stdout


@needs_promtool
def test_the_rules_fire_on_their_test_series_and_stay_quiet_on_the_others() -> None:
    result = _promtool("test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    tested = {
        t["alertname"] for case in yaml.safe_load(RULE_TESTS.read_text())["tests"] for t in case["alert_rule_test"]
    }
    assert tested == {r["alert"] for r in alert_rules()}  # every alert has unit tests
    firing = {
        t["alertname"]
        for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for t in case["alert_rule_test"]
        if t.get("exp_alerts")
    }
    assert firing == tested  # and each is seen firing, not only quiet


@needs_promtool
def test_promtool_parses_every_dashboard_query(tmp_path: Path) -> None:
    """Each query, Grafana's variables substituted, as a recording rule: promtool parses its PromQL."""
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"kvd_dashboard:query_{i}", "expr": as_promql(q)}
                    for i, q in enumerate(dashboard_queries())
                ],
            }
        ]
    }
    (tmp_path / "dashboard-queries.yml").write_text(yaml.safe_dump(rules))
    result = _promtool("check", "rules", "dashboard-queries.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_operations_doc_lists_every_metric_the_daemon_exports() -> None:
    """docs/operations.md's metrics table: one row per metric (counters by their _total name)."""
    doc = OPERATIONS.read_text()
    rows = set(re.findall(r"^\| `(kvd_\w+)` \|", doc, flags=re.MULTILINE))
    exported = {
        name.removesuffix("_bucket") for name in exported_metrics() if not name.endswith(("_created", "_sum", "_count"))
    }
    assert exported | set(ANNOUNCED_METRICS) == rows
