"""query_unresolved against MariaDB and the real sandbox platform: Pending and Unknown payments looked up.

A Pending charge queried later, the deadline, and a provider's answer that
conflicts with ours (escalated once, backed off, healthy for the breaker).
"""

# ruff: noqa: F811 - pytest fixtures imported from tests.sandbox_process and tests.outbound_support
from __future__ import annotations

import time
from dataclasses import replace

from sqlalchemy import delete, select, update

from compensator import query_unresolved, relay_outbox
from payments.infra.db import utcnow
from payments.infra.schema import alert, manual_review, payment, provider_breaker
from tests.outbound_support import (
    calls,
    domain_events,
    make_due,
    new_payment,
    reviews,
    row,
    runtime,  # noqa: F401
)


def test_a_processing_charge_stays_pending_and_is_queried_later(runtime, sandbox):
    sandbox.faults(processing_rate=1.0, processing_seconds=0.2)
    payment_id = new_payment(runtime)
    relay_outbox.run_once(runtime)
    p = row(runtime, payment_id)
    assert p["status"] == "Pending" and p["provider_transaction_id"] and p["next_query_at"]
    time.sleep(0.5)
    make_due(runtime, payment_id)
    query_unresolved.run_once(runtime)
    assert row(runtime, payment_id)["status"] == "Succeeded"


def test_an_unknown_payment_past_its_deadline_goes_to_manual_review(runtime, sandbox):
    sandbox.faults(error_5xx_rate=1.0)
    payment_id = new_payment(runtime)
    relay_outbox.run_once(runtime)
    with runtime.engine.begin() as conn:
        conn.execute(update(payment).values(deadline_at=utcnow(), next_query_at=utcnow()))
    assert query_unresolved.run_once(runtime) == 1
    p = row(runtime, payment_id)
    assert p["status"] == "Unknown" and p["next_query_at"] is None
    assert reviews(runtime, payment_id) == ["unresolved_payment"]
    with runtime.engine.connect() as conn:
        assert conn.execute(select(alert.c.rule).where(alert.c.status == "firing")).scalars().all() == [
            "unresolved_payment"
        ]


def test_a_query_that_finds_our_number_charged_for_another_amount_opens_a_review_not_a_success(runtime, sandbox):
    # A backoff long enough that one run_once queries once (make_due skips it).
    runtime = replace(runtime, settings=replace(runtime.settings, query_base_seconds=30, query_max_seconds=60))
    sandbox.faults(timeout_after_commit_rate=1.0, hang_seconds=1.0)
    payment_id = new_payment(runtime, amount=1000)
    relay_outbox.run_once(runtime)
    assert row(runtime, payment_id)["status"] == "Unknown"
    # Our row says 1000; behind our back the amount we hold differs from what the provider charged.
    with runtime.engine.begin() as conn:
        conn.execute(update(payment).where(payment.c.payment_id == payment_id).values(amount_minor=999))
    sandbox.faults()
    make_due(runtime, payment_id)

    assert query_unresolved.run_once(runtime) == 1

    p = row(runtime, payment_id)
    assert p["status"] == "Unknown", "a charge for another amount must never confirm our payment"
    assert reviews(runtime, payment_id) == ["conflicting_report"]
    assert domain_events(runtime, payment_id) == ["PaymentUnknown"]


def test_a_query_answer_that_keeps_conflicting_is_one_review_one_alert_backs_off_and_keeps_the_breaker_closed(
    runtime, sandbox
):
    settings = replace(runtime.settings, breaker_failure_threshold=3, query_base_seconds=30, query_max_seconds=60)
    rt = replace(runtime, settings=settings)
    sandbox.faults(timeout_after_commit_rate=1.0, hang_seconds=1.0)
    payment_id = new_payment(rt, amount=1000)
    relay_outbox.run_once(rt)
    with rt.engine.begin() as conn:
        conn.execute(update(payment).where(payment.c.payment_id == payment_id).values(amount_minor=999))
        conn.execute(delete(provider_breaker))  # the timeout above counted as one failure; start from a clean slate
    sandbox.faults()

    for n in range(1, 6):
        make_due(rt, payment_id)
        before = utcnow()
        assert query_unresolved.run_once(rt) == 1
        p = row(rt, payment_id)
        assert p["status"] == "Unknown"
        assert p["query_attempts"] == n, "each conflicting answer counts as a query attempt: the backoff grows"
        delay = (p["next_query_at"] - before).total_seconds()
        assert 0 < delay <= rt.settings.query_max_seconds + 1, "next query after a backoff, not when the lease ends"

    assert len(calls(rt, payment_id, "query")) == 5
    with rt.engine.connect() as conn:
        (review,) = conn.execute(select(manual_review).where(manual_review.c.payment_id == payment_id)).mappings()
        assert (review["kind"], review["occurrences"], review["status"]) == ("conflicting_report", 5, "open")
        assert conn.execute(select(alert.c.rule)).scalars().all() == ["conflicting_report"]
        breaker_row = conn.execute(select(provider_breaker)).mappings().first()
    assert breaker_row is None or (breaker_row["state"], breaker_row["consecutive_failures"]) == ("closed", 0), (
        "a well-formed answer is a healthy call"
    )
