"""The rules evaluate_alerts checks beyond the seed's two, each against a database in the state that triggers it.

Each fires (after its sustain), stays one alert while it holds, and resolves when the state clears.
"""

from __future__ import annotations

import re
import uuid
from datetime import datetime, timedelta

import pytest
from sqlalchemy import insert, select, update

from compensator import evaluate_alerts, notify_alerts, seal_ledger
from payments.escalation import review
from payments.escalation.rules import DEFAULT_RULES_FILE, load_rules
from payments.infra.db import utcnow
from payments.infra.schema import (
    RECON_AMOUNT_MISMATCH,
    RECON_FEE,
    RECON_LOCAL_ONLY,
    RECON_MATCHED,
    RECON_PROVIDER_ONLY,
    RECON_STATUS_MISMATCH,
    RECON_UNREADABLE,
    alert,
    ledger_event,
    payment,
    payment_callback_log,
    provider_breaker,
    reconciliation_item,
    reconciliation_run,
    refund,
)
from payments.outbound.breaker import alert_key
from payments.runtime import build_runtime
from payments.states import BreakerState, CallbackStatus, ReconciliationRunStatus
from tests.notify_fakes import FakeService
from tests.stack import db_url, url_via
from tests.support import create_payment, free_port, make_settings


def _runtime(engine, **overrides):
    return build_runtime(make_settings(database_url=db_url(engine), **overrides), engine=engine)


def _callbacks(engine, statuses, at: datetime, *, provider: str = "sandbox", retry_count: int = 0) -> None:
    with engine.begin() as conn:
        conn.execute(
            insert(payment_callback_log),
            [
                {
                    "provider": provider,
                    "callback_data": b"{}",
                    "headers": "{}",
                    "status": status,
                    "retry_count": retry_count,
                    "next_retry_at": at,
                    "create_time": at,
                    "update_time": at,
                }
                for status in statuses
            ],
        )


def _alerts(engine, rule: str) -> list:
    with engine.connect() as conn:
        return list(conn.execute(select(alert).where(alert.c.rule == rule).order_by(alert.c.id)))


def _states(engine, rule: str) -> list[tuple[str, str]]:
    return [(a.dedupe_key, a.status) for a in _alerts(engine, rule)]


def test_compensation_success_rate_fires_after_5_minutes_below_80_percent_and_resolves(engine):
    runtime = _runtime(engine)
    t0 = utcnow()
    _callbacks(engine, [CallbackStatus.PROCESSED] * 7, t0, retry_count=1)
    _callbacks(engine, [CallbackStatus.FAILED] * 3, t0, retry_count=2)  # 70 % of 10 retried rows applied
    _callbacks(engine, [CallbackStatus.PROCESSED] * 50, t0)  # rows that never needed the compensator do not count

    evaluate_alerts.run_once(runtime, now=t0)
    assert _states(engine, "compensation_success_rate") == [("compensation_success_rate", "pending")]
    evaluate_alerts.run_once(runtime, now=t0 + timedelta(seconds=300))
    (fired,) = _alerts(engine, "compensation_success_rate")
    assert fired.status == "firing" and "70.0% of 10 retried callbacks" in fired.message

    with engine.begin() as conn:
        conn.execute(
            update(payment_callback_log)
            .where(payment_callback_log.c.status == CallbackStatus.FAILED)
            .values(status=CallbackStatus.PROCESSED)
        )
    evaluate_alerts.run_once(runtime, now=t0 + timedelta(seconds=310))
    assert _states(engine, "compensation_success_rate") == [("compensation_success_rate", "resolved")]


def test_compensation_success_rate_needs_its_minimum_sample(engine):
    t0 = utcnow()
    _callbacks(engine, [CallbackStatus.FAILED] * 9, t0, retry_count=1)
    evaluate_alerts.run_once(_runtime(engine), now=t0)
    assert _alerts(engine, "compensation_success_rate") == []


