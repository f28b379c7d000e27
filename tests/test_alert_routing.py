"""Default routing (ops/alert_rules.toml, docs/operations/alert-routing.md): every rule goes to every channel class
its severity calls for, so whichever channels an operator configures hear the main alerts."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from sqlalchemy import insert

from compensator import evaluate_alerts, notify_alerts
from payments.escalation import review
from payments.escalation import rules as alert_rules
from payments.escalation.notifications import _targets
from payments.escalation.notify import CHANNEL_NAMES
from payments.escalation.notify.channels import enabled_channels
from payments.infra.db import utcnow
from payments.infra.schema import payment_callback_log
from payments.infra.settings import load_settings
from payments.runtime import build_runtime
from payments.states import CallbackStatus
from tests.notify_fakes import FakeService
from tests.stack import db_url
from tests.support import make_settings

SMS = {"sms", "aliyun_sms"}
CHAT = {"dingtalk", "feishu", "wecom", "slack"}
BY_SEVERITY = {
    "critical": {"email", "webhook"} | SMS | CHAT,
    "warning": {"email", "webhook"} | CHAT,
    "info": {"email", "webhook"} | CHAT,
}
"""What docs/operations/alert-routing.md promises for each severity."""


def _shipped() -> alert_rules.RuleSet:
    return alert_rules.load_rules(str(alert_rules.DEFAULT_RULES_FILE))


@pytest.mark.fast
def test_every_shipped_rule_goes_to_every_channel_class_its_severity_calls_for():
    rules = _shipped()
    assert set(BY_SEVERITY["critical"]) == set(CHANNEL_NAMES)  # a new channel must be placed in the routing
    for rule in [rules.defaults, *rules.rules.values()]:
        assert set(rule.channels) == BY_SEVERITY[rule.severity], rule.name


@pytest.mark.fast
@pytest.mark.parametrize(
    "rule",
    ["callback_backlog", "callback_failure_rate", "callback_gave_up", "unresolved_payment", "unresolved_refund"],
)
def test_with_only_a_dingtalk_url_the_main_alerts_go_to_dingtalk(rule):
    settings = load_settings(
        {"PAYSYNC_ENV": "development", "DINGTALK_WEBHOOK_URL": "https://oapi.dingtalk.com/robot/send?access_token=x"}
    )
    configured = enabled_channels(settings)
    assert configured == ["dingtalk"]
    assert _targets(_shipped(), rule, None, configured) == ["dingtalk"]


def test_a_dingtalk_only_setup_hears_the_backlog_the_failure_rate_and_the_manual_queue(engine):
    with FakeService("dingtalk") as robot:
        runtime = build_runtime(
            make_settings(database_url=db_url(engine), dingtalk_webhook_url=robot.url), engine=engine
        )
        t0 = utcnow() - timedelta(minutes=6)
        with engine.begin() as conn:
            # 101 waiting, 30 of them retried: the backlog (over 100 for 5 min) and the failure rate (over 5%).
            conn.execute(
                insert(payment_callback_log),
                [
                    {
                        "provider": "sandbox",
                        "callback_data": b"{}",
                        "headers": "{}",
                        "status": CallbackStatus.FAILED if i < 30 else CallbackStatus.PENDING,
                        "retry_count": 1 if i < 30 else 0,
                        "next_retry_at": t0 + timedelta(hours=1),
                        "create_time": t0,
                        "update_time": t0,
                    }
                    for i in range(101)
                ],
            )
            for kind in ("callback_gave_up", "unresolved_payment"):
                review.escalate(conn, kind=kind, subject=f"{kind}:1", reason=f"{kind} 1", now=t0)
        evaluate_alerts.run_once(runtime, now=t0)
        evaluate_alerts.run_once(runtime, now=t0 + timedelta(seconds=301))
        notify_alerts.run_once(runtime, now=t0 + timedelta(seconds=301))
        # unresolved_payment's group (deadline) gathers for 60 s before its one notice goes.
        notify_alerts.run_once(runtime, now=t0 + timedelta(seconds=362))
    heard = " ".join(json.dumps(r.data, ensure_ascii=False) for r in robot.received)
    for rule in ("callback_backlog", "callback_failure_rate", "callback_gave_up", "unresolved_payment"):
        assert rule in heard, rule
