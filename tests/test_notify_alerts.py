"""``notify_alerts``: once per incident, reminders on the cooldown, a resolved notice; dead channels isolated.

Time moves with ``run_once(now=…)``; the channels are real local servers (tests/notify_fakes.py).
"""

from __future__ import annotations

import threading
from datetime import datetime, timedelta

import pytest
from sqlalchemy import insert, select, update

from compensator import evaluate_alerts, notify_alerts
from payments.escalation import alerts, review
from payments.infra.db import utcnow
from payments.infra.schema import alert, alert_notification, payment_callback_log
from payments.runtime import build_runtime
from payments.states import CallbackStatus
from tests.notify_fakes import TOKEN, FakeService
from tests.stack import db_url
from tests.support import free_port, make_settings, wait_until

RULES = """
[defaults]
channels = {channels}
cooldown_seconds = 0

[rules.callback_backlog]
threshold = 2
sustain_seconds = 0
cooldown_seconds = 600
severity = "critical"
channels = {channels}

[rules.alert_channel_failing]
severity = "critical"
cooldown_seconds = 3600
channels = {channels}
"""


def _runtime(engine, tmp_path, channels: list[str], **overrides):
    path = tmp_path / "rules.toml"
    path.write_text(RULES.format(channels=str(channels).replace("'", '"')))
    settings = make_settings(
        database_url=db_url(engine),
        alert_rules_file=str(path),
        alert_notify_max_attempts=3,
        alert_notify_retry_base_seconds=10.0,
        alert_notify_retry_max_seconds=60.0,
        alert_channel_timeout_seconds=5.0,
        **overrides,
    )
    return build_runtime(settings, engine=engine)


def _backlog(engine, count: int, at: datetime) -> list[int]:
    with engine.begin() as conn:
        conn.execute(
            insert(payment_callback_log),
            [
                {
                    "provider": "sandbox",
                    "callback_data": b"{}",
                    "headers": "{}",
                    "status": CallbackStatus.PENDING,
                    "next_retry_at": at,
                    "create_time": at,
                    "update_time": at,
                }
                for _ in range(count)
            ],
        )
        return list(conn.execute(select(payment_callback_log.c.id)).scalars())


def _drain(engine) -> None:
    with engine.begin() as conn:
        conn.execute(update(payment_callback_log).values(status=CallbackStatus.PROCESSED))


def _rows(engine, channel: str | None = None) -> list:
    n = alert_notification
    with engine.connect() as conn:
        query = select(n).order_by(n.c.id)
        if channel:
            query = query.where(n.c.channel == channel)
        return list(conn.execute(query))


def _titles(fake: FakeService) -> list[str]:
    return [r.data["blocks"][0]["text"]["text"] for r in fake.received]


def test_notify_alerts_no_ops_on_an_empty_database(engine, tmp_path):
    with FakeService("slack") as slack:
        runtime = _runtime(engine, tmp_path, ["slack"], slack_webhook_url=slack.url)
        assert notify_alerts.run_once(runtime) == 0
    assert slack.attempts == 0 and _rows(engine) == []