def test_payments_and_refunds_past_their_deadline_fire_one_alert_each_and_resolve(engine):
    runtime = _runtime(engine)
    now = utcnow()
    late = create_payment(engine, status="Unknown")
    on_time = create_payment(engine, status="Pending")
    done = create_payment(engine, status="Succeeded")
    with engine.begin() as conn:
        conn.execute(
            update(payment).where(payment.c.payment_id.in_([late, done])).values(deadline_at=now - timedelta(hours=2))
        )
        conn.execute(
            update(payment).where(payment.c.payment_id == on_time).values(deadline_at=now + timedelta(hours=1))
        )
        conn.execute(
            insert(refund).values(
                refund_id="re_late",
                payment_id=done,
                amount_minor=100,
                currency="CNY",
                provider="sandbox",
                status="Pending",
                deadline_at=now - timedelta(minutes=5),
                created_at=now,
                updated_at=now,
            )
        )

    assert evaluate_alerts.run_once(runtime, now=now) == 2
    by_key = {a.dedupe_key: a for a in _alerts(engine, "past_deadline")}
    assert sorted(by_key) == ["past_deadline:payment", "past_deadline:refund"]
    assert by_key["past_deadline:payment"].severity == "critical"
    assert (
        f"1 payments not final past their deadline (oldest {late}, 7200 s over)"
        in by_key["past_deadline:payment"].message
    )
    assert by_key["past_deadline:refund"].status == "firing"

    evaluate_alerts.run_once(runtime, now=now + timedelta(seconds=30))
    assert len(_alerts(engine, "past_deadline")) == 2, "still the same two alerts"
    with engine.begin() as conn:
        conn.execute(update(payment).where(payment.c.payment_id == late).values(status="Failed"))
    evaluate_alerts.run_once(runtime, now=now + timedelta(seconds=60))
    assert dict(_states(engine, "past_deadline")) == {
        "past_deadline:payment": "resolved",
        "past_deadline:refund": "firing",
    }


def test_signature_failures_fire_per_provider_over_the_threshold_and_resolve_out_of_the_window(engine):
    runtime = _runtime(engine)
    t0 = utcnow()
    _callbacks(engine, [CallbackStatus.REJECTED] * 21, t0, provider="alipay")
    _callbacks(engine, [CallbackStatus.REJECTED] * 20, t0, provider="wechatpay")  # 20 is not more than 20
    _callbacks(engine, [CallbackStatus.PROCESSED] * 500, t0, provider="sandbox")  # keeps the failure rate out of it

    evaluate_alerts.run_once(runtime, now=t0)
    (one,) = _alerts(engine, "signature_failures")
    assert (one.dedupe_key, one.status, one.severity) == ("signature_failures:alipay", "firing", "critical")
    assert "21 callbacks from alipay rejected" in one.message
    _callbacks(engine, [CallbackStatus.REJECTED] * 5, t0 + timedelta(seconds=60), provider="wechatpay")
    evaluate_alerts.run_once(runtime, now=t0 + timedelta(seconds=60))
    assert _states(engine, "signature_failures") == [
        ("signature_failures:alipay", "firing"),
        ("signature_failures:wechatpay", "firing"),
    ]
    evaluate_alerts.run_once(runtime, now=t0 + timedelta(seconds=601))  # t0's rows left the 10-minute window
    assert _states(engine, "signature_failures") == [
        ("signature_failures:alipay", "resolved"),
        ("signature_failures:wechatpay", "resolved"),
    ]


def test_an_open_breaker_fires_under_the_breakers_own_key_and_resolves_when_it_closes(engine):
    runtime = _runtime(engine)
    now = utcnow()
    with engine.begin() as conn:
        conn.execute(
            insert(provider_breaker).values(
                provider="alipay",
                state=BreakerState.OPEN,
                consecutive_failures=7,
                open_count=1,
                opened_at=now,
                retry_at=now + timedelta(seconds=5),
                updated_at=now,
            )
        )
    evaluate_alerts.run_once(runtime, now=now)
    assert _states(engine, "provider_circuit_open") == [(alert_key("alipay"), "firing")]
    with engine.begin() as conn:
        conn.execute(update(provider_breaker).values(state=BreakerState.CLOSED))
    evaluate_alerts.run_once(runtime, now=now + timedelta(seconds=1))
    assert _states(engine, "provider_circuit_open") == [(alert_key("alipay"), "resolved")]


