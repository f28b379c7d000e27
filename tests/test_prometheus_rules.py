"""ops/prometheus/alerts.yml: promtool accepts it, its unit tests (alerts_test.yml) fire and resolve every alert,
and it agrees with paysync's own rules (ops/alert_rules.toml), so the two cannot drift apart.

promtool comes from Debian's ``prometheus`` package (.ci/run installs it);
without it the promtool tests skip locally and fail under CI=true.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from payments.escalation import evaluators as alert_evaluators
from payments.escalation.rules import DEFAULT_RULES_FILE, load_rules
from tests.conftest import IN_CI
from tests.test_grafana_dashboard import exported_metric_names

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "ops" / "prometheus"
PROMETHEUS_ONLY = {"database_down", "unknown_payments_aging", "web_down", "consumer_down", "compensator_down"}
"""Alerts about paysync's own processes and telemetry: nothing in paysync can raise them about itself."""
MIRROR = re.compile(r'paysync_alert_open\{rule="([a-z_]+)", status="firing"\}')
"""How an alert reads paysync's own open alert of its rule."""


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        message = "promtool not installed (apt-get install prometheus)"
        if IN_CI:
            pytest.fail(message + " and CI=true", pytrace=False)
        pytest.skip(message)
    return path


def test_promtool_checks_the_rules():
    done = subprocess.run([_promtool(), "check", "rules", str(RULES / "alerts.yml")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_unit_tests_pass():
    done = subprocess.run(
        [_promtool(), "test", "rules", str(RULES / "alerts_test.yml")], capture_output=True, text=True, cwd=RULES
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_has_a_unit_test_and_names_a_rule():
    rules = yaml.safe_load((RULES / "alerts.yml").read_text())
    tests = yaml.safe_load((RULES / "alerts_test.yml").read_text())
    alerts = {r["alert"]: r for g in rules["groups"] for r in g["rules"] if "alert" in r}
    tested = {a["alertname"] for t in tests["tests"] for a in t.get("alert_rule_test", [])}
    assert set(alerts) - tested == set()
    for name, rule in alerts.items():
        assert rule["labels"]["rule"] and rule["labels"]["severity"] in ("info", "warning", "critical"), name


def test_the_rules_read_only_metrics_we_export():
    rules = yaml.safe_load((RULES / "alerts.yml").read_text())
    exported = exported_metric_names()
    recorded = {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    for group in rules["groups"]:
        for rule in group["rules"]:
            for name in re.findall(r"\b(paysync[a-z0-9_:]*)", re.sub(r'"[^"]*"', "", rule["expr"])):
                assert name in exported or name in recorded, f"{rule.get('alert') or rule['record']}: {name}"


def _alerts() -> dict[str, dict]:
    rules = yaml.safe_load((RULES / "alerts.yml").read_text())
    return {r["alert"]: r for g in rules["groups"] for r in g["rules"] if "alert" in r}


def _expanded(expr: str) -> str:
    """``expr`` with every recording rule it reads replaced by the expression it records (repeatedly)."""
    rules = yaml.safe_load((RULES / "alerts.yml").read_text())
    recorded = {r["record"]: r["expr"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    for _ in range(5):
        for name, body in recorded.items():
            expr = re.sub(rf"(?<![a-z_:]){re.escape(name)}(?![a-z0-9_:])", f"({body})", expr)
    return " ".join(expr.split())


def _seconds(duration: str) -> int:
    units = {"s": 1, "m": 60, "h": 3600}
    return sum(int(n) * units[u] for n, u in re.findall(r"(\d+)([smh])", duration))


def _duration(seconds: int) -> str:
    return f"{seconds // 3600}h" if seconds % 3600 == 0 else f"{seconds // 60}m" if seconds % 60 == 0 else f"{seconds}s"


def test_every_alert_has_for_a_runbook_and_a_description():
    for name, rule in _alerts().items():
        assert "for" in rule and _seconds(rule["for"]) >= 60, name
        assert rule["annotations"]["runbook_url"] == f"docs/runbooks/{rule['labels']['rule']}.md", name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name


def test_one_alert_per_toml_rule_with_its_severity_description_threshold_window_and_sustain():
    toml = load_rules(str(DEFAULT_RULES_FILE))
    by_rule = {}
    for alert in _alerts().values():
        assert alert["labels"]["rule"] not in by_rule, f"two alerts for {alert['labels']['rule']}"
        by_rule[alert["labels"]["rule"]] = alert
    assert set(toml.rules) == set(alert_evaluators.EVALUATORS) | set(alert_evaluators.EVALUATED_ELSEWHERE)
    assert set(by_rule) - set(toml.rules) == PROMETHEUS_ONLY
    assert set(toml.rules) - set(by_rule) == set(), "a paysync rule with no Prometheus alert"
    for name, rule in toml.rules.items():
        alert = by_rule[name]
        where = f"{alert['alert']} ({name})"
        assert alert["labels"]["severity"] == rule.severity, where
        assert alert["annotations"]["description"] == rule.description, where
        expr = _expanded(alert["expr"])
        mirrored = MIRROR.findall(expr)
        assert set(mirrored) <= {name}, where
        if name in alert_evaluators.EVALUATED_ELSEWHERE:
            assert mirrored == [name], f"{where}: must stay open while paysync's alert is"
        if mirrored:
            # paysync sustained it before marking it firing: one minute more here, not the sustain twice.
            assert alert["for"] == "1m", where
            continue
        assert _seconds(alert["for"]) == (rule.sustain_seconds or 60), where
        if rule.threshold is not None:
            assert re.search(rf"(?<![\d.])[<>]=? {rule.threshold:g}(?![\d.])", expr), f"{where}: threshold"
        if rule.window_seconds is not None:
            assert f"[{_duration(rule.window_seconds)}]" in expr, f"{where}: window"
        if rule.min_sample is not None:
            assert f">= {rule.min_sample}" in expr, f"{where}: min_sample"


def test_the_check_of_the_two_files_notices_a_drift(tmp_path, monkeypatch):
    # A threshold changed in the TOML only is caught: the comparison above can fail.
    text = DEFAULT_RULES_FILE.read_text().replace("threshold = 100 ", "threshold = 150 ", 1)
    assert "threshold = 150" in text
    (tmp_path / "rules.toml").write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "DEFAULT_RULES_FILE", tmp_path / "rules.toml")
    with pytest.raises(AssertionError, match="PaysyncCallbackBacklog .callback_backlog.: threshold"):
        test_one_alert_per_toml_rule_with_its_severity_description_threshold_window_and_sustain()


def test_every_scrape_job_has_an_up_and_an_absent_alert():
    scrape = yaml.safe_load((RULES / "prometheus.yml").read_text())
    jobs = [job["job_name"] for job in scrape["scrape_configs"]]
    assert jobs == ["paysync-web", "paysync-consumer", "paysync-compensator"]
    exprs = [" ".join(a["expr"].split()) for a in _alerts().values()]
    for job in jobs:
        assert [e for e in exprs if f'up{{job="{job}"}}) == 0' in e and f'absent(up{{job="{job}"}})' in e], job


def test_the_prometheus_only_rules_have_their_runbook_pages():
    for rule in sorted(PROMETHEUS_ONLY):
        page = ROOT / "docs" / "runbooks" / f"{rule}.md"
        assert page.is_file(), page
        text = page.read_text()
        for part in ("## What it means", "## What to check", "## What to do"):
            assert part in text, f"{page}: {part}"


def test_every_alert_fires_and_resolves_in_the_unit_tests():
    tests = yaml.safe_load((RULES / "alerts_test.yml").read_text())
    fired, resolved = set(), set()
    for group in tests["tests"]:
        seen_firing: dict[str, int] = {}
        checks = sorted(group.get("alert_rule_test", []), key=lambda c: _seconds(c["eval_time"]))
        for check in checks:
            name, at = check["alertname"], _seconds(check["eval_time"])
            if check["exp_alerts"]:
                fired.add(name)
                seen_firing.setdefault(name, at)
            elif name in seen_firing and at > seen_firing[name]:
                resolved.add(name)
    assert set(_alerts()) - fired == set(), "alerts no unit test shows firing"
    assert set(_alerts()) - resolved == set(), "alerts no unit test shows resolving after firing"


def test_the_metrics_ports_default_to_the_example_scrape_targets():
    from payments.infra.settings import load_settings

    scrape = yaml.safe_load((RULES / "prometheus.yml").read_text())
    targets = {job["job_name"]: job["static_configs"][0]["targets"][0] for job in scrape["scrape_configs"]}
    settings = load_settings({"PAYSYNC_ENV": "development"})
    assert targets["paysync-web"] == f"127.0.0.1:{settings.port}"
    assert targets["paysync-consumer"] == f"127.0.0.1:{settings.consumer_metrics_port}"
    assert targets["paysync-compensator"] == f"127.0.0.1:{settings.compensator_metrics_port}"
