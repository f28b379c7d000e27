"""relay_outbox and query_unresolved against MariaDB and the real sandbox platform.

Each outcome of a provider call, the crash between the provider's commit and
ours, the fixed idempotency key (invariant 6), the provider that cannot dedupe,
the circuit breaker and the deadline.
"""

# ruff: noqa: F811 - pytest fixtures imported from tests.sandbox_process
from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest
from sqlalchemy import delete, select, update

from compensator import query_unresolved, relay_outbox
from payments import breaker
from payments.db import utcnow
from payments.runtime import build_runtime
from payments.schema import alert, manual_review, outbox, payment, provider_breaker
from payments.states import OutboxStatus
from tests.outbound_support import calls, domain_events, expire_leases, make_due, new_payment, reviews, row
from tests.sandbox_process import sandbox, sandbox_process  # noqa: F401
from tests.support import ROOT, env_for, make_settings


@pytest.fixture
def runtime(mariadb, sandbox):
    settings = make_settings(
        database_url=mariadb.url.render_as_string(hide_password=False),
        sandbox_api_url=sandbox.url,
        provider_timeout_seconds=0.3,
        query_base_seconds=0.05,
        query_max_seconds=0.2,
        query_pending_after_seconds=0.2,
        relay_max_seconds=10,
        sandbox_legacy_enabled=True,
    )
    return build_runtime(settings, mariadb)


def test_relay_no_ops_on_an_empty_database(runtime):
    assert relay_outbox.run_once(runtime) == 0
    assert query_unresolved.run_once(runtime) == 0


def test_a_charge_the_provider_confirms_succeeds_and_names_its_call(runtime, sandbox):
    payment_id = new_payment(runtime)
    assert relay_outbox.run_once(runtime) == 1
    p = row(runtime, payment_id)
    (call,) = calls(runtime, payment_id)
    assert p["status"] == "Succeeded"
    assert p["status_source"] == f"call:{call['id']}"
    assert p["provider_transaction_id"] == sandbox.truth()["charges"][0]["id"]
    assert (call["operation"], call["outcome"], call["http_status"]) == ("charge", "Succeeded", 200)
    assert call["idempotency_key"] == p["idempotency_key"] and call["latency_ms"] is not None
    assert domain_events(runtime, payment_id) == ["PaymentSucceeded"]
    with runtime.engine.connect() as conn:
        assert (
            conn.execute(select(outbox.c.status).where(outbox.c.event_type == "ChargeRequested")).scalar()
            == OutboxStatus.DONE
        )
    assert relay_outbox.run_once(runtime) == 0, "a done row is not sent again"


def test_a_decline_fails_the_payment(runtime, sandbox):
    sandbox.faults(decline_rate=1.0)
    payment_id = new_payment(runtime)
    relay_outbox.run_once(runtime)
    p = row(runtime, payment_id)
    assert (p["status"], p["error_code"]) == ("Failed", "card_declined")
    assert domain_events(runtime, payment_id) == ["PaymentFailed"]


def test_a_timeout_after_the_provider_committed_is_unknown_until_a_query_finds_the_charge(runtime, sandbox):
    sandbox.faults(timeout_after_commit_rate=1.0, hang_seconds=1.0)
    payment_id = new_payment(runtime)
    relay_outbox.run_once(runtime)
    p = row(runtime, payment_id)
    assert p["status"] == "Unknown", "a timeout is never Failed"
    assert p["next_query_at"] is not None
    assert domain_events(runtime, payment_id) == ["PaymentUnknown"]

    sandbox.faults()
    make_due(runtime, payment_id)
    assert query_unresolved.run_once(runtime) == 1
    p = row(runtime, payment_id)
    query = calls(runtime, payment_id, "query")[-1]
    assert (p["status"], p["status_source"]) == ("Succeeded", f"query:{query['id']}")
    assert domain_events(runtime, payment_id) == ["PaymentUnknown", "PaymentSucceeded"]
    assert sandbox.charge_count(payment_id) == 1