def test_thresholds_and_sustain_come_from_the_rules_file_and_a_disabled_rule_resolves(engine, tmp_path):
    rules = tmp_path / "rules.toml"
    rules.write_text("[rules.callback_backlog]\nthreshold = 5\nsustain_seconds = 0\n")
    runtime = _runtime(engine, alert_rules_file=str(rules))
    t0 = utcnow()
    _callbacks(engine, [CallbackStatus.PENDING] * 6, t0)
    assert evaluate_alerts.run_once(runtime, now=t0) == 1  # 6 > 5, at once: not the default 100 for 5 minutes
    assert _states(engine, "callback_backlog") == [("callback_backlog", "firing")]

    rules.write_text("[rules.callback_backlog]\nthreshold = 5\nenabled = false\n")
    evaluate_alerts.run_once(runtime, now=t0 + timedelta(seconds=1))
    assert _states(engine, "callback_backlog") == [("callback_backlog", "resolved")]


# --- reconciliation_unexplained, ledger_chain_stale, broker_unreachable: fire, dedupe, remind, resolve ---------


def _slack_runtime(engine, tmp_path, slack_url: str, **overrides):
    """The shipped rules file with every channel set to slack (a real local server), so notify_alerts sends."""
    text = DEFAULT_RULES_FILE.read_text()
    path = tmp_path / "rules.toml"
    path.write_text(re.sub(r"^channels = \[.*\]", 'channels = ["slack"]', text, flags=re.MULTILINE))
    return _runtime(engine, alert_rules_file=str(path), slack_webhook_url=slack_url, **overrides)


def _lifecycle(engine, runtime_now, slack, rule: str, t0: datetime, clear) -> None:
    """Shipped sustain and cooldown: pending, firing once, one alert while it holds, a reminder, resolved.

    ``runtime_now()`` is the runtime of each run (the broker test swaps it for one whose broker answers).
    """
    shipped = load_rules(str(DEFAULT_RULES_FILE)).get(rule)
    sustain, cooldown = shipped.sustain_seconds, shipped.cooldown_seconds
    evaluate_alerts.run_once(runtime_now(), now=t0)
    notify_alerts.run_once(runtime_now(), now=t0)
    if sustain:
        assert _states(engine, rule)[0][1] == "pending"
        evaluate_alerts.run_once(runtime_now(), now=t0 + timedelta(seconds=sustain - 1))
        assert _states(engine, rule)[0][1] == "pending", "not before its sustain"
    fired = t0 + timedelta(seconds=sustain)
    evaluate_alerts.run_once(runtime_now(), now=fired)
    notify_alerts.run_once(runtime_now(), now=fired)
    (one,) = _alerts(engine, rule)
    assert one.status == "firing"
    for seconds in (1, cooldown - 1):  # still holding: the same alert, nobody told again
        evaluate_alerts.run_once(runtime_now(), now=fired + timedelta(seconds=seconds))
        notify_alerts.run_once(runtime_now(), now=fired + timedelta(seconds=seconds))
    assert [a.id for a in _alerts(engine, rule)] == [one.id]
    evaluate_alerts.run_once(runtime_now(), now=fired + timedelta(seconds=cooldown))
    notify_alerts.run_once(runtime_now(), now=fired + timedelta(seconds=cooldown))
    clear()
    done = fired + timedelta(seconds=cooldown + 1)
    evaluate_alerts.run_once(runtime_now(), now=done)
    notify_alerts.run_once(runtime_now(), now=done)
    assert _states(engine, rule) == [(one.dedupe_key, "resolved")]
    severity = shipped.severity.upper()
    assert [t for t in _titles(slack) if rule in t] == [
        f"[{severity}] {rule} firing",
        f"[{severity}] {rule} still firing (reminder 1)",
        f"[RESOLVED] {rule}",
    ]


