"""ops/prometheus/alerts.yml: promtool accepts it and its unit tests (alerts_test.yml) pass.

promtool comes from Debian's ``prometheus`` package (.ci/run installs it);
without it the test skips locally and fails under CI=true.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import IN_CI
from tests.test_grafana_dashboard import exported_metric_names

RULES = Path(__file__).resolve().parent.parent / "ops" / "prometheus"


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
