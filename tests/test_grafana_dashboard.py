"""ops/grafana/paysync.json: valid JSON, the panels the issue asks for, and every query names a metric we export."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import payments.infra.metrics  # noqa: F401 - registers the process metrics in REGISTRY
from gateway.metrics import _SnapshotCollector
from payments.ops.monitoring import Snapshot

DASHBOARD = Path(__file__).resolve().parent.parent / "ops" / "grafana" / "paysync.json"
SUFFIXES = ("", "_total", "_created", "_bucket", "_sum", "_count")


def exported_metric_names() -> set[str]:
    """Every series name paysync can expose: the process registry's and the gateway's database gauges."""
    gauges = CollectorRegistry(auto_describe=False)
    gauges.register(_SnapshotCollector(Snapshot(), "disabled"))
    names = set()
    for text in (generate_latest(REGISTRY), generate_latest(gauges)):
        for family in text_string_to_metric_families(text.decode()):
            if family.name.startswith("paysync"):
                names |= {family.name + suffix for suffix in SUFFIXES}
    return names


def _panels(doc: dict) -> list[dict]:
    out = []
    for panel in doc["panels"]:
        out.append(panel)
        out += panel.get("panels", [])  # collapsed rows hold their panels
    return out


def test_every_panel_query_names_a_metric_we_export():
    doc = json.loads(DASHBOARD.read_text())
    exported = exported_metric_names()
    assert "paysync_callbacks_received_total" in exported and "paysync_callbacks" in exported
    checked = 0
    for panel in _panels(doc):
        for target in panel.get("targets", []):
            names = re.findall(r"\b(paysync[a-z0-9_:]*)", re.sub(r'"[^"]*"', "", target["expr"]))
            assert names, f"panel {panel['title']!r}: a query that names no paysync metric"
            for name in names:
                assert name in exported, f"panel {panel['title']!r}: {name} is not a metric paysync exports"
                checked += 1
    assert checked >= 20


def test_it_has_the_panels_operators_need():
    titles = " | ".join(p["title"].lower() for p in _panels(json.loads(DASHBOARD.read_text())))
    for wanted in (
        "backlog by status",
        "ack latency",
        "processing latency",
        "failure rate",
        "unknown payments by age",
        "manual queue",
        "provider call outcomes",
    ):
        assert wanted in titles, wanted


def test_panel_ids_are_unique():
    ids = [p["id"] for p in _panels(json.loads(DASHBOARD.read_text()))]
    assert len(ids) == len(set(ids))


def _panel(title: str) -> dict:
    (panel,) = [p for p in _panels(json.loads(DASHBOARD.read_text())) if p["title"] == title]
    return panel


def test_panels_in_seconds_plot_only_durations():
    # "Outbox lag" once plotted the pending count as seconds beside the age of the oldest row.
    checked = 0
    for panel in _panels(json.loads(DASHBOARD.read_text())):
        if panel.get("fieldConfig", {}).get("defaults", {}).get("unit") != "s":
            continue
        for target in panel["targets"]:
            for name in re.findall(r"\b(paysync[a-z0-9_:]*)", target["expr"]):
                assert name.endswith(("_seconds", "_seconds_bucket")), f"{panel['title']!r}: {name} is not seconds"
                checked += 1
    assert checked >= 5
    assert [t["expr"] for t in _panel("Outbox lag")["targets"]] == ["max(paysync_outbox_oldest_pending_seconds)"]
    assert "paysync_outbox_pending" in _panel("Outbox pending by event type")["targets"][0]["expr"]


def test_database_and_broker_down_shows_red_and_says_down():
    panel = _panel("Database and broker")
    defaults = panel["fieldConfig"]["defaults"]
    steps = defaults["thresholds"]["steps"]
    assert defaults["color"]["mode"] == "thresholds" and panel["options"]["colorMode"] == "background"
    assert steps[0] == {"color": "red", "value": None} and steps[1]["color"] == "green" and steps[1]["value"] == 1
    (values,) = [m["options"] for m in defaults["mappings"] if m["type"] == "value"]
    assert (values["0"]["text"], values["0"]["color"]) == ("down", "red")
    assert (values["1"]["text"], values["1"]["color"]) == ("up", "green")
    assert defaults["noValue"]  # the gateway unscraped: no number, and it says so
    database, broker = (t["expr"] for t in panel["targets"])
    assert database == "max(paysync_database_up)"
    assert 'state="connected"' in broker and "0 * max(paysync_broker_connected)" in broker  # disconnected: 0


def test_tables_of_what_is_open_now_are_instant_queries():
    panel = _panel("Open alerts")
    for target in panel["targets"]:
        assert target.get("instant") is True and target.get("range") is False and target.get("format") == "table"


def test_unknown_payments_by_age_uses_the_consoles_buckets():
    from payments.ops import actions as ops_actions
    from payments.ops.monitoring import UNKNOWN_AGE_BUCKETS
    from payments.reconciliation import aging

    labels = [label for label, _ in UNKNOWN_AGE_BUCKETS] + ["older"]
    assert labels == list(aging.BUCKETS) == list(ops_actions.BUCKETS)
    gauges = CollectorRegistry(auto_describe=False)
    gauges.register(_SnapshotCollector(Snapshot(), "disabled"))
    (family,) = [
        f
        for f in text_string_to_metric_families(generate_latest(gauges).decode())
        if f.name == "paysync_unknown_payments"
    ]
    assert [s.labels["age"] for s in family.samples] == labels
    assert _panel("Unknown payments by age")["targets"][0]["legendFormat"] == "{{age}}"


def test_the_failure_rate_panel_is_the_alerts_ratio():
    from tests.test_prometheus_rules import _expanded

    def bare(text: str) -> str:  # brackets and spaces aside: the same selectors, windows and operators
        return re.sub(r"[()\s]", "", text)

    expr = _panel("Callback failure rate (10 min)")["targets"][0]["expr"]
    assert bare(expr) == bare(_expanded("paysync:callback_failure_ratio:10m"))
