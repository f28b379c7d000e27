"""The rules evaluate_alerts checks beyond the seed's two, each against a database in the state that triggers it.

Each fires (after its sustain), stays one alert while it holds, and resolves when the state clears.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import insert, select, update

from compensator import evaluate_alerts
from payments.breaker import alert_key
from payments.db import utcnow
from payments.runtime import build_runtime
from payments.schema import alert, payment, payment_callback_log, provider_breaker, refund
from payments.states import BreakerState, CallbackStatus
from tests.stack import db_url
from tests.support import create_payment, make_settings


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