def test_an_alert_notifies_once_per_incident_repeats_on_cooldown_and_sends_a_resolved_notice(engine, tmp_path):
    with FakeService("slack") as slack:
        runtime = _runtime(engine, tmp_path, ["slack"], slack_webhook_url=slack.url)
        t0 = utcnow()
        _backlog(engine, 3, t0)
        evaluate_alerts.run_once(runtime, now=t0)
        assert notify_alerts.run_once(runtime, now=t0) == 1
        for seconds in (5, 60, 599):  # still firing, inside the cooldown: nobody is told again
            evaluate_alerts.run_once(runtime, now=t0 + timedelta(seconds=seconds))
            assert notify_alerts.run_once(runtime, now=t0 + timedelta(seconds=seconds)) == 0
        assert notify_alerts.run_once(runtime, now=t0 + timedelta(seconds=600)) == 1
        assert notify_alerts.run_once(runtime, now=t0 + timedelta(seconds=1100)) == 0
        assert notify_alerts.run_once(runtime, now=t0 + timedelta(seconds=1200)) == 1

        _drain(engine)
        evaluate_alerts.run_once(runtime, now=t0 + timedelta(seconds=1300))
        assert notify_alerts.run_once(runtime, now=t0 + timedelta(seconds=1300)) == 1
        assert notify_alerts.run_once(runtime, now=t0 + timedelta(seconds=5000)) == 0

        # A new incident is a new alert: told once again.
        _backlog(engine, 3, t0 + timedelta(seconds=5000))
        evaluate_alerts.run_once(runtime, now=t0 + timedelta(seconds=5000))
        assert notify_alerts.run_once(runtime, now=t0 + timedelta(seconds=5000)) == 1
    assert _titles(slack) == [
        "[CRITICAL] callback_backlog firing",
        "[CRITICAL] callback_backlog still firing (reminder 1)",
        "[CRITICAL] callback_backlog still firing (reminder 2)",
        "[RESOLVED] callback_backlog",
        "[CRITICAL] callback_backlog firing",
    ]
    assert "3 callbacks waiting" in slack.received[0].data["blocks"][1]["text"]["text"]
    rows = _rows(engine)
    assert [(r.kind, r.seq, r.status) for r in rows] == [
        ("firing", 0, "sent"),
        ("resolved", 0, "sent"),
        ("repeat", 1, "sent"),
        ("repeat", 2, "sent"),
        ("firing", 0, "sent"),
        ("resolved", 0, "held"),
    ]


def test_a_dead_channel_does_not_stop_the_others_is_retried_with_backoff_and_gives_up_visibly(engine, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}/robot/send?access_token={TOKEN}"
    with FakeService("slack") as slack, FakeService("wecom") as wecom:
        wecom.fail_with = (500, {"errcode": -1, "errmsg": "system busy"})
        runtime = _runtime(
            engine,
            tmp_path,
            ["slack", "dingtalk", "wecom"],
            slack_webhook_url=slack.url,
            dingtalk_webhook_url=dead,
            wecom_webhook_url=wecom.url,
        )
        t0 = utcnow()
        _backlog(engine, 3, t0)
        evaluate_alerts.run_once(runtime, now=t0)
        assert notify_alerts.run_once(runtime, now=t0) == 1
        assert _titles(slack) == ["[CRITICAL] callback_backlog firing"]
        (ding,) = [r for r in _rows(engine, "dingtalk") if r.kind == "firing"]
        assert (ding.status, ding.attempts, ding.last_error) == ("pending", 1, "dingtalk: ConnectionError")
        assert t0 + timedelta(seconds=5) <= ding.next_attempt_at <= t0 + timedelta(seconds=10)  # equal jitter, base 10
        assert wecom.attempts == 1

        # Not due yet: nothing is tried.
        notify_alerts.run_once(runtime, now=t0 + timedelta(seconds=4))
        assert wecom.attempts == 1

        # Retried at each backoff until the third failure gives up (ALERT_NOTIFY_MAX_ATTEMPTS=3).
        now = t0
        delays = []
        for _ in range(2):
            (ding,) = [r for r in _rows(engine, "dingtalk") if r.kind == "firing"]
            delays.append((ding.next_attempt_at - now).total_seconds())
            now = max(
                ding.next_attempt_at, max(r.next_attempt_at for r in _rows(engine, "wecom") if r.kind == "firing")
            )
            notify_alerts.run_once(runtime, now=now)
        assert delays[1] >= 10 - 0.001, delays  # the second wait is longer: 10-20 s after 5-10 s
        (ding,) = [r for r in _rows(engine, "dingtalk") if r.kind == "firing"]
        (wc,) = [r for r in _rows(engine, "wecom") if r.kind == "firing"]
        assert (ding.status, ding.attempts) == ("gave_up", 3)
        assert (wc.status, wc.attempts, wc.last_error) == (
            "gave_up",
            3,
            'wecom answered HTTP 500: {"errcode": -1, "errmsg": "system busy"}',
        )
        assert wecom.attempts == 3

        # Visible: an alert per failing channel, told through the channels that work (never to itself).
        with engine.connect() as conn:
            failing = dict(
                conn.execute(
                    select(alert.c.dedupe_key, alert.c.status).where(alert.c.rule == "alert_channel_failing")
                ).all()
            )
        assert failing == {"alert_channel_failing:dingtalk": "firing", "alert_channel_failing:wecom": "firing"}
        notify_alerts.run_once(runtime, now=now)
        assert sorted(_titles(slack)[1:]) == ["[CRITICAL] alert_channel_failing firing"] * 2
        about_itself = [r for r in _rows(engine, "dingtalk") if r.kind == "firing" and r.alert_id != ding.alert_id]
        with engine.connect() as conn:
            ids = dict(conn.execute(select(alert.c.dedupe_key, alert.c.id)).all())
        assert [r.alert_id for r in about_itself] == [ids["alert_channel_failing:wecom"]]

        # WeCom comes back: its next notification goes through and its failing alert resolves.
        wecom.fail_with = None
        pending = [r for r in _rows(engine, "wecom") if r.status == "pending"]
        assert [r.alert_id for r in pending] == [ids["alert_channel_failing:dingtalk"]]
        later = max(r.next_attempt_at for r in pending)
        notify_alerts.run_once(runtime, now=later)
        assert len(wecom.received) == 1
        with engine.connect() as conn:
            status = conn.execute(
                select(alert.c.status).where(alert.c.dedupe_key == "alert_channel_failing:wecom")
            ).scalar_one()
        assert status == "resolved"