def _titles(fake: FakeService) -> list[str]:
    return [r.data["blocks"][0]["text"]["text"] for r in fake.received]


def _recon_run(engine, provider: str, at: datetime, items: list[tuple[str, int | None]], *, file_id: int = 1) -> int:
    """A completed run of ``provider`` with items (category, manual_review_id); its id."""
    with engine.begin() as conn:
        run_id = conn.execute(
            insert(reconciliation_run).values(
                provider=provider,
                settlement_date=at.date(),
                settlement_file_id=file_id,
                started_by="daily",
                status=ReconciliationRunStatus.COMPLETED,
                started_at=at,
                finished_at=at,
            )
        ).inserted_primary_key[0]
        for line_no, (category, review_id) in enumerate(items, 1):
            conn.execute(
                insert(reconciliation_item).values(
                    run_id=run_id,
                    category=category,
                    kind="charge",
                    settlement_file_id=file_id,
                    line_no=line_no,
                    action="review" if review_id else "none",
                    manual_review_id=review_id,
                    created_at=at,
                )
            )
    return run_id


def _review(engine, category: str, subject: str, at: datetime) -> int:
    with engine.begin() as conn:
        return review.escalate(
            conn, kind=f"reconciliation_{category}", subject=subject, reason="test", now=at
        ).review_id


def test_reconciliation_unexplained_fires_per_provider_reminds_and_resolves_with_its_reviews(engine, tmp_path):
    t0 = utcnow()
    mismatch = _review(engine, RECON_AMOUNT_MISMATCH, "alipay:charge:pay_1", t0)
    only = _review(engine, RECON_PROVIDER_ONLY, "alipay:charge:tx_2", t0)
    done = _review(engine, RECON_LOCAL_ONLY, "alipay:charge:pay_3", t0)
    with engine.begin() as conn:
        review.resolve(conn, done, resolution="checked", resolved_by="finance", now=t0)
    _recon_run(engine, "alipay", t0 - timedelta(days=1), [(RECON_STATUS_MISMATCH, None)] * 5)  # an older run
    _recon_run(
        engine,
        "alipay",
        t0,
        [
            (RECON_AMOUNT_MISMATCH, mismatch),
            (RECON_PROVIDER_ONLY, only),
            (RECON_LOCAL_ONLY, done),
            (RECON_MATCHED, None),
        ],
    )
    _recon_run(engine, "wechatpay", t0, [(RECON_MATCHED, None), (RECON_FEE, None)])  # clean: nothing for it
    with FakeService("slack") as slack:
        runtime = _slack_runtime(engine, tmp_path, slack.url)
        evaluate_alerts.run_once(runtime, now=t0)
        (one,) = _alerts(engine, "reconciliation_unexplained")
        assert one.dedupe_key == "reconciliation_unexplained:alipay"
        assert "left 2 items unexplained" in one.message, "the resolved review's item does not count"

        def clear() -> None:
            with engine.begin() as conn:
                for review_id in (mismatch, only):
                    review.resolve(conn, review_id, resolution="booked", resolved_by="finance", now=t0)

        _lifecycle(engine, lambda: runtime, slack, "reconciliation_unexplained", t0, clear)


