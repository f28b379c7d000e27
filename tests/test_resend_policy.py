"""Who may be sent a charge twice: only a provider that dedupes a re-send (by key or by our number).

A provider that can be queried but does not dedupe is queried until the
payment's deadline and never sent the same charge again; where re-sending is
allowed, a NotFound right after the last send is not believed yet; and on a
re-send, a refusal of the request says nothing definitive about the first one.
"""

# ruff: noqa: F811 - pytest fixtures imported from tests.sandbox_process
from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest
from sqlalchemy import select, update

from compensator import query_unresolved, relay_outbox
from payments.infra.db import utcnow
from payments.infra.schema import outbox, payment, provider_call
from payments.providers.base import Capabilities, Dedupe, Failed, NotFound, Succeeded, Unknown
from payments.runtime import build_runtime
from payments.states import OutboxStatus
from tests.fake_provider import FakeProvider
from tests.outbound_support import calls, domain_events, expire_leases, make_due, new_payment, reviews, row
from tests.support import make_settings


def runtime_for(engine, **overrides):
    settings = make_settings(
        database_url=engine.url.render_as_string(hide_password=False),
        provider_timeout_seconds=0.3,
        query_base_seconds=30,  # tests make a payment due themselves (make_due): one query per run_once
        query_max_seconds=60,
        query_pending_after_seconds=0.2,
        relay_max_seconds=10,
        **overrides,
    )
    return build_runtime(settings, engine)


def with_provider(rt, provider):
    return replace(rt, providers={**rt.providers, provider.name: provider})


def queried_not_deduped(**scripts) -> FakeProvider:
    """Can be looked up by our number; a second send is a second charge."""
    return FakeProvider(Capabilities(query_by_merchant_id=True), **scripts)


def pending_charge_requests(rt, payment_id) -> int:
    with rt.engine.connect() as conn:
        return len(
            conn.execute(
                select(outbox.c.id).where(
                    outbox.c.aggregate_id == payment_id,
                    outbox.c.event_type == "ChargeRequested",
                    outbox.c.status == OutboxStatus.PENDING,
                )
            ).all()
        )


def test_a_provider_that_can_be_queried_but_does_not_dedupe_is_queried_until_its_deadline_never_resent(mariadb):
    fake = queried_not_deduped(charges=[Unknown("timeout")])
    rt = with_provider(runtime_for(mariadb), fake)
    payment_id = new_payment(rt, provider="fake")
    relay_outbox.run_once(rt)
    p = row(rt, payment_id)
    assert p["status"] == "Unknown" and p["next_query_at"] is not None, "an Unknown is queried"

    for n in range(1, 5):  # the provider keeps saying it never saw the charge
        make_due(rt, payment_id)
        assert query_unresolved.run_once(rt) == 1
        expire_leases(rt)
        relay_outbox.run_once(rt)
        p = row(rt, payment_id)
        assert (p["status"], p["query_attempts"]) == ("Unknown", n)
        assert p["next_query_at"] is not None, "queried again after a backoff"
        assert pending_charge_requests(rt, payment_id) == 0, "no re-send queued"
    assert len(fake.charges) == 1, "never sent twice: a second send could be a second charge"
    assert len(fake.queries) == 4
    assert reviews(rt, payment_id) == []

    with rt.engine.begin() as conn:  # the deadline comes: a person decides
        conn.execute(update(payment).where(payment.c.payment_id == payment_id).values(deadline_at=utcnow()))
    make_due(rt, payment_id)
    query_unresolved.run_once(rt)
    assert reviews(rt, payment_id) == ["unresolved_payment"]
    assert len(fake.charges) == 1 and row(rt, payment_id)["next_query_at"] is None


def test_a_lost_outcome_at_a_provider_that_does_not_dedupe_is_queried_not_sent_again(mariadb):
    # The relay dies after the request left (the exception stands for the process dying there).
    fake = queried_not_deduped(charges=[RuntimeError("killed after the request left")], queries=[Succeeded("ch_1")])
    rt = with_provider(runtime_for(mariadb), fake)
    payment_id = new_payment(rt, provider="fake")
    relay_outbox.run_once(rt)
    assert row(rt, payment_id)["status"] == "Pending"
    (first,) = calls(rt, payment_id)
    assert first["outcome"] is None, "the call is on file, its answer lost"

    expire_leases(rt)  # the row comes back to a relay
    relay_outbox.run_once(rt)
    assert len(fake.charges) == 1, "not sent again"
    p = row(rt, payment_id)
    assert p["status"] == "Unknown" and p["next_query_at"] is not None, "it is queried instead"
    assert reviews(rt, payment_id) == []
    assert pending_charge_requests(rt, payment_id) == 0

    make_due(rt, payment_id)
    query_unresolved.run_once(rt)
    assert row(rt, payment_id)["status"] == "Succeeded"
    assert len(fake.charges) == 1