def test_every_retry_of_a_payment_sends_its_one_idempotency_key(runtime, sandbox):
    # 503 before processing: Unknown; the query finds nothing; the charge is sent again, with the same key.
    runtime = replace(runtime, settings=replace(runtime.settings, query_not_found_grace_seconds=0))
    sandbox.faults(error_5xx_rate=1.0)
    payment_id = new_payment(runtime, key="the-merchants-key")
    relay_outbox.run_once(runtime)
    assert row(runtime, payment_id)["status"] == "Unknown"
    for _ in range(2):  # still down: query is Unknown too; then up: NotFound → re-send
        make_due(runtime, payment_id)
        query_unresolved.run_once(runtime)
        relay_outbox.run_once(runtime)
        sandbox.faults()
    make_due(runtime, payment_id)
    query_unresolved.run_once(runtime)
    relay_outbox.run_once(runtime)

    assert row(runtime, payment_id)["status"] == "Succeeded"
    charges = calls(runtime, payment_id, "charge")
    assert len(charges) >= 2
    assert {c["idempotency_key"] for c in charges} == {"the-merchants-key"}
    assert len({c["request_digest"] for c in charges}) == 1
    truth = sandbox.truth()
    assert truth["charge_counts"] == {payment_id: 1}
    assert truth["charges"][0]["idempotency_key"] == "the-merchants-key"


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


def run_relay_process(runtime, **env):
    """``python -m compensator relay_outbox --once`` as its own process (so a failpoint can SIGKILL it)."""
    s = runtime.settings
    settings_env = {
        "DATABASE_URL": s.database_url,
        "SANDBOX_API_URL": s.sandbox_api_url,
        "SANDBOX_LEGACY_ENABLED": "true",
        "PROVIDER_TIMEOUT_SECONDS": str(s.provider_timeout_seconds),
        "LOG_LEVEL": "WARNING",
        **env,
    }
    return subprocess.run(
        [sys.executable, "-m", "compensator", "relay_outbox", "--once"],
        cwd=ROOT,
        env=env_for(settings_env),
        capture_output=True,
        timeout=60,
    )


def test_a_relay_killed_after_the_provider_charged_converges_with_exactly_one_charge(runtime, sandbox):
    payment_id = new_payment(runtime)
    killed = run_relay_process(runtime, FAILPOINTS="relay.after_provider_call")
    assert killed.returncode == -9, killed.stderr.decode()[-2000:]
    assert sandbox.charge_count(payment_id) == 1, "the provider charged"
    p = row(runtime, payment_id)
    assert p["status"] == "Pending", "…but our commit never happened"
    (first,) = calls(runtime, payment_id)
    assert first["outcome"] is None, "the call is on file even though its answer was lost"

    assert run_relay_process(runtime).returncode == 0
    assert row(runtime, payment_id)["status"] == "Pending", "the row is leased: not re-sent before the lease runs out"
    expire_leases(runtime)
    done = run_relay_process(runtime)
    assert done.returncode == 0, done.stderr.decode()[-2000:]

    p = row(runtime, payment_id)
    first, second = calls(runtime, payment_id)
    assert p["status"] == "Succeeded" and p["status_source"] == f"call:{second['id']}"
    assert first["idempotency_key"] == second["idempotency_key"] == p["idempotency_key"]
    truth = sandbox.truth()
    assert truth["charge_counts"] == {payment_id: 1}
    assert p["provider_transaction_id"] == truth["charges"][0]["id"]


def test_a_provider_without_idempotency_support_is_never_resent(runtime, sandbox):
    # The relay dies after the legacy provider charged: the restarted relay must not send again.
    crashed = new_payment(runtime, provider="sandbox_legacy")
    assert run_relay_process(runtime, FAILPOINTS="relay.after_provider_call").returncode == -9
    expire_leases(runtime)
    assert run_relay_process(runtime).returncode == 0
    p = row(runtime, crashed)
    assert p["status"] == "Unknown"
    assert reviews(runtime, crashed) == ["unresolved_not_resendable"]

    # A timeout: Unknown, straight to the manual queue; neither a query nor a re-send follows.
    sandbox.faults(timeout_after_commit_rate=1.0, hang_seconds=1.0)
    timed_out = new_payment(runtime, provider="sandbox_legacy")
    relay_outbox.run_once(runtime)
    sandbox.faults()
    assert row(runtime, timed_out)["status"] == "Unknown"
    assert row(runtime, timed_out)["next_query_at"] is None
    for _ in range(3):
        make_due(runtime, timed_out)
        make_due(runtime, crashed)
        query_unresolved.run_once(runtime)
        expire_leases(runtime)
        relay_outbox.run_once(runtime)
    assert reviews(runtime, timed_out) == ["unresolved_not_resendable"]
    for payment_id in (crashed, timed_out):
        assert len(calls(runtime, payment_id)) == 1, "one call, ever"
        assert sandbox.charge_count(payment_id) == 1
        assert row(runtime, payment_id)["status"] == "Unknown"
    with runtime.engine.connect() as conn:
        assert conn.execute(select(alert.c.rule).where(alert.c.status == "firing")).scalars().all()