def test_reconciliation_unexplained_reads_the_latest_run_and_an_unreadable_files_review(engine):
    runtime = _runtime(engine)
    t0 = utcnow()
    file_review = _review(engine, RECON_UNREADABLE, "alipay:file:7", t0)
    # A re-run of file 7 re-reads its unreadable lines and escalates none again (no link): the file review counts.
    _recon_run(engine, "alipay", t0, [(RECON_UNREADABLE, None)] * 3, file_id=7)
    evaluate_alerts.run_once(runtime, now=t0)
    (one,) = _alerts(engine, "reconciliation_unexplained")
    assert (one.status, "left 3 items unexplained" in one.message) == ("firing", True)
    with engine.begin() as conn:
        review.resolve(conn, file_review, resolution="file fixed", resolved_by="finance", now=t0)
    evaluate_alerts.run_once(runtime, now=t0 + timedelta(seconds=1))
    assert _states(engine, "reconciliation_unexplained") == [("reconciliation_unexplained:alipay", "resolved")]

    open_review = _review(engine, RECON_STATUS_MISMATCH, "alipay:charge:pay_9", t0)
    _recon_run(engine, "alipay", t0, [(RECON_STATUS_MISMATCH, open_review)])
    evaluate_alerts.run_once(runtime, now=t0 + timedelta(seconds=2))
    assert [s for _, s in _states(engine, "reconciliation_unexplained")] == ["resolved", "firing"]
    _recon_run(engine, "alipay", t0, [(RECON_MATCHED, None)])  # a later clean run: its review is another matter
    evaluate_alerts.run_once(runtime, now=t0 + timedelta(seconds=3))
    assert [s for _, s in _states(engine, "reconciliation_unexplained")] == ["resolved", "resolved"]


def _ledger_events(engine, count: int, at: datetime) -> None:
    with engine.begin() as conn:
        for _ in range(count):
            conn.execute(
                insert(ledger_event).values(
                    event_type="PaymentConfirmed",
                    amount_minor=100,
                    currency="CNY",
                    source_type="api",
                    dedupe_key=f"test:{uuid.uuid4().hex}",
                    created_at=at,
                )
            )


def test_ledger_chain_stale_fires_on_events_unsealed_past_the_window_and_resolves_once_sealed(engine, tmp_path):
    t0 = utcnow()
    _ledger_events(engine, 2, t0 - timedelta(seconds=700))
    assert seal_ledger.seal(engine) == 2  # sealed: not stale however old
    runtime = _runtime(engine)
    evaluate_alerts.run_once(runtime, now=t0)
    assert _alerts(engine, "ledger_chain_stale") == []

    _ledger_events(engine, 3, t0 - timedelta(seconds=601))  # the sealer stopped: 10 minutes and more unsealed
    _ledger_events(engine, 1, t0 - timedelta(seconds=30))  # recent: not yet the sealer's fault
    with FakeService("slack") as slack:
        runtime = _slack_runtime(engine, tmp_path, slack.url)
        evaluate_alerts.run_once(runtime, now=t0)
        (one,) = _alerts(engine, "ledger_chain_stale")
        assert "3 ledger events unsealed for more than 600 s (oldest 601 s)" in one.message
        _lifecycle(engine, lambda: runtime, slack, "ledger_chain_stale", t0, lambda: seal_ledger.seal(engine))


@pytest.mark.mariadb
def test_broker_unreachable_fires_after_2_minutes_on_a_closed_port_and_resolves_when_it_answers(
    mariadb, amqp_url, tmp_path
):
    t0 = utcnow()
    with FakeService("slack") as slack:
        reachable = _slack_runtime(mariadb, tmp_path, slack.url, amqp_url=amqp_url)
        evaluate_alerts.run_once(reachable, now=t0)
        assert _alerts(mariadb, "broker_unreachable") == []
        closed = url_via(amqp_url, free_port())  # nothing listens there
        runtime = _slack_runtime(mariadb, tmp_path, slack.url, amqp_url=closed)
        evaluate_alerts.run_once(runtime, now=t0)
        (one,) = _alerts(mariadb, "broker_unreachable")
        assert "RabbitMQ unreachable: AMQPConnectionError" in one.message and "guest" not in one.message
        state = {"runtime": runtime}
        _lifecycle(
            mariadb, lambda: state["runtime"], slack, "broker_unreachable", t0, lambda: state.update(runtime=reachable)
        )


def test_broker_unreachable_finds_nothing_without_an_amqp_url(engine):
    runtime = _runtime(engine)
    assert runtime.settings.amqp_url == ""
    assert evaluate_alerts.probes(runtime) == {}
    evaluate_alerts.run_once(runtime)
    assert _alerts(engine, "broker_unreachable") == []
