"""Alert channels against what the vendors enforce: keyword security, the codes that mean "give up", Slack's limits.

Each fake (tests/notify_fakes.py) checks the signature and, here, the robot's
keyword the way DingTalk and Feishu document them; the alerts are real ones,
raised by evaluate_alerts and sent by notify_alerts.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta

import pytest
from sqlalchemy import insert, select, update

from compensator import evaluate_alerts, notify_alerts
from payments.errors import NotificationFailed
from payments.escalation.notify import FIRING, Notice
from payments.escalation.notify.channels import build_channels
from payments.infra.db import utcnow
from payments.infra.schema import alert_notification, payment_callback_log
from payments.runtime import build_runtime
from payments.states import CallbackStatus
from tests.notify_fakes import TOKEN, FakeService
from tests.stack import db_url
from tests.support import make_settings

RULES = """
[defaults]
channels = ["dingtalk", "feishu"]
cooldown_seconds = 0

[rules.callback_backlog]
threshold = 2
sustain_seconds = 0
severity = "critical"
channels = ["dingtalk", "feishu"]
"""

NOTICE = Notice(
    kind=FIRING,
    rule="conflicting_report",
    severity="critical",
    message="sandbox reported success for a Failed payment",
    key="conflicting_report:pay_1",
    alert_id=7,
)


def _backlog(engine, count: int, at: datetime) -> None:
    row = {"provider": "sandbox", "callback_data": b"{}", "headers": "{}", "status": CallbackStatus.PENDING}
    with engine.begin() as conn:
        conn.execute(
            insert(payment_callback_log), [{**row, "next_retry_at": at, "create_time": at, "update_time": at}] * count
        )


def test_real_alerts_reach_dingtalk_and_feishu_robots_with_keyword_security(engine, tmp_path):
    rules = tmp_path / "rules.toml"
    rules.write_text(RULES)
    with (
        FakeService("dingtalk", secret="SECding", keywords=("paysync",)) as ding,
        FakeService("feishu", secret="fei-secret", keywords=("paysync",)) as fei,
    ):
        settings = make_settings(
            database_url=db_url(engine),
            alert_rules_file=str(rules),
            alert_channel_timeout_seconds=5.0,
            dingtalk_webhook_url=ding.url,
            dingtalk_secret=("SECding",),
            feishu_webhook_url=fei.url,
            feishu_secret=("fei-secret",),
        )
        runtime = build_runtime(settings, engine=engine)
        t0 = utcnow()
        _backlog(engine, 3, t0)
        evaluate_alerts.run_once(runtime, now=t0)
        assert notify_alerts.run_once(runtime, now=t0) == 2  # one notification per channel
        with engine.begin() as conn:  # the backlog clears: the resolved notice goes out too
            conn.execute(update(payment_callback_log).values(status=CallbackStatus.PROCESSED))
        evaluate_alerts.run_once(runtime, now=t0 + timedelta(seconds=60))
        assert notify_alerts.run_once(runtime, now=t0 + timedelta(seconds=60)) == 2
    assert ding.refused == [] and fei.refused == []
    assert [r.data["markdown"]["title"] for r in ding.received] == [
        "[CRITICAL] callback_backlog firing",
        "[RESOLVED] callback_backlog",
    ]
    assert [r.data["card"]["header"]["title"]["content"] for r in fei.received] == [
        "[CRITICAL] callback_backlog firing",
        "[RESOLVED] callback_backlog",
    ]
    with engine.connect() as conn:
        rows = conn.execute(select(alert_notification.c.channel, alert_notification.c.status)).all()
    assert sorted(rows) == [("dingtalk", "sent")] * 2 + [("feishu", "sent")] * 2


def _send(name: str, notice: Notice = NOTICE, **settings) -> str:
    channel = build_channels(make_settings(alert_channel_timeout_seconds=5.0, **settings))[name]
    try:
        return channel.send(notice)
    finally:
        channel.close()


def _fails(name: str, notice: Notice = NOTICE, **settings) -> NotificationFailed:
    with pytest.raises(NotificationFailed) as info:
        _send(name, notice, **settings)
    return info.value


def test_a_feishu_card_cut_to_20_kb_keeps_the_keyword():
    huge = replace(NOTICE, message="x" * 30000, details={f"d{i}": "y" * 190 for i in range(200)})
    with FakeService("feishu", keywords=("paysync",)) as fei:
        _send("feishu", huge, feishu_webhook_url=fei.url)
    assert fei.refused == [] and len(fei.received) == 1


def test_a_robot_whose_keyword_is_missing_refuses_permanently():
    with FakeService("dingtalk", keywords=("something-else",)) as ding:
        error = _fails("dingtalk", dingtalk_webhook_url=ding.url)
    assert ding.refused == ["keywords not in content"] and error.permanent and "310000" in str(error)
    with FakeService("feishu", keywords=("something-else",)) as fei:
        error = _fails("feishu", feishu_webhook_url=fei.url)
    assert fei.refused == ["Key Words Not Found"] and error.permanent and "19024" in str(error)


# --- revoked tokens give up at once; throttling is retried -------------------------------------------------


def test_a_revoked_dingtalk_token_gives_up_at_once():
    with FakeService("dingtalk") as ding:
        error = _fails("dingtalk", dingtalk_webhook_url=ding.url.replace(TOKEN, "revoked"))
    assert error.permanent and "300001" in str(error) and "revoked" not in str(error)


@pytest.mark.parametrize(
    ("code", "permanent", "retry_after"),
    [(300005, True, None), (400013, True, None), (430102, True, None), (410100, False, 60.0), (-1, False, None)],
)
def test_dingtalk_codes_are_classified_as_documented(code, permanent, retry_after):
    with FakeService("dingtalk") as ding:
        ding.fail_with = (200, {"errcode": code, "errmsg": "x"})
        error = _fails("dingtalk", dingtalk_webhook_url=ding.url)
    assert (error.permanent, error.retry_after) == (permanent, retry_after)


def test_a_revoked_feishu_webhook_gives_up_at_once():
    with FakeService("feishu") as fei:
        error = _fails("feishu", feishu_webhook_url=fei.url.replace(TOKEN, "revoked"))
    assert error.permanent and "19001" in str(error) and "revoked" not in str(error)


def test_feishu_frequency_limit_is_retried():
    with FakeService("feishu") as fei:
        fei.fail_with = (200, {"code": 11232, "msg": "frequency limited", "data": {}})
        error = _fails("feishu", feishu_webhook_url=fei.url)
    assert not error.permanent


# --- Slack -------------------------------------------------------------------------------------------------


def test_slack_escapes_the_text_fallback_and_folds_fields_past_ten_into_a_section():
    details = {f"detail_{i:02}": f"value {i} <!here> & co" for i in range(14)}
    notice = replace(NOTICE, message="<!channel> backlog & <http://evil.example|bank>", details=details)
    with FakeService("slack") as slack:
        _send("slack", notice, slack_webhook_url=slack.url)
    assert slack.refused == []
    data = slack.received[0].data
    assert "<" not in data["text"] and "&lt;!channel&gt; backlog &amp; &lt;http://evil.example|bank&gt;" in data["text"]
    fields = [f["text"] for b in data["blocks"] if "fields" in b for f in b["fields"]]
    rest = "\n".join(b["text"]["text"] for b in data["blocks"][3:])
    assert len(fields) == 10
    for name in details:  # every detail is shown, in a field or in the section after them
        assert sum(name in text for text in [*fields, rest]) == 1
    assert "<" not in rest and "value 13 &lt;!here&gt; &amp; co" in rest
