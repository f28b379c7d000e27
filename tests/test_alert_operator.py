"""Alerts an operator can act on: one notice per cause, links to the console and the runbook, @-mentions.

The alerts are real (raised by the code that raises them, evaluate_alerts)
and sent by notify_alerts to the fake robots of tests/notify_fakes.py, which
check the mention payload the way each vendor documents it.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select, update

from compensator import evaluate_alerts, notify_alerts
from payments.errors import ConfigError
from payments.escalation import evaluators as alert_evaluators
from payments.escalation import rules as alert_rules
from payments.escalation.notify import (
    FIRING,
    RESOLVED,
    Notice,
    dingtalk,
    feishu,
    links,
    render,
    slack,
    sms_http,
    smtp,
    webhook,
    wecom,
)
from payments.infra.db import utcnow
from payments.infra.schema import alert, alert_notification, payment
from payments.outbound.protocol import review
from payments.runtime import build_runtime
from tests.notify_fakes import FakeService
from tests.stack import db_url
from tests.support import create_payment, make_settings

SHIPPED = alert_rules.parse_rules(alert_rules.DEFAULT_RULES_FILE.read_text(), "shipped")


def _rules(tmp_path, text: str) -> str:
    path = tmp_path / "rules.toml"
    path.write_text(text)
    return str(path)


def _overdue_payments(engine, count: int, now) -> list[str]:
    ids = [create_payment(engine, status="Unknown") for _ in range(count)]
    with engine.begin() as conn:
        conn.execute(update(payment).values(deadline_at=now - timedelta(minutes=5)))
    return ids


# --- finding 10: one cause pages once ------------------------------------------------------------------


@pytest.mark.mariadb
def test_past_deadline_and_its_three_unresolved_payments_page_once_listing_them(mariadb, tmp_path):
    # The shipped rules, routed to Slack: past_deadline and unresolved_payment are one group ("deadline").
    text = alert_rules.DEFAULT_RULES_FILE.read_text().replace('channels = ["email"]', 'channels = ["email", "slack"]')
    with FakeService("slack") as slack_fake:
        settings = make_settings(
            database_url=db_url(mariadb),
            alert_rules_file=_rules(tmp_path, text),
            slack_webhook_url=slack_fake.url,
            alert_channel_timeout_seconds=5.0,
        )
        runtime = build_runtime(settings, engine=mariadb)
        t0 = utcnow()
        ids = _overdue_payments(mariadb, 3, t0)
        evaluate_alerts.run_once(runtime, now=t0)  # past_deadline:payment fires (critical)
        assert notify_alerts.run_once(runtime, now=t0) == 0  # the group waits for the rest of its cause
        # query_unresolved reaches the deadline of each, a few seconds later: one review and alert each.
        with mariadb.begin() as conn:
            for payment_id in ids:
                current = conn.execute(select(payment).where(payment.c.payment_id == payment_id)).mappings().one()
                review(conn, current, "unresolved_payment", "still Unknown at its deadline", t0 + timedelta(seconds=5))
        assert notify_alerts.run_once(runtime, now=t0 + timedelta(seconds=10)) == 0
        assert notify_alerts.run_once(runtime, now=t0 + timedelta(seconds=61)) == 1
        assert notify_alerts.run_once(runtime, now=t0 + timedelta(seconds=120)) == 0
    assert slack_fake.refused == []
    [notice] = slack_fake.received
    assert notice.data["blocks"][0]["text"]["text"] == "[CRITICAL] past_deadline firing (+3 related)"
    body = str(notice.data)
    assert all(f"unresolved_payment ({'warning'}): payment {p}" in body for p in ids)
    with mariadb.connect() as conn:
        rows = conn.execute(
            select(alert.c.rule, alert_notification.c.status, alert_notification.c.grouped_into)
            .select_from(alert_notification.join(alert, alert.c.id == alert_notification.c.alert_id))
            .where(alert_notification.c.kind == FIRING)
        ).all()
    assert sorted((r.rule, r.status, r.grouped_into is None) for r in rows) == [
        ("past_deadline", "sent", True),
        *[("unresolved_payment", "sent", False)] * 3,
    ]


def test_alerts_about_one_payment_are_one_notice_and_others_are_not(engine, tmp_path):
    rules = '[defaults]\nchannels = ["slack"]\ncooldown_seconds = 0\n'
    with FakeService("slack") as slack_fake:
        settings = make_settings(
            database_url=db_url(engine), alert_rules_file=_rules(tmp_path, rules), slack_webhook_url=slack_fake.url
        )
        runtime = build_runtime(settings, engine=engine)
        t0 = utcnow()
        one, other = create_payment(engine, status="Unknown"), create_payment(engine, status="Unknown")
        with engine.begin() as conn:
            for payment_id, kinds in ((one, ("unresolved_payment", "provider_answer_needs_review")), (other, ("x",))):
                current = conn.execute(select(payment).where(payment.c.payment_id == payment_id)).mappings().one()
                for kind in kinds:
                    review(conn, current, kind if kind != "x" else "unresolved_payment", "late", t0)
        assert notify_alerts.run_once(runtime, now=t0) == 2
    titles = sorted(r.data["blocks"][0]["text"]["text"] for r in slack_fake.received)
    # one's two reviews are one notice (the first raised carries the other); the other payment's is its own
    assert titles == ["[WARNING] unresolved_payment firing", "[WARNING] unresolved_payment firing (+1 related)"]


# --- links: the console page of the subject, the runbook ---------------------------------------------------

NOTICE = Notice(
    kind=FIRING,
    rule="conflicting_report",
    severity="critical",
    message="sandbox reported success for a Failed payment",
    key="conflicting_report:payment:pay_1",
    alert_id=7,
    details={"manual_review_id": 12, "payment_id": "pay_1"},
)


def _bodies(notice: Notice) -> dict[str, str]:
    """What each channel would send for ``notice``, as text."""
    return {
        "email": smtp.build_message(notice, "paysync@example.com", ["ops@example.com"]).as_string(),
        "sms": sms_http.values(notice)["text"],
        "dingtalk": str(dingtalk.payload(notice)),
        "feishu": str(feishu.payload(notice)),
        "wecom": str(wecom.payload(notice)),
        "slack": str(slack.payload(notice)),
        "webhook": str(webhook.payload(notice)),
    }


def test_every_channel_links_the_console_page_of_the_subject_and_the_runbook():
    dressed = links.dress(NOTICE, NOTICE.mentions, "https://pay.example.com", "")
    for channel, body in _bodies(dressed).items():
        assert "https://pay.example.com/ops/reviews/12" in body, channel
        if channel != "sms":  # an SMS carries the console link only: 160 characters
            assert "https://pay.example.com/ops/runbooks/conflicting_report" in body, channel
    assert "[https://pay.example.com/ops/reviews/12](https://pay.example.com/ops/reviews/12)" in render.markdown(
        dressed
    )
    published = links.dress(NOTICE, NOTICE.mentions, "", "https://git.example.com/paysync/blob/main/docs/runbooks/")
    assert dict(published.links)[render.RUNBOOK] == (
        "https://git.example.com/paysync/blob/main/docs/runbooks/conflicting_report.md"
    )


def test_without_a_console_url_a_notice_names_the_page_and_the_runbook_but_links_nothing():
    dressed = links.dress(NOTICE, NOTICE.mentions)
    assert dict(dressed.links) == {"Console": "/ops/reviews/12", "Runbook": "docs/runbooks/conflicting_report.md"}
    for channel, body in _bodies(dressed).items():
        assert "http" not in body.replace("https://pay", ""), channel  # no link that leads nowhere
    assert "](" not in render.markdown(dressed)
    alone = links.dress(
        Notice(kind=FIRING, rule="callback_backlog", severity="critical", message="m", key="k", alert_id=3),
        NOTICE.mentions,
    )
    assert dict(alone.links)["Console"] == "/ops/alerts/3"


def test_every_rule_has_its_runbook_page_saying_what_it_means_what_to_check_and_what_to_do():
    from tests.test_prometheus_rules import PROMETHEUS_ONLY  # alerts of Prometheus's own (up, absent), runbooks too

    rules = {*SHIPPED.rules, *alert_evaluators.EVALUATORS, *alert_evaluators.EVALUATED_ELSEWHERE, *PROMETHEUS_ONLY}
    pages = {p.stem for p in links.RUNBOOKS_DIR.glob("*.md")}
    assert rules - pages == set(), "write docs/runbooks/<rule>.md for these"
    assert pages - rules == set(), "runbooks of rules that do not exist"
    for rule in rules:
        text = (links.RUNBOOKS_DIR / f"{rule}.md").read_text()
        assert text.startswith(f"# {rule}\n"), rule
        for heading in ("## What it means", "## What to check", "## What to do"):
            assert heading in text, f"{rule}: {heading}"
            section = text.split(heading, 1)[1].split("\n## ", 1)[0]
            assert len(section.strip()) > 80, f"{rule}: {heading} says too little"


# --- @-mentions, per rule and per severity -------------------------------------------------------------------

MENTION_RULES = """
[defaults]
channels = ["dingtalk", "wecom", "feishu"]
cooldown_seconds = 0