@pytest.fixture
def sandbox_runtime(mariadb, sandbox):
    return runtime_for(mariadb, sandbox_api_url=sandbox.url)


def test_a_not_found_right_after_the_last_send_is_not_believed_until_the_grace_has_passed(sandbox_runtime, sandbox):
    rt = sandbox_runtime
    sandbox.faults(error_5xx_rate=1.0)  # 503 before processing: Unknown, nothing charged
    payment_id = new_payment(rt)
    relay_outbox.run_once(rt)
    assert row(rt, payment_id)["status"] == "Unknown"
    sandbox.faults()

    make_due(rt, payment_id)
    query_unresolved.run_once(rt)
    (charge,) = calls(rt, payment_id, "charge")
    p = row(rt, payment_id)
    assert pending_charge_requests(rt, payment_id) == 0, "within the grace a NotFound may be a charge not visible yet"
    grace = timedelta(seconds=rt.settings.query_not_found_grace_seconds)
    assert rt.settings.query_not_found_grace_seconds == 60
    assert p["status"] == "Unknown" and p["next_query_at"] >= charge["started_at"] + grace

    with rt.engine.begin() as conn:  # the grace has passed since the last send
        conn.execute(
            update(provider_call)
            .where(provider_call.c.id == charge["id"])
            .values(started_at=utcnow() - grace * 2, finished_at=utcnow() - grace * 2)
        )
    make_due(rt, payment_id)
    query_unresolved.run_once(rt)
    assert pending_charge_requests(rt, payment_id) == 1, "now it is believed: sent again with the same key"
    relay_outbox.run_once(rt)
    assert row(rt, payment_id)["status"] == "Succeeded"
    assert sandbox.charge_count(payment_id) == 1


def test_a_not_found_right_after_a_long_call_ended_is_not_believed_until_the_grace_from_its_end(mariadb):
    # The request went out two grace periods ago and hung until its timeout just now: it may have reached the
    # provider at any moment of that, so the grace counts from the call's end, not from when it was prepared.
    fake = FakeProvider(Capabilities(dedupe=Dedupe.KEY, query_by_merchant_id=True), charges=[Unknown("timeout")])
    rt = with_provider(runtime_for(mariadb), fake)
    grace = timedelta(seconds=rt.settings.query_not_found_grace_seconds)

    def hang(request, key):
        with rt.engine.begin() as conn:
            conn.execute(
                update(provider_call)
                .where(provider_call.c.payment_id == request.payment_id)
                .values(started_at=utcnow() - grace * 2)
            )

    fake.on_charge = hang
    payment_id = new_payment(rt, provider="fake")
    relay_outbox.run_once(rt)
    (charge,) = calls(rt, payment_id, "charge")
    assert row(rt, payment_id)["status"] == "Unknown"
    assert charge["started_at"] + grace < utcnow() < charge["finished_at"] + grace

    make_due(rt, payment_id)
    query_unresolved.run_once(rt)  # NotFound
    assert pending_charge_requests(rt, payment_id) == 0, "the request may have reached the provider moments ago"
    assert row(rt, payment_id)["next_query_at"] >= charge["finished_at"] + grace

    with rt.engine.begin() as conn:  # the grace has passed since the call ended
        conn.execute(
            update(provider_call).where(provider_call.c.id == charge["id"]).values(finished_at=utcnow() - grace)
        )
    make_due(rt, payment_id)
    query_unresolved.run_once(rt)
    assert pending_charge_requests(rt, payment_id) == 1, "now it is believed: sent again with the same key"
    assert len(fake.queries) == 2


def _as_rate_limited(rt, call_id):
    """Record a call as answered 429, as a rate-limited provider answers (the sandbox's faults have no 429)."""
    with rt.engine.begin() as conn:
        conn.execute(update(provider_call).where(provider_call.c.id == call_id).values(http_status=429))


