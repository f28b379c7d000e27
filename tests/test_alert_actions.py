"""Ack, silence and assign, for alerts and reviews: what the notifier then does, the action log, console and CLI.

Real alerts (evaluate_alerts over a callback backlog, review.escalate), real
notify_alerts runs moving through time with ``now``, a fake Slack
(tests/notify_fakes.py) counting what arrives.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select, text, update
from sqlalchemy.exc import DatabaseError

from compensator import alerts_cli, evaluate_alerts, notify_alerts
from payments.escalation import review
from payments.infra.db import utcnow
from payments.infra.schema import alert, manual_review, ops_action, payment_callback_log
from payments.ops import alert_actions
from payments.ops.actions import Actor, OpsRefused
from payments.runtime import build_runtime
from payments.states import CallbackStatus
from tests.notify_fakes import FakeService
from tests.ops_console_support import console_app, csrf, flashes, login
from tests.stack import db_url
from tests.support import make_settings
from tests.test_notify_vendor_rules import _backlog

RULES = """
[defaults]
channels = ["slack"]
cooldown_seconds = 0

[rules.callback_backlog]
threshold = 2
severity = "critical"
cooldown_seconds = 600
channels = ["slack"]
"""
BOB = Actor("bob", "cli")


def _runtime(engine, tmp_path, slack_url: str):
    path = tmp_path / "rules.toml"
    path.write_text(RULES)
    settings = make_settings(
        database_url=db_url(engine),
        alert_rules_file=str(path),
        slack_webhook_url=slack_url,
        alert_channel_timeout_seconds=5.0,
    )
    return build_runtime(settings, engine=engine)


def _titles(fake: FakeService) -> list[str]:
    return [r.data["blocks"][0]["text"]["text"] for r in fake.received]


def _firing_backlog(engine, runtime, t0) -> int:
    _backlog(engine, 3, t0)
    evaluate_alerts.run_once(runtime, now=t0)
    with engine.connect() as conn:
        return conn.execute(select(alert.c.id).where(alert.c.rule == "callback_backlog")).scalar_one()


def _clear_backlog(engine, runtime, at) -> None:
    with engine.begin() as conn:
        conn.execute(update(payment_callback_log).values(status=CallbackStatus.PROCESSED))
    evaluate_alerts.run_once(runtime, now=at)


def test_an_acknowledged_alert_stops_reminding_but_still_says_when_it_resolves(engine, tmp_path):
    with FakeService("slack") as slack:
        runtime = _runtime(engine, tmp_path, slack.url)
        t0 = utcnow()
        alert_id = _firing_backlog(engine, runtime, t0)
        assert notify_alerts.run_once(runtime, now=t0) == 1
        alert_actions.act(engine, "ack", alert_id=alert_id, actor=BOB, note="on it", now=t0 + timedelta(seconds=30))
        assert notify_alerts.run_once(runtime, now=t0 + timedelta(seconds=700)) == 0  # the 600 s reminder: none
        assert notify_alerts.run_once(runtime, now=t0 + timedelta(seconds=1400)) == 0
        _clear_backlog(engine, runtime, t0 + timedelta(seconds=1500))
        assert notify_alerts.run_once(runtime, now=t0 + timedelta(seconds=1500)) == 1
    assert _titles(slack) == ["[CRITICAL] callback_backlog firing", "[RESOLVED] callback_backlog"]


def test_a_silenced_alert_sends_nothing_until_the_silence_expires(engine, tmp_path):
    with FakeService("slack") as slack:
        runtime = _runtime(engine, tmp_path, slack.url)
        t0 = utcnow()
        alert_id = _firing_backlog(engine, runtime, t0)
        result = alert_actions.act(
            engine, "silence", alert_id=alert_id, actor=BOB, note="deploying", minutes=30, now=t0
        )
        assert "silenced until" in result.outcome
        assert notify_alerts.run_once(runtime, now=t0) == 0
        assert notify_alerts.run_once(runtime, now=t0 + timedelta(minutes=29)) == 0
        assert slack.attempts == 0
        assert notify_alerts.run_once(runtime, now=t0 + timedelta(minutes=31)) == 1  # expired: it fires now
    assert _titles(slack) == ["[CRITICAL] callback_backlog firing"]


def test_a_silence_of_zero_minutes_lifts_it_and_nothing_acts_on_a_resolved_alert(engine, tmp_path):
    with FakeService("slack") as slack:
        runtime = _runtime(engine, tmp_path, slack.url)
        t0 = utcnow()
        alert_id = _firing_backlog(engine, runtime, t0)
        alert_actions.act(engine, "silence", alert_id=alert_id, actor=BOB, note="x", minutes=60, now=t0)
        alert_actions.act(engine, "silence", alert_id=alert_id, actor=BOB, note="done", minutes=0, now=t0)
        assert notify_alerts.run_once(runtime, now=t0) == 1
        with pytest.raises(OpsRefused, match="a silence is 0"):
            alert_actions.act(engine, "silence", alert_id=alert_id, actor=BOB, note="x", minutes=10**6, now=t0)
        _clear_backlog(engine, runtime, t0 + timedelta(seconds=5))
        with pytest.raises(OpsRefused, match="resolved"):
            alert_actions.act(engine, "ack", alert_id=alert_id, actor=BOB, note="late", now=t0)
    with engine.connect() as conn:
        logged = conn.execute(select(ops_action.c.action, ops_action.c.alert_id).order_by(ops_action.c.id)).all()
    assert logged == [("silence", alert_id), ("silence", alert_id)]  # refusals write nothing


def test_a_review_acked_silenced_and_assigned_carries_its_alert_and_the_log_keeps_every_step(engine):
    t0 = utcnow()
    with engine.begin() as conn:
        opened = review.escalate(
            conn, kind="conflicting_report", subject="payment:pay_9", reason="conflict", now=t0, payment_id="pay_9"
        )
    for action, extra in (("assign", {"assignee": "carol"}), ("ack", {}), ("silence", {"minutes": 15})):
        alert_actions.act(engine, action, review_id=opened.review_id, actor=BOB, note=f"{action} it", now=t0, **extra)
    with pytest.raises(OpsRefused, match="acknowledged already by bob"):
        alert_actions.act(engine, "ack", review_id=opened.review_id, actor=BOB, note="again", now=t0)
    with engine.connect() as conn:
        a = conn.execute(select(alert).where(alert.c.rule == "conflicting_report")).mappings().one()
        r = conn.execute(select(manual_review).where(manual_review.c.id == opened.review_id)).mappings().one()
        logged = conn.execute(select(ops_action).order_by(ops_action.c.id)).mappings().all()
    assert (a["assignee"], a["acked_by"], a["silenced_until"]) == ("carol", "bob", t0 + timedelta(minutes=15))
    assert (r["assignee"], r["acked_by"], r["silenced_until"]) == ("carol", "bob", t0 + timedelta(minutes=15))
    assert [(x["action"], x["subject"], x["alert_id"], x["manual_review_id"], x["payment_id"]) for x in logged] == [
        (action, f"review:{opened.review_id}", a["id"], opened.review_id, "pay_9")
        for action in ("assign", "ack", "silence")
    ]
    with pytest.raises(DatabaseError), engine.begin() as conn:  # the log is append-only
        conn.execute(text("UPDATE ops_action SET outcome = 'rewritten'"))


def test_the_cli_acks_silences_assigns_and_shows_where_notices_went(engine, tmp_path, capsys):
    with FakeService("slack") as slack:
        runtime = _runtime(engine, tmp_path, slack.url)
        t0 = utcnow()
        alert_id = _firing_backlog(engine, runtime, t0)
        notify_alerts.run_once(runtime, now=t0)
    common = ["--note", "night shift", "--actor", "dave"]
    assert alerts_cli.main(["assign", str(alert_id), "--to", "erin", *common], runtime) == 0
    assert alerts_cli.main(["ack", str(alert_id), *common], runtime) == 0
    assert alerts_cli.main(["ack", str(alert_id), *common], runtime) == 1
    assert alerts_cli.main(["silence", str(alert_id), "--minutes", "20", *common], runtime) == 0
    out = capsys.readouterr()
    assert f"alert:{alert_id}: assigned to erin" in out.out and "acknowledged already by dave" in out.err
    assert alerts_cli.main(["show", str(alert_id)], runtime) == 0
    shown = capsys.readouterr().out
    assert "slack      firing   sent" in shown and "assignee erin" in shown and "acked" in shown
    assert alerts_cli.main(["list"], runtime) == 0
    assert "erin" in capsys.readouterr().out
    with engine.connect() as conn:
        vias = conn.execute(select(ops_action.c.via, ops_action.c.actor).distinct()).all()
    assert vias == [("cli", "dave")]


def test_the_console_shows_where_each_notice_went_and_takes_ack_silence_assign(engine, tmp_path):
    with FakeService("slack") as slack, FakeService("feishu") as fei:
        fei.fail_with = (200, {"code": 19001, "msg": "incoming webhook access token invalid"})
        path = tmp_path / "rules.toml"
        path.write_text(RULES.replace('["slack"]', '["slack", "feishu"]'))
        settings = make_settings(
            database_url=db_url(engine),
            alert_rules_file=str(path),
            slack_webhook_url=slack.url,
            feishu_webhook_url=fei.url,
            alert_channel_timeout_seconds=5.0,
        )
        runtime = build_runtime(settings, engine=engine)
        t0 = utcnow()
        alert_id = _firing_backlog(engine, runtime, t0)
        notify_alerts.run_once(runtime, now=t0)
    client = console_app(engine).test_client()
    login(client)
    page = client.get(f"/ops/alerts/{alert_id}").text
    assert "Where the notices went" in page
    assert '<tr class="delivery-sent"><td>slack</td><td>firing</td>' in page and "accepted" in page
    assert '<tr class="delivery-gave_up"><td>feishu</td>' in page and "19001" in page
    token = csrf(page)
    for form in (
        {"action": "assign", "assignee": "frank", "note": "yours"},
        {"action": "silence", "minutes": "45", "note": "maintenance"},
        {"action": "ack", "note": "looking"},
    ):
        response = client.post(f"/ops/alerts/{alert_id}/act", data={"csrf": token, **form}, follow_redirects=True)
        assert flashes(response.text)[-1][0] == "ok", response.text
    page = client.get(f"/ops/alerts/{alert_id}").text
    assert "acknowledged by alice" in page and "silenced until" in page and "assignee frank" in page
    assert client.get("/ops/alerts").status_code == 200 and f"/ops/alerts/{alert_id}" in client.get("/ops/alerts").text
    runbook = client.get("/ops/runbooks/callback_backlog")
    assert runbook.status_code == 200 and "What to check" in runbook.text
    assert client.get("/ops/runbooks/nope").status_code == 404
    with engine.connect() as conn:
        logged = conn.execute(select(ops_action.c.action, ops_action.c.via, ops_action.c.actor)).all()
    assert sorted(logged) == [
        ("ack", "console", "alice"),
        ("assign", "console", "alice"),
        ("silence", "console", "alice"),
    ]


def test_the_review_page_has_its_alert_the_notices_and_the_forms(engine):
    t0 = utcnow()
    with engine.begin() as conn:
        opened = review.escalate(conn, kind="unknown_provider", subject="payment:pay_7", reason="no adapter", now=t0)
    client = console_app(engine).test_client()
    login(client)
    page = client.get(f"/ops/reviews/{opened.review_id}").text
    assert "Its alert" in page and 'id="ack-form"' in page and "/ops/runbooks/unknown_provider" in page
    response = client.post(
        f"/ops/reviews/{opened.review_id}/act",
        data={"csrf": csrf(page), "action": "assign", "assignee": "gina", "note": "finance"},
        follow_redirects=True,
    )
    assert flashes(response.text)[-1] == ("ok", f"review:{opened.review_id}: assigned to gina")
