"""The circuit breaker around provider calls: it opens and closes, counts concurrent failures, has one probe slot.

And what counts as a failed probe.
"""

# ruff: noqa: F811 - pytest fixtures imported from tests.sandbox_process and tests.outbound_support
from __future__ import annotations

import threading
import time
from dataclasses import replace
from datetime import timedelta

from sqlalchemy import insert, select, update

from compensator import query_unresolved, relay_outbox
from payments.infra.db import utcnow
from payments.infra.schema import alert, outbox, payment, provider_breaker
from payments.outbound import breaker
from payments.outbound import protocol as outbound_protocol
from payments.outbound.protocol import Context, Result, relay_charge
from payments.providers.base import Capabilities, Dedupe, Unknown
from payments.runtime import build_runtime
from payments.states import BreakerState, OutboxStatus
from tests.fake_provider import FakeProvider
from tests.outbound_support import (
    calls,
    expire_leases,
    make_due,
    new_payment,
    row,
    runtime,  # noqa: F401
)
from tests.support import make_settings


def runtime_with(engine, provider, **overrides):
    settings = make_settings(
        database_url=engine.url.render_as_string(hide_password=False),
        provider_timeout_seconds=0.3,
        query_base_seconds=30,
        query_max_seconds=60,
        relay_max_seconds=10,
        **overrides,
    )
    rt = build_runtime(settings, engine)
    return replace(rt, providers={**rt.providers, provider.name: provider})


def keyed(**scripts) -> FakeProvider:
    return FakeProvider(Capabilities(dedupe=Dedupe.KEY, query_by_merchant_id=True), **scripts)


def open_breaker(engine, provider: str, retry_in: float, open_count: int = 1) -> None:
    """The provider's breaker open, its next probe due in ``retry_in`` seconds (negative: due now)."""
    now = utcnow()
    with engine.begin() as conn:
        conn.execute(
            insert(provider_breaker).values(
                provider=provider,
                state=BreakerState.OPEN,
                consecutive_failures=5,
                open_count=open_count,
                opened_at=now,
                retry_at=now + timedelta(seconds=retry_in),
                updated_at=now,
            )
        )
    breaker._forget(engine, provider)


def breaker_row(engine):
    with engine.connect() as conn:
        return conn.execute(select(provider_breaker)).mappings().one()


def test_a_probe_slot_taken_for_a_charge_that_is_not_sent_is_given_back(mariadb):
    fake = keyed()
    rt = runtime_with(mariadb, fake)
    done = new_payment(rt, provider="fake")
    late = new_payment(rt, provider="fake")
    with rt.engine.begin() as conn:
        conn.execute(update(payment).where(payment.c.payment_id == done).values(status="Succeeded"))
        conn.execute(update(payment).where(payment.c.payment_id == late).values(deadline_at=utcnow()))
    ctx = Context(rt.engine, rt.providers, rt.settings)
    claimed = {r[0]: r for r in outbound_protocol.claim_sends(rt.engine, utcnow(), 10, 30)}
    by_payment = dict(zip((done, late), sorted(claimed), strict=True))
    open_breaker(rt.engine, "fake", retry_in=-1)

    for payment_id, expected in ((done, Result.SKIPPED), (late, Result.REVIEW)):
        assert relay_charge(ctx, *claimed[by_payment[payment_id]][:3]) == expected
        assert breaker_row(rt.engine)["retry_at"] <= utcnow(), f"the slot is free again after {expected}"
        breaker._forget(rt.engine, "fake")
    assert fake.charges == []

    fresh = new_payment(rt, provider="fake")  # the next charge can be the probe at once
    relay_outbox.run_once(rt)
    assert row(rt, fresh)["status"] == "Succeeded"
    assert breaker_row(rt.engine)["state"] == BreakerState.CLOSED


def test_a_probe_slot_taken_for_a_query_that_is_not_sent_is_given_back(mariadb):
    fake = keyed(charges=[Unknown("timeout")])
    rt = runtime_with(mariadb, fake)
    payment_id = new_payment(rt, provider="fake")
    relay_outbox.run_once(rt)
    make_due(rt, payment_id)
    [(_, provider, lease, _)] = outbound_protocol.claim_queries(rt.engine, utcnow(), 10, 30, 60)
    with rt.engine.begin() as conn:  # the payment was settled meanwhile (a callback, say)
        conn.execute(update(payment).where(payment.c.payment_id == payment_id).values(status="Succeeded"))
    with rt.engine.begin() as conn:
        conn.execute(provider_breaker.delete())
    open_breaker(rt.engine, "fake", retry_in=-1)
    from payments.outbound.protocol import query_payment

    assert query_payment(Context(rt.engine, rt.providers, rt.settings), payment_id, provider, lease) == Result.SKIPPED
    assert breaker_row(rt.engine)["retry_at"] <= utcnow()
    assert fake.queries == []


def test_failed_budget_queries_while_the_breaker_is_open_do_not_each_count_as_a_failed_probe(mariadb):
    fake = keyed(charges=[Unknown("timeout")] * 3, queries=[Unknown("timeout")] * 3)
    rt = runtime_with(mariadb, fake, breaker_query_budget=5, breaker_failure_threshold=100)
    ids = [new_payment(rt, provider="fake") for _ in range(3)]
    relay_outbox.run_once(rt)
    with rt.engine.begin() as conn:
        conn.execute(provider_breaker.delete())
    open_breaker(rt.engine, "fake", retry_in=60, open_count=2)  # open, no probe due: only the budget may query
    before = breaker_row(rt.engine)
    for payment_id in ids:
        make_due(rt, payment_id)
    assert query_unresolved.run_once(rt) == 3
    assert len(fake.queries) == 3, "the budget lets queries through while open"
    after = breaker_row(rt.engine)
    assert after["state"] == BreakerState.OPEN
    assert after["consecutive_failures"] == before["consecutive_failures"] + 3
    assert after["open_count"] == before["open_count"], "none of them held the probe slot: no longer pause"
    assert after["retry_at"] == before["retry_at"]


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


def test_only_one_caller_takes_the_probe_slot_and_the_others_wait_for_it_to_expire(mariadb):
    open_breaker(mariadb, "sandbox", retry_in=-1)
    now = utcnow()
    first = breaker.admit(mariadb, "sandbox", now, probe_seconds=15)
    second = breaker.admit(mariadb, "sandbox", now, probe_seconds=15)
    assert (first.admission, second.admission) == (breaker.Admission.PROBE, breaker.Admission.DENY)
    assert second.snapshot.retry_at == first.probe_until == now + timedelta(seconds=15), "look again when it expires"
    breaker.release(mariadb, "sandbox", first, utcnow())
    assert breaker.admit(mariadb, "sandbox", utcnow(), probe_seconds=15).probe, "a released slot is free at once"