def test_a_send_turned_away_with_a_429_starts_no_grace(sandbox_runtime, sandbox):
    rt = sandbox_runtime
    sandbox.faults(error_5xx_rate=1.0)
    payment_id = new_payment(rt)
    relay_outbox.run_once(rt)
    (charge,) = calls(rt, payment_id, "charge")
    _as_rate_limited(rt, charge["id"])
    sandbox.faults()

    make_due(rt, payment_id)
    query_unresolved.run_once(rt)
    assert rt.settings.query_not_found_grace_seconds == 60
    assert pending_charge_requests(rt, payment_id) == 1, "a 429 did nothing at the provider: believed at once"
    relay_outbox.run_once(rt)
    assert row(rt, payment_id)["status"] == "Succeeded"
    assert sandbox.charge_count(payment_id) == 1


def test_a_429_after_an_ambiguous_send_leaves_that_sends_grace_in_force(sandbox_runtime, sandbox):
    rt = sandbox_runtime
    sandbox.faults(error_5xx_rate=1.0)  # a 503: as ambiguous as a timeout
    payment_id = new_payment(rt)
    relay_outbox.run_once(rt)
    (first,) = calls(rt, payment_id, "charge")
    sandbox.faults()
    with rt.engine.begin() as conn:  # a later send of the same charge, turned away with a 429
        later = {k: v for k, v in first.items() if k not in ("id", "started_at")}
        conn.execute(provider_call.insert().values(**later, started_at=utcnow()))
        conn.execute(
            update(provider_call).where(provider_call.c.id > first["id"], provider_call.c.payment_id == payment_id)
            .values(http_status=429)
        )  # fmt: skip

    make_due(rt, payment_id)
    query_unresolved.run_once(rt)
    assert pending_charge_requests(rt, payment_id) == 0, "the 503'd send may still be in flight"
    grace = timedelta(seconds=rt.settings.query_not_found_grace_seconds)
    assert row(rt, payment_id)["next_query_at"] >= first["started_at"] + grace


def test_on_a_resend_a_refusal_is_unknown_and_only_the_first_attempts_decline_is_failed(mariadb):
    # Dedupes by our number: the re-send of a charge it did make is refused as a duplicate (a 4xx).
    refused = Failed("duplicate_merchant_transaction_id", definitive=True, refusal=True)
    fake = FakeProvider(
        Capabilities(dedupe=Dedupe.MERCHANT_ID, query_by_merchant_id=True),
        charges=[Unknown("timeout"), refused],
        queries=[NotFound(), Succeeded("ch_1")],
    )
    rt = with_provider(runtime_for(mariadb, query_not_found_grace_seconds=0), fake)
    payment_id = new_payment(rt, provider="fake")
    relay_outbox.run_once(rt)  # timed out, but the provider charged
    make_due(rt, payment_id)
    query_unresolved.run_once(rt)  # not visible yet: NotFound, re-sent
    relay_outbox.run_once(rt)
    assert len(fake.charges) == 2
    p = row(rt, payment_id)
    assert p["status"] == "Unknown", "the refusal of a re-send says nothing definitive about the first send"
    assert p["next_query_at"] is not None and reviews(rt, payment_id) == []
    assert "PaymentFailed" not in domain_events(rt, payment_id)

    make_due(rt, payment_id)
    query_unresolved.run_once(rt)
    assert row(rt, payment_id)["status"] == "Succeeded"
    assert domain_events(rt, payment_id) == ["PaymentUnknown", "PaymentSucceeded"]


def test_a_refusal_of_the_first_attempt_is_a_decline(mariadb):
    fake = FakeProvider(
        Capabilities(dedupe=Dedupe.MERCHANT_ID, query_by_merchant_id=True),
        charges=[Failed("invalid_currency", definitive=True, refusal=True)],
    )
    rt = with_provider(runtime_for(mariadb), fake)
    payment_id = new_payment(rt, provider="fake")
    relay_outbox.run_once(rt)
    p = row(rt, payment_id)
    assert (p["status"], p["error_code"]) == ("Failed", "invalid_currency")


