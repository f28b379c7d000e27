"""process_callback on both databases: state changes, the ledger they leave, conflicts, retries and give-ups."""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timedelta

import pytest
from sqlalchemy import func, select

from payments.inbound.callbacks import CallbackResult, process_callback, store_callback
from payments.infra.backoff import RetryPolicy
from payments.infra.schema import (
    alert,
    ledger_entry,
    ledger_event,
    manual_review,
    outbox,
    payment,
    payment_callback_log,
)
from payments.providers import build_providers
from payments.states import CallbackStatus
from tests.support import create_payment, make_settings, sandbox_event, signed


def test_a_verified_success_callback_confirms_the_payment_once(engine):
    settings = make_settings()
    providers = build_providers(settings)
    payment_id = create_payment(engine, amount=1234)
    body, headers = signed(sandbox_event(payment_id, amount=1234))
    first = store_callback(engine, provider="sandbox", body=body, headers=headers, remote_addr="127.0.0.1")
    second = store_callback(engine, provider="sandbox", body=body, headers=headers, remote_addr="127.0.0.1")

    assert process_callback(engine, providers, first, RetryPolicy()) == CallbackResult.APPLIED
    assert process_callback(engine, providers, second, RetryPolicy()) == CallbackResult.DUPLICATE
    assert process_callback(engine, providers, first, RetryPolicy()) == CallbackResult.SKIPPED

    with engine.connect() as conn:
        assert conn.execute(select(payment.c.status).where(payment.c.payment_id == payment_id)).scalar() == "Succeeded"
        statuses = conn.execute(select(payment_callback_log.c.status).order_by(payment_callback_log.c.id)).scalars()
        assert list(statuses) == [CallbackStatus.PROCESSED] * 2
        lines = conn.execute(select(func.count(), func.sum(ledger_entry.c.amount_minor))).one()
        assert tuple(lines) == (2, 0)


# --- helpers for the tests below -----------------------------------------------------------------------------


def _stored(engine, event_or_body, **sign) -> int:
    body, headers = signed(event_or_body, **sign)
    return store_callback(engine, provider="sandbox", body=body, headers=headers, remote_addr="127.0.0.1")


def _row(engine, log_id: int):
    with engine.connect() as conn:
        return conn.execute(select(payment_callback_log).where(payment_callback_log.c.id == log_id)).one()


def _payment_row(engine, payment_id: str):
    with engine.connect() as conn:
        return conn.execute(select(payment).where(payment.c.payment_id == payment_id)).one()


def _all(engine, table, *where):
    with engine.connect() as conn:
        return list(conn.execute(select(table).where(*where).order_by(table.c.id)))


PROVIDERS = build_providers(make_settings())


# --- state changes ----------------------------------------------------------------------------------------------


def test_a_failure_callback_fails_the_payment_with_its_code_and_no_ledger_lines(engine):
    payment_id = create_payment(engine)
    log_id = _stored(engine, sandbox_event(payment_id, event_type="charge.failed", failure_code="card_declined"))
    assert process_callback(engine, PROVIDERS, log_id, RetryPolicy()) == CallbackResult.APPLIED
    row = _payment_row(engine, payment_id)
    assert (row.status, row.error_code, row.status_source) == ("Failed", "card_declined", f"callback:{log_id}")
    events = _all(engine, ledger_event)
    assert [(e.event_type, e.source_type, e.source_id) for e in events] == [("PaymentFailed", "callback", str(log_id))]
    assert _all(engine, ledger_entry) == []
    assert [o.event_type for o in _all(engine, outbox)] == ["PaymentFailed"]


def test_a_success_for_a_created_payment_walks_through_pending_and_records_the_path(engine):
    payment_id = create_payment(engine, status="Created")
    log_id = _stored(engine, sandbox_event(payment_id, provider_transaction_id="ch_walk"))
    assert process_callback(engine, PROVIDERS, log_id, RetryPolicy()) == CallbackResult.APPLIED
    row = _payment_row(engine, payment_id)
    assert (row.status, row.provider_transaction_id) == ("Succeeded", "ch_walk")
    (event,) = _all(engine, ledger_event)
    assert json.loads(event.details)["path"] == ["Pending", "Succeeded"]
    log_row = _row(engine, log_id)
    assert (log_row.status, log_row.provider_event_id, log_row.order_no) == (
        CallbackStatus.PROCESSED,
        log_row.provider_event_id,
        payment_id,
    )