def test_a_failing_provider_trips_the_breaker_which_closes_when_a_probe_succeeds(runtime, sandbox):
    rt = replace(
        runtime,
        settings=replace(runtime.settings, relay_concurrency=1, breaker_failure_threshold=3, breaker_open_seconds=5),
    )
    sandbox.faults(error_5xx_rate=1.0)
    ids = [new_payment(rt) for _ in range(6)]
    relay_outbox.run_once(rt, max_seconds=1)
    sent = [pid for pid in ids if calls(rt, pid)]
    assert len(sent) == 3, "calls stop once the breaker opens"
    with rt.engine.connect() as conn:
        state = conn.execute(select(provider_breaker)).mappings().one()
        assert state["state"] == "open"
        firing = conn.execute(select(alert.c.open_key).where(alert.c.status == "firing")).scalars().all()
        assert "provider_circuit_open:sandbox" in firing
        deferred = (
            conn.execute(
                select(outbox.c.next_attempt_at).where(
                    outbox.c.status == OutboxStatus.PENDING, outbox.c.event_type == "ChargeRequested"
                )
            )
            .scalars()
            .all()
        )
        assert len(deferred) == 3 and all(t >= state["retry_at"] for t in deferred), (deferred, dict(state))

    sandbox.faults()
    assert relay_outbox.run_once(rt) == 0, "nothing is sent while the breaker is open"
    with rt.engine.begin() as conn:  # the pause is over
        conn.execute(update(provider_breaker).values(retry_at=utcnow()))
    time.sleep(breaker.CACHE_SECONDS)  # processes re-read the breaker row this often
    expire_leases(rt)
    relay_outbox.run_once(rt)
    with rt.engine.connect() as conn:
        assert conn.execute(select(provider_breaker.c.state)).scalar() == "closed"
        assert (
            conn.execute(select(alert.c.status).where(alert.c.rule == "provider_circuit_open")).scalar() == "resolved"
        )
    assert all(row(rt, pid)["status"] == "Succeeded" for pid in ids if pid not in sent)


def test_concurrent_failed_calls_are_all_counted_by_the_breaker_without_deadlocks(mariadb):
    settings = make_settings(breaker_failure_threshold=1000)
    errors = []

    def fail_once():
        try:
            breaker.record(
                mariadb,
                "sandbox",
                healthy=False,
                probe=False,
                snapshot=breaker.Snapshot(),
                settings=settings,
                now=utcnow(),
            )
        except Exception as exc:  # noqa: BLE001 - collected and asserted on below
            errors.append(exc)

    fail_once()  # the breaker row exists from here on
    for _ in range(5):
        threads = [threading.Thread(target=fail_once) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []
    with mariadb.connect() as conn:
        assert conn.execute(select(provider_breaker.c.consecutive_failures)).scalar() == 41


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


def test_the_relay_and_the_query_job_work_on_the_embedded_sqlite_database(sqlite, sandbox):
    rt = build_runtime(
        make_settings(
            database_url=sqlite.url.render_as_string(hide_password=False),
            sandbox_api_url=sandbox.url,
            provider_timeout_seconds=0.3,
            query_base_seconds=0.05,
            query_max_seconds=0.2,
        ),
        sqlite,
    )
    ok = new_payment(rt)
    relay_outbox.run_once(rt)
    sandbox.faults(timeout_after_commit_rate=1.0, hang_seconds=1.0)
    unknown = new_payment(rt)
    relay_outbox.run_once(rt)
    sandbox.faults()
    make_due(rt, unknown)
    query_unresolved.run_once(rt)
    assert {row(rt, ok)["status"], row(rt, unknown)["status"]} == {"Succeeded"}
    assert sandbox.truth()["charge_counts"] == {ok: 1, unknown: 1}


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