def test_a_channel_that_hangs_does_not_hold_up_the_others(engine, tmp_path):
    with FakeService("slack") as slack, FakeService("wecom") as wecom:
        wecom.hang = threading.Event()
        runtime = _runtime(
            engine, tmp_path, ["wecom", "slack"], slack_webhook_url=slack.url, wecom_webhook_url=wecom.url
        )
        t0 = utcnow()
        _backlog(engine, 3, t0)
        evaluate_alerts.run_once(runtime, now=t0)
        run = threading.Thread(target=notify_alerts.run_once, args=(runtime,), kwargs={"now": t0})
        run.start()
        try:
            wait_until(lambda: wecom.hanging == 1, message="wecom holding the request")
            wait_until(lambda: slack.received, message="slack told while wecom hangs")
            assert wecom.hanging == 1, "slack was told while the wecom request was still held"
        finally:
            wecom.hang.set()
            run.join(30)
        assert not run.is_alive()


def test_a_notification_still_unsent_when_the_alert_clears_is_cancelled_and_no_resolved_notice_follows(
    engine, tmp_path
):
    with FakeService("slack") as slack:
        slack.fail_with = (503, "busy")
        runtime = _runtime(engine, tmp_path, ["slack"], slack_webhook_url=slack.url)
        t0 = utcnow()
        _backlog(engine, 3, t0)
        evaluate_alerts.run_once(runtime, now=t0)
        notify_alerts.run_once(runtime, now=t0)  # fails, backs off
        _drain(engine)
        evaluate_alerts.run_once(runtime, now=t0 + timedelta(seconds=1))
        slack.fail_with = None
        notify_alerts.run_once(runtime, now=t0 + timedelta(seconds=120))
    assert slack.received == []
    assert [(r.kind, r.status) for r in _rows(engine)] == [("firing", "cancelled"), ("resolved", "cancelled")]
    assert _rows(engine)[0].last_error == "the alert resolved before this was sent"


def test_only_configured_channels_get_notifications_and_alerts_raised_elsewhere_are_routed_by_the_file(
    engine, tmp_path
):
    with FakeService("slack") as slack:
        runtime = _runtime(engine, tmp_path, ["email", "sms", "slack"], slack_webhook_url=slack.url)
        t0 = utcnow()
        with engine.begin() as conn:  # as payments/inbound/callbacks.py hands a callback that gave up to a person
            review.escalate(
                conn,
                kind="callback_gave_up",
                subject="callback:7",
                alert_key="callback_gave_up:7",
                reason="callback 7 gave up",
                now=t0,
            )
        notify_alerts.run_once(runtime, now=t0)
        notify_alerts.run_once(runtime, now=t0 + timedelta(days=2))  # [defaults] cooldown 0: no reminder
        _backlog(engine, 3, t0)
        evaluate_alerts.run_once(runtime, now=t0)
        notify_alerts.run_once(runtime, now=t0)
    assert _titles(slack) == ["[WARNING] callback_gave_up firing", "[CRITICAL] callback_backlog firing"]
    assert {r.channel for r in _rows(engine)} == {"slack"}