def test_a_late_success_for_a_succeeded_payment_is_a_noop(engine):
    payment_id = create_payment(engine, status="Succeeded")
    before = _payment_row(engine, payment_id)
    # The same news again (e.g. a second event id for the same charge) is not a conflict.
    log_id = _stored(engine, sandbox_event(payment_id))
    assert process_callback(engine, PROVIDERS, log_id, RetryPolicy()) == CallbackResult.NOOP
    assert _payment_row(engine, payment_id) == before
    assert _row(engine, log_id).result.startswith("noop: already Succeeded")
    assert _all(engine, ledger_event) == []


# --- conflicting reports ----------------------------------------------------------------------------------------

CONFLICTS = {
    "success for a failed payment": ({"status": "Failed"}, {}),
    "failure for a succeeded payment": ({"status": "Succeeded"}, {"event_type": "charge.failed"}),
    "different amount": ({}, {"amount": 999}),
    "different currency": ({}, {"currency": "USD"}),
    "different provider transaction": ({"provider_transaction_id": "ch_ours"}, {"provider_transaction_id": "ch_x"}),
}


@pytest.mark.parametrize("name", list(CONFLICTS))
def test_a_conflicting_report_changes_nothing_and_opens_a_review_and_an_alert(engine, name):
    payment_kwargs, event_kwargs = CONFLICTS[name]
    payment_id = create_payment(engine, amount=1000, currency="CNY", **payment_kwargs)
    before = _payment_row(engine, payment_id)
    log_id = _stored(engine, sandbox_event(payment_id, **event_kwargs))

    assert process_callback(engine, PROVIDERS, log_id, RetryPolicy()) == CallbackResult.CONFLICT

    assert _payment_row(engine, payment_id) == before, "a conflicting report must not touch the payment"
    log_row = _row(engine, log_id)
    assert log_row.status == CallbackStatus.PROCESSED and log_row.result.startswith("conflict: ")
    (review,) = _all(engine, manual_review)
    assert (review.kind, review.payment_id, review.callback_log_id, review.status) == (
        "conflicting_report",
        payment_id,
        log_id,
        "open",
    )
    (fired,) = _all(engine, alert)
    assert (fired.rule, fired.status, fired.severity) == ("conflicting_report", "firing", "critical")
    assert _all(engine, ledger_event) == [] and _all(engine, outbox) == []
    # The conflict is final for this delivery: processing it again does nothing more.
    assert process_callback(engine, PROVIDERS, log_id, RetryPolicy()) == CallbackResult.SKIPPED
    assert len(_all(engine, manual_review)) == 1


# --- unknown payments, retries, backoff, give-up ----------------------------------------------------------------


def test_a_callback_for_an_unknown_payment_is_retried_then_applied_once_the_order_commits(engine):
    payment_id = f"pay_{uuid.uuid4().hex[:20]}"
    log_id = _stored(engine, sandbox_event(payment_id))
    assert process_callback(engine, PROVIDERS, log_id, RetryPolicy()) == CallbackResult.RETRY
    row = _row(engine, log_id)
    assert (row.status, row.retry_count) == (2, 1)
    assert row.result.startswith("target_not_found: ")
    create_payment(engine, payment_id=payment_id)
    assert process_callback(engine, PROVIDERS, log_id, RetryPolicy()) == CallbackResult.APPLIED
    assert _payment_row(engine, payment_id).status == "Succeeded"
    assert _row(engine, log_id).retry_count == 1


