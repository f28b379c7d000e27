"""ops/grafana/paysync.json: valid JSON, the panels the issue asks for, and every query names a metric we export."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import payments.metrics  # noqa: F401 - registers the process metrics in REGISTRY
from gateway.metrics import _SnapshotCollector
from payments.monitoring import Snapshot

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