def test_a_charge_refused_for_our_credentials_is_sent_again_even_where_the_provider_does_not_dedupe(mariadb):
    # 401: the provider refused the request itself; nothing was charged, so the retry is as good as a first send.
    fake = queried_not_deduped(charges=[Failed("unauthorized", definitive=False), Succeeded("ch_1")])
    # A backoff longer than the pass, so the first run_once cannot send it again itself (0.01 s raced the drain's poll).
    rt = with_provider(runtime_for(mariadb, retry_base_seconds=30, retry_max_seconds=60), fake)
    payment_id = new_payment(rt, provider="fake")
    relay_outbox.run_once(rt)
    assert row(rt, payment_id)["status"] == "Pending"
    expire_leases(rt)  # past the retry backoff
    relay_outbox.run_once(rt)
    assert len(fake.charges) == 2
    assert row(rt, payment_id)["status"] == "Succeeded"


def _outlive_key(rt, payment_id):
    """The payment was created longer ago than its provider keeps an idempotency key (its deadline still ahead)."""
    lifetime = timedelta(seconds=rt.settings.provider_key_lifetime_seconds)
    grace = timedelta(seconds=rt.settings.query_not_found_grace_seconds)
    now = utcnow()
    with rt.engine.begin() as conn:
        conn.execute(
            update(payment)
            .where(payment.c.payment_id == payment_id)
            .values(created_at=now - lifetime - timedelta(minutes=1), deadline_at=now + timedelta(hours=1))
        )
        conn.execute(  # and its last send ended well before this query
            update(provider_call)
            .where(provider_call.c.payment_id == payment_id)
            .values(started_at=now - 2 * grace, finished_at=now - 2 * grace)
        )


def keyed_fake(**scripts) -> FakeProvider:
    """Dedupes by idempotency key (as Stripe does, for about 24 hours) and can be looked up by our number."""
    return FakeProvider(Capabilities(dedupe=Dedupe.KEY, query_by_merchant_id=True), **scripts)


def test_past_the_keys_lifetime_a_not_found_goes_to_review_and_is_never_sent_again(mariadb):
    fake = keyed_fake(charges=[Unknown("timeout")])
    rt = with_provider(runtime_for(mariadb), fake)
    assert rt.settings.provider_key_lifetime_seconds == 23 * 3600
    payment_id = new_payment(rt, provider="fake")
    relay_outbox.run_once(rt)
    assert row(rt, payment_id)["status"] == "Unknown"
    _outlive_key(rt, payment_id)

    make_due(rt, payment_id)
    query_unresolved.run_once(rt)  # NotFound, past the grace: a re-send would be believed, were the key alive
    assert pending_charge_requests(rt, payment_id) == 0, "the provider may have forgotten the key: no re-send"
    assert reviews(rt, payment_id) == ["unresolved_not_resendable"]
    p = row(rt, payment_id)
    assert p["status"] == "Unknown" and p["next_query_at"] is not None, "still queried until its deadline"
    expire_leases(rt)
    relay_outbox.run_once(rt)
    assert len(fake.charges) == 1

    make_due(rt, payment_id)
    query_unresolved.run_once(rt)  # NotFound again: the one review stays the one review
    assert reviews(rt, payment_id) == ["unresolved_not_resendable"]
    fake.query_script = [Succeeded("ch_1")]
    make_due(rt, payment_id)
    query_unresolved.run_once(rt)  # a query that finds it settles it
    assert row(rt, payment_id)["status"] == "Succeeded" and len(fake.charges) == 1


def test_a_resend_queued_before_the_keys_lifetime_ran_out_is_queried_after_it_not_sent(mariadb):
    fake = keyed_fake(charges=[Unknown("timeout")])
    rt = with_provider(runtime_for(mariadb, query_not_found_grace_seconds=0), fake)
    payment_id = new_payment(rt, provider="fake")
    relay_outbox.run_once(rt)
    make_due(rt, payment_id)
    query_unresolved.run_once(rt)  # NotFound, believed: a re-send under the same key is queued …
    assert pending_charge_requests(rt, payment_id) == 1
    _outlive_key(rt, payment_id)  # … and relayed only once the key may be forgotten

    relay_outbox.run_once(rt)
    assert len(fake.charges) == 1, "not re-sent: the same key could be a second charge now"
    p = row(rt, payment_id)
    assert p["status"] == "Unknown" and p["next_query_at"] is not None, "queried instead"
    assert pending_charge_requests(rt, payment_id) == 0 and reviews(rt, payment_id) == []
    make_due(rt, payment_id)
    query_unresolved.run_once(rt)  # the query cannot settle it: a person does
    assert reviews(rt, payment_id) == ["unresolved_not_resendable"] and len(fake.charges) == 1
