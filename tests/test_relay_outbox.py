"""relay_outbox against MariaDB and the real sandbox platform, with query_unresolved where a charge needs it.

Each outcome of a provider call, the crash between the provider's commit and
ours, the fixed idempotency key (invariant 6), the provider that can neither
dedupe nor be queried, and the embedded SQLite database.
"""

# ruff: noqa: F811 - pytest fixtures imported from tests.sandbox_process and tests.outbound_support
from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

from sqlalchemy import select

from compensator import query_unresolved, relay_outbox
from payments.infra.db import utcnow
from payments.infra.schema import alert, outbox
from payments.runtime import build_runtime
from payments.states import OutboxStatus
from tests.outbound_support import (
    calls,
    domain_events,
    expire_leases,
    make_due,
    new_payment,
    reviews,
    row,
    runtime,  # noqa: F401
)
from tests.support import ROOT, env_for, make_settings


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


RUN_TIMEOUT = 60
"""The longest one relay process may take, start-up included (a busy machine starts Python slowly)."""


PROCESS_CALL_TIMEOUT = 60
"""A relay process's call timeout: no fault is armed while one runs, so its call waits for the sandbox's answer
however busy the machine, and the lease it writes (2 x this + …) outlasts the next process's whole run."""


def run_relay_process(runtime, **env):
    """``python -m compensator relay_outbox --once`` as its own process (so a failpoint can SIGKILL it)."""
    s = runtime.settings
    settings_env = {
        "DATABASE_URL": s.database_url,
        "SANDBOX_API_URL": s.sandbox_api_url,
        "SANDBOX_LEGACY_ENABLED": "true",
        "PROVIDER_TIMEOUT_SECONDS": str(PROCESS_CALL_TIMEOUT),
        "LOG_LEVEL": "WARNING",
        **env,
    }
    return subprocess.run(
        [sys.executable, "-m", "compensator", "relay_outbox", "--once"],
        cwd=ROOT,
        env=env_for(settings_env),
        capture_output=True,
        timeout=RUN_TIMEOUT,
    )


def lease_left(runtime, payment_id) -> float:  # noqa: ANN001
    """Seconds until the lease on the payment's ChargeRequested row runs out."""
    with runtime.engine.connect() as conn:
        leased_until = conn.execute(
            select(outbox.c.next_attempt_at).where(
                outbox.c.event_type == "ChargeRequested", outbox.c.aggregate_id == payment_id
            )
        ).scalar_one()
    return (leased_until - utcnow()).total_seconds()


def test_a_relay_killed_after_the_provider_charged_converges_with_exactly_one_charge(runtime, sandbox):
    payment_id = new_payment(runtime)
    killed = run_relay_process(runtime, FAILPOINTS="relay.after_provider_call")
    assert killed.returncode == -9, killed.stderr.decode()[-2000:]
    # The killed relay's lease outlasts the next run however slowly that process starts: the test ends the lease
    # itself (expire_leases), not the clock.
    assert lease_left(runtime, payment_id) > RUN_TIMEOUT
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
