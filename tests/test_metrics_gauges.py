"""/metrics database gauges for operations: outbox lag, Unknown payments by age, deadlines, reconciliation, alerts."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest
from sqlalchemy import insert, update

from gateway import create_app
from payments.escalation import alerts
from payments.infra.db import utcnow
from payments.infra.schema import outbox, payment, reconciliation_item, reconciliation_run
from tests.support import create_payment, make_settings
from tests.test_metrics import samples


def _aged(engine, status: str, age: timedelta, **values) -> str:  # noqa: ANN001, ANN003
    payment_id = create_payment(engine, status=status)
    with engine.begin() as conn:
        conn.execute(
            update(payment).where(payment.c.payment_id == payment_id).values(created_at=utcnow() - age, **values)
        )
    return payment_id


def _run(engine, provider: str, categories: list[str], status: str = "completed") -> None:  # noqa: ANN001
    now = utcnow()
    with engine.begin() as conn:
        run_id = conn.execute(
            insert(reconciliation_run).values(
                provider=provider, settlement_date=now.date(), started_by="manual", status=status, started_at=now
            )
        ).inserted_primary_key[0]
        for category in categories:
            conn.execute(
                insert(reconciliation_item).values(
                    run_id=run_id, category=category, kind="charge", action="none", created_at=now
                )
            )


def test_the_operational_gauges_read_the_database(engine, settings):
    for age in (
        timedelta(minutes=1),
        timedelta(minutes=30),
        timedelta(minutes=40),
        timedelta(hours=3),
        timedelta(days=2),
        timedelta(days=4),
    ):
        _aged(engine, "Unknown", age)
    _aged(engine, "Pending", timedelta(hours=1), deadline_at=utcnow() - timedelta(minutes=1))
    _aged(engine, "Succeeded", timedelta(hours=1), deadline_at=utcnow() - timedelta(minutes=1))  # final: not late
    now = utcnow()
    with engine.begin() as conn:
        conn.execute(
            insert(outbox).values(
                event_id="evt_lag",
                event_type="ChargeRequested",
                aggregate_id="pay_x",
                payload="{}",
                status=0,
                attempts=0,
                next_attempt_at=now,
                created_at=now - timedelta(seconds=90),
                updated_at=now,
            )
        )
        alerts.observe(conn, rule="callback_backlog", key="callback_backlog", message="m", now=now)
    _run(engine, "sandbox", ["matched", "matched", "provider_only"])
    _run(engine, "sandbox", ["matched", "amount_mismatch"])  # the latest completed run counts, not the first
    _run(engine, "sandbox", ["provider_only"] * 5, status="failed")

    got = samples(create_app(settings, engine=engine).test_client().get("/metrics").get_data(as_text=True))

    ages = {age: got[("paysync_unknown_payments", (("age", age),))] for age in ("<1h", "<1d", "<3d", "older")}
    assert ages == {
        "<1h": 3,
        "<1d": 1,
        "<3d": 1,
        "older": 1,
    }  # the console's buckets (payments/reconciliation/aging.py)
    assert got[("paysync_unknown_payment_oldest_seconds", ())] >= 2 * 86400
    assert 85 <= got[("paysync_outbox_oldest_pending_seconds", ())] < 600
    assert got[("paysync_past_deadline", (("kind", "payment"),))] == 1
    assert got[("paysync_past_deadline", (("kind", "refund"),))] == 0
    recon = {k[1]: v for k, v in got.items() if k[0] == "paysync_reconciliation_items"}
    assert recon == {
        (("category", "amount_mismatch"), ("provider", "sandbox")): 1,
        (("category", "matched"), ("provider", "sandbox")): 1,
    }
    assert got[("paysync_alert_open", (("rule", "callback_backlog"), ("status", "firing")))] == 1


def test_an_empty_database_reports_zeros(engine, settings):
    got = samples(create_app(settings, engine=engine).test_client().get("/metrics").get_data(as_text=True))
    assert got[("paysync_unknown_payments", (("age", "older"),))] == 0
    assert got[("paysync_outbox_oldest_pending_seconds", ())] == 0
    assert not [k for k in got if k[0] in ("paysync_reconciliation_items", "paysync_alert_open")]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"METRICS_BIND_ADDRESS": "localhost"}, "METRICS_BIND_ADDRESS must be an IP address"),
        ({"CONSUMER_METRICS_PORT": "70000"}, "CONSUMER_METRICS_PORT must be <= 65535"),
        ({"CALLBACK_RETENTION_DAYS": "-1"}, "CALLBACK_RETENTION_DAYS must be >= 0"),
        ({"CLEANUP_BATCH_SIZE": "0"}, "CLEANUP_BATCH_SIZE must be >= 1"),
    ],
)
def test_bad_observability_settings_stop_the_process(env, message):
    from payments.errors import ConfigError
    from payments.infra.settings import load_settings

    with pytest.raises(ConfigError, match=message):
        load_settings({"PAYSYNC_ENV": "development", **env})


def test_empty_metrics_ports_mean_off():
    from payments.infra.settings import load_settings

    settings = load_settings(
        {"PAYSYNC_ENV": "development", "CONSUMER_METRICS_PORT": "", "COMPENSATOR_METRICS_PORT": " "}
    )
    assert settings.consumer_metrics_port == settings.compensator_metrics_port == 0
    assert make_settings().metrics_bind_address == "127.0.0.1"


def test_the_gateway_counts_each_answer_by_provider_and_outcome(engine, settings):
    from prometheus_client import REGISTRY

    from tests.support import sandbox_event, signed

    def count(provider: str, outcome: str) -> float:
        labels = {"provider": provider, "outcome": outcome}
        return REGISTRY.get_sample_value("paysync_callbacks_received_total", labels) or 0.0

    def acks(provider: str) -> float:
        return REGISTRY.get_sample_value("paysync_callback_ack_seconds_count", {"provider": provider}) or 0.0

    before = {k: count(*k) for k in [("sandbox", "accepted"), ("sandbox", "rejected"), ("unknown", "rejected")]}
    before_acks = acks("sandbox")
    client = create_app(settings, engine=engine).test_client()
    body, headers = signed(sandbox_event(create_payment(engine)))
    assert client.post("/callbacks/sandbox", data=body, headers=headers).status_code == 200
    body, headers = signed(sandbox_event(create_payment(engine)), secret="not-the-secret")
    assert client.post("/callbacks/sandbox", data=body, headers=headers).status_code in (400, 401)
    assert client.post("/callbacks/made-up-name", data=b"{}").status_code == 404  # one label for every such URL

    assert count("sandbox", "accepted") - before[("sandbox", "accepted")] == 1
    assert count("sandbox", "rejected") - before[("sandbox", "rejected")] == 1
    assert count("unknown", "rejected") - before[("unknown", "rejected")] == 1
    assert (
        REGISTRY.get_sample_value(
            "paysync_callbacks_received_total", {"provider": "made-up-name", "outcome": "rejected"}
        )
        is None
    )
    assert acks("sandbox") - before_acks == 2


def test_unexplained_reconciliation_items_stop_counting_once_their_review_is_resolved(engine, settings):
    # PaysyncReconciliationUnexplained reads this gauge: like paysync's own rule, it ignores resolved reviews.
    from payments.escalation import review
    from tests.test_alert_evaluators import _recon_run, _review

    t0 = utcnow()
    open_one = _review(engine, "amount_mismatch", "alipay:charge:pay_1", t0)
    resolved = _review(engine, "local_only", "alipay:charge:pay_2", t0)
    with engine.begin() as conn:
        review.resolve(conn, resolved, resolution="checked", resolved_by="finance", now=t0)
    _recon_run(engine, "alipay", t0, [("amount_mismatch", open_one), ("local_only", resolved), ("matched", None)])

    def gauge() -> dict:
        app = create_app(replace(settings, metrics_settled_cache_seconds=0), engine=engine)
        got = samples(app.test_client().get("/metrics").get_data(as_text=True))
        return {k[1]: v for k, v in got.items() if k[0] == "paysync_reconciliation_unexplained"}

    assert gauge() == {(("provider", "alipay"),): 1}
    with engine.begin() as conn:
        review.resolve(conn, open_one, resolution="booked", resolved_by="finance", now=t0)
    assert gauge() == {}  # the query counts what is still open: no row for a provider with nothing left