[mentions.critical]
dingtalk_mobiles = ["13800000000"]
feishu_all = true

[mentions.warning]
dingtalk_mobiles = ["13999999999"]

[rules.callback_backlog]
threshold = 2
severity = "critical"
channels = ["dingtalk", "wecom", "feishu"]
mentions = { dingtalk_user_ids = ["manager01"], wecom_user_ids = ["zhangsan"], feishu_open_ids = ["ou_0123abcd"] }
"""


def test_a_firing_alert_mentions_the_people_of_its_rule_and_severity_as_each_robot_documents_it(engine, tmp_path):
    from tests.test_notify_vendor_rules import _backlog

    with (
        FakeService("dingtalk", secret="SECding", keywords=("paysync",)) as ding,
        FakeService("feishu", secret="fei-secret", keywords=("paysync",)) as fei,
        FakeService("wecom") as wec,
    ):
        settings = make_settings(
            database_url=db_url(engine),
            alert_rules_file=_rules(tmp_path, MENTION_RULES),
            alert_channel_timeout_seconds=5.0,
            dingtalk_webhook_url=ding.url,
            dingtalk_secret=("SECding",),
            feishu_webhook_url=fei.url,
            feishu_secret=("fei-secret",),
            wecom_webhook_url=wec.url,
        )
        runtime = build_runtime(settings, engine=engine)
        t0 = utcnow()
        _backlog(engine, 3, t0)
        evaluate_alerts.run_once(runtime, now=t0)
        assert notify_alerts.run_once(runtime, now=t0) == 3
        from payments.infra.schema import payment_callback_log
        from payments.states import CallbackStatus

        with engine.begin() as conn:
            conn.execute(update(payment_callback_log).values(status=CallbackStatus.PROCESSED))
        evaluate_alerts.run_once(runtime, now=t0 + timedelta(seconds=60))
        assert notify_alerts.run_once(runtime, now=t0 + timedelta(seconds=60)) == 3
    assert ding.refused == [] and fei.refused == [] and wec.refused == []
    assert [r.params.get("mentioned") for r in ding.received] == ["13800000000,manager01", None]
    assert ding.received[0].data["at"] == {"atMobiles": ["13800000000"], "atUserIds": ["manager01"], "isAtAll": False}
    assert [r.params["mentioned"] for r in fei.received] == ["ou_0123abcd,all", ""]
    assert [r.params["mentioned"] for r in wec.received] == ["zhangsan", ""]
    assert all(r.data["msgtype"] == "markdown" for r in wec.received)


def test_wecom_mentions_phones_and_everyone_with_a_text_message():
    from dataclasses import replace

    from payments.escalation.notify import Mentions

    notice = replace(NOTICE, mentions=Mentions(wecom_mobiles=("13800000000",), wecom_all=True))
    with FakeService("wecom") as wec:
        from payments.escalation.notify.channels import build_channels

        channel = build_channels(make_settings(wecom_webhook_url=wec.url, alert_channel_timeout_seconds=5.0))["wecom"]
        try:
            channel.send(notice)
        finally:
            channel.close()
    assert wec.refused == []
    [got] = wec.received
    assert got.data["msgtype"] == "text" and got.data["text"]["mentioned_mobile_list"] == ["13800000000"]
    assert got.data["text"]["mentioned_list"] == ["@all"] and "paysync" in got.data["text"]["content"]


def test_a_fake_robot_refuses_mentions_not_shaped_as_the_vendor_documents():
    bad = {
        "dingtalk": {
            "msgtype": "markdown",
            "markdown": {"title": "t", "text": "paysync"},
            "at": {"atMobiles": ["138"]},
        },
        "wecom": {"msgtype": "markdown", "markdown": {"content": "x", "mentioned_mobile_list": ["138"]}},
    }
    import json
    import urllib.request

    for kind in ("dingtalk", "wecom"):
        with FakeService(kind) as fake:
            request = urllib.request.Request(
                fake.url, json.dumps(bad[kind]).encode(), {"Content-Type": "application/json"}
            )
            answer = json.loads(urllib.request.urlopen(request, timeout=5).read())
        assert answer["errcode"] == 40035 and fake.received == [], kind
    card = feishu.payload(NOTICE)
    card["card"]["elements"][0]["text"]["content"] += ' <at user_id="ou_1"></at>'
    with FakeService("feishu") as fake:
        request = urllib.request.Request(fake.url, json.dumps(card).encode(), {"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(request, timeout=5).read())
    assert answer["code"] == 9499 and fake.received == []


def test_mentions_in_the_rules_file_are_checked_and_a_resolved_notice_mentions_nobody():
    with pytest.raises(ConfigError, match="rule callback_backlog: mentions.dingtalk_mobiles: must be a list of phone"):
        alert_rules.parse_rules('[rules.callback_backlog]\nmentions = { dingtalk_mobiles = ["<b>"] }\n')
    with pytest.raises(ConfigError, match="unknown field 'slack_users'"):
        alert_rules.parse_rules("[mentions.critical]\nslack_users = []\n")
    with pytest.raises(ConfigError, match=r"\[mentions.urgent\]: must be one of"):
        alert_rules.parse_rules("[mentions.urgent]\n")
    rules = alert_rules.parse_rules(MENTION_RULES)
    both = rules.mentions("callback_backlog", "critical")
    assert both.dingtalk_mobiles == ("13800000000",) and both.dingtalk_user_ids == ("manager01",) and both.feishu_all
    assert rules.mentions("other_rule", "warning").dingtalk_mobiles == ("13999999999",)
    resolved = links.dress(Notice(kind=RESOLVED, rule="r", severity="critical", message="m", key="k"), both)
    assert "at" not in dingtalk.payload(resolved)


def test_when_the_notice_carrying_a_group_is_acknowledged_the_others_go_out_by_themselves(engine, tmp_path):
    from payments.ops import alert_actions
    from payments.ops.actions import Actor

    rules = '[defaults]\nchannels = ["slack"]\ncooldown_seconds = 0\n'
    rules += "\n[rules.unresolved_payment]\ngroup_wait_seconds = 60\n"
    with FakeService("slack") as slack_fake:
        settings = make_settings(
            database_url=db_url(engine), alert_rules_file=_rules(tmp_path, rules), slack_webhook_url=slack_fake.url
        )
        runtime = build_runtime(settings, engine=engine)
        t0 = utcnow()
        payment_id = create_payment(engine, status="Unknown")
        with engine.begin() as conn:
            current = conn.execute(select(payment).where(payment.c.payment_id == payment_id)).mappings().one()
            review(conn, current, "unresolved_payment", "late", t0)
            review(conn, current, "provider_answer_needs_review", "odd answer", t0)
        assert notify_alerts.run_once(runtime, now=t0) == 0  # the carrier waits 60 s, the other rides on it
        with engine.connect() as conn:
            carrier = conn.execute(select(alert.c.id).where(alert.c.rule == "unresolved_payment")).scalar_one()
        alert_actions.act(engine, "ack", alert_id=carrier, actor=Actor("bob", "cli"), note="mine", now=t0)
        assert notify_alerts.run_once(runtime, now=t0 + timedelta(seconds=1)) == 1
    assert [r.data["blocks"][0]["text"]["text"] for r in slack_fake.received] == [
        "[WARNING] provider_answer_needs_review firing"
    ]