def test_retries_count_back_off_with_growing_jittered_delays_and_give_up_into_the_manual_queue(engine):
    policy = RetryPolicy(max_retries=7, base_seconds=2.0, max_seconds=40.0)
    log_id = _stored(engine, sandbox_event(f"pay_{uuid.uuid4().hex[:20]}"))
    now = datetime(2030, 1, 1, 12, 0, 0)
    delays = []
    for attempt in range(1, policy.max_retries):
        assert process_callback(engine, PROVIDERS, log_id, policy, now=now) == CallbackResult.RETRY
        row = _row(engine, log_id)
        assert (row.status, row.retry_count, row.last_retry_time) == (CallbackStatus.FAILED, attempt, now)
        delay = (row.next_retry_at - row.last_retry_time).total_seconds()
        ceiling = min(policy.max_seconds, policy.base_seconds * 2 ** (attempt - 1))
        assert ceiling / 2 <= delay <= ceiling, (attempt, delay)  # compute_backoff's "equal jitter" bounds
        delays.append(delay)
        now = row.next_retry_at
    # Equal jitter: the floor of each uncapped delay is the ceiling of the one before, so they only grow.
    uncapped = [d for n, d in enumerate(delays, 1) if policy.base_seconds * 2 ** (n - 1) <= policy.max_seconds]
    assert uncapped == sorted(uncapped) and uncapped[-1] > uncapped[0] * 8, delays
    assert len(uncapped) < len(delays) and max(delays) <= policy.max_seconds  # the cap was reached and held

    assert process_callback(engine, PROVIDERS, log_id, policy, now=now) == CallbackResult.GAVE_UP
    row = _row(engine, log_id)
    assert (row.status, row.retry_count) == (CallbackStatus.GAVE_UP, policy.max_retries)
    assert row.result.startswith(f"gave up after {policy.max_retries} attempts: target_not_found")
    (review,) = _all(engine, manual_review)
    assert (review.kind, review.callback_log_id) == ("callback_gave_up", log_id)
    (fired,) = _all(engine, alert)
    assert (fired.rule, fired.status, fired.dedupe_key) == ("callback_gave_up", "firing", f"callback_gave_up:{log_id}")
    # Given up means left alone: neither the consumer nor the sweep touches it again.
    assert process_callback(engine, PROVIDERS, log_id, policy, now=now + timedelta(days=1)) == CallbackResult.SKIPPED
    assert _row(engine, log_id).retry_count == policy.max_retries


def test_jitter_spreads_a_crowd_of_failed_rows(engine):
    policy = RetryPolicy(base_seconds=10.0, max_seconds=100.0)
    now = datetime(2030, 1, 1)
    ids = [_stored(engine, sandbox_event(f"pay_{uuid.uuid4().hex[:20]}")) for _ in range(12)]
    for log_id in ids:
        process_callback(engine, PROVIDERS, log_id, policy, now=now)
    due = {_row(engine, i).next_retry_at for i in ids}
    assert len(due) > 6, "rows that failed together must not all come back together"
    assert all(now + timedelta(seconds=5) <= d <= now + timedelta(seconds=10) for d in due)


# --- one platform, several adapters ---------------------------------------------------------------------------


def test_a_sandbox_platform_callback_reaches_a_sandbox_legacy_payment(engine):
    # The platform has one callback route and signs every event the same way, whichever adapter made the charge.
    providers = build_providers(make_settings(sandbox_legacy_enabled=True))
    payment_id = create_payment(engine, provider="sandbox_legacy", amount=1000)
    log_id = _stored(engine, sandbox_event(payment_id, amount=1000))
    assert process_callback(engine, providers, log_id, RetryPolicy()) == CallbackResult.APPLIED
    assert _payment_row(engine, payment_id).status == "Succeeded"
    assert _all(engine, manual_review) == []


def test_a_callback_from_another_platform_than_the_payments_is_a_conflict(engine):
    providers = build_providers(make_settings(sandbox_legacy_enabled=True))
    payment_id = create_payment(engine, provider="alipay", amount=1000)
    log_id = _stored(engine, sandbox_event(payment_id, amount=1000))
    assert process_callback(engine, providers, log_id, RetryPolicy()) == CallbackResult.CONFLICT
    assert "callback from sandbox for a alipay payment" in _row(engine, log_id).result


def test_a_callback_retried_until_it_gives_up_is_one_failed_row_in_the_metrics(engine):
    # The Prometheus failure ratio divides failed rows by received rows: retries of one row must not add up.
    from prometheus_client import REGISTRY

    def counted() -> tuple[float, float]:
        retries = REGISTRY.get_sample_value("paysync_callbacks_processed_total", {"outcome": "retry"}) or 0
        return REGISTRY.get_sample_value("paysync_callbacks_failed_total") or 0, retries

    policy = RetryPolicy(max_retries=4, base_seconds=0.01, max_seconds=0.01)
    failed, retries = counted()
    log_id = _stored(engine, sandbox_event(f"pay_{uuid.uuid4().hex[:20]}"))  # no such payment: every try fails
    now = datetime(2030, 1, 1, 12, 0, 0)
    outcomes = []
    for _ in range(policy.max_retries):
        outcomes.append(process_callback(engine, PROVIDERS, log_id, policy, now=now))
        now = _row(engine, log_id).next_retry_at or now
    assert outcomes == [CallbackResult.RETRY] * 3 + [CallbackResult.GAVE_UP]
    assert counted() == (failed + 1, retries + 3)