def test_the_manual_queue_notifies_through_the_shipped_rules_once_per_subject(engine):
    # The default ops/alert_rules.toml: every kind reaches chat (docs/operations/alert-routing.md).
    with FakeService("slack") as slack:
        runtime = build_runtime(make_settings(database_url=db_url(engine), slack_webhook_url=slack.url), engine=engine)
        t0 = utcnow()
        with engine.begin() as conn:
            for _ in range(3):  # the same conflict seen again and again is one review and one alert
                review.escalate(
                    conn,
                    kind="conflicting_report",
                    subject="payment:pay_1",
                    reason="conflicting report for payment pay_1",
                    now=t0,
                    severity="critical",
                )
            for kind in ("callback_gave_up", "unresolved_payment", "event_delivery_gave_up"):
                review.escalate(conn, kind=kind, subject="payment:pay_2", reason=f"{kind} pay_2", now=t0)
            review.escalate(conn, kind="unknown_provider", subject="payment:pay_3", reason="no adapter", now=t0)
        # pay_2's gave-up alerts are one notice (one cause pages once); unresolved_payment waits its group's 60 s.
        sent = [notify_alerts.run_once(runtime, now=t0 + timedelta(seconds=s)) for s in (0, 61)]
        assert notify_alerts.run_once(runtime, now=t0 + timedelta(days=2)) == 0  # cooldown 0: the queue reminds
    assert sent == [3, 1]
    assert sorted(_titles(slack)) == [
        "[CRITICAL] conflicting_report firing",
        "[WARNING] callback_gave_up firing (+1 related)",
        "[WARNING] unknown_provider firing",
        "[WARNING] unresolved_payment firing",
    ]
    assert {(r.channel, r.kind, r.status) for r in _rows(engine)} == {
        ("slack", "firing", "sent"),
        ("slack", "resolved", "held"),
    }


@pytest.mark.mariadb
def test_notifiers_running_at_once_send_each_notification_once(mariadb, tmp_path):
    with FakeService("slack") as slack, FakeService("feishu") as feishu:
        runtime = _runtime(
            mariadb, tmp_path, ["slack", "feishu"], slack_webhook_url=slack.url, feishu_webhook_url=feishu.url
        )
        t0 = utcnow()
        with mariadb.begin() as conn:
            for i in range(30):
                alerts.observe(
                    conn, rule="conflicting_report", key=f"conflicting_report:payment:p{i}", message=f"p{i}", now=t0
                )
        errors: list[BaseException] = []
        barrier = threading.Barrier(4)

        def notify() -> None:
            barrier.wait()
            try:
                notify_alerts.run_once(runtime, now=t0)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=notify) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        notify_alerts.run_once(runtime, now=t0)  # whatever a planner that lost the lock race left
    assert errors == []
    assert sorted(r.data["text"] for r in slack.received) == sorted(
        f"[WARNING] conflicting_report firing: p{i}" for i in range(30)
    )
    assert len(feishu.received) == 30
    assert [r.status for r in _rows(mariadb) if r.kind == "firing"] == ["sent"] * 60


@pytest.mark.mariadb
def test_a_planner_of_another_database_on_the_same_server_does_not_stop_ours(mariadb, tmp_path):
    from payments.escalation import notifications
    from payments.infra.db import make_engine
    from tests.conftest import _create_database

    other = make_engine(mariadb.url.set(database=f"{mariadb.url.database}_other").render_as_string(hide_password=False))
    try:
        other = _create_database(other)
        with FakeService("slack") as slack:
            runtime = _runtime(mariadb, tmp_path, ["slack"], slack_webhook_url=slack.url)
            t0 = utcnow()
            _backlog(mariadb, 3, t0)
            evaluate_alerts.run_once(runtime, now=t0)
            with notifications._plan_lock(other) as held:
                assert held is not None, "the other database's planner is running"
                assert notify_alerts.run_once(runtime, now=t0) == 1
        assert _titles(slack) == ["[CRITICAL] callback_backlog firing"]
    finally:
        other.dispose()
