"""Stripe end to end on both databases: POST /callbacks/stripe, the pipeline, the relay, the query job, catch_up.

Notifications are signed by the fake platform's own signer; the fake itself
sends webhooks to a real (threaded werkzeug) gateway in the end-to-end tests.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import replace

import pytest
from sqlalchemy import func, insert, select, update

from compensator import catch_up, compensate_callbacks, query_unresolved, relay_outbox
from gateway import create_app
from payments.infra.db import utcnow
from payments.infra.schema import (
    ledger_event,
    manual_review,
    payment,
    payment_callback_log,
    processed_event,
    provider_cursor,
    refund,
)
from payments.outbound.charges import CreatePayment, create_payment
from payments.runtime import build_runtime
from payments.states import CallbackStatus
from sandbox.fakes.stripe import IdempotencyRecord
from tests.outbound_support import push_query_out, query_due_now
from tests.stripe_support import (
    NEW_SECRET,
    OLD_SECRET,
    STRANGER_SECRET,
    FakeServer,
    Served,
    charge_request,
    event,
    new_fake,
    payment_intent,
    refund_object,
    signed,
    stripe_settings,
)
from tests.support import create_payment as insert_payment


def _db_url(engine) -> str:
    return engine.url.render_as_string(hide_password=False)


@pytest.fixture
def client(engine):
    settings = stripe_settings(
        database_url=_db_url(engine),
        secrets_=(OLD_SECRET, NEW_SECRET),
        callback_process_inline=False,  # the tests process the stored rows themselves
    )
    return create_app(settings, engine=engine).test_client()


def runtime_for(engine, api_base="http://127.0.0.1:9", timeout=10.0, **overrides):
    """A runtime with Stripe at ``api_base``; ``timeout`` short only where the fake is to hold an answer."""
    settings = stripe_settings(
        api_base,
        secrets_=(OLD_SECRET, NEW_SECRET),
        database_url=_db_url(engine),
        provider_timeout_seconds=timeout,
        query_base_seconds=0.01,
        query_max_seconds=0.05,
        relay_max_seconds=10,
        **overrides,
    )
    return build_runtime(settings, engine)


def post(client, body: bytes, headers: dict):
    return client.post("/callbacks/stripe", data=body, headers=headers)


def rows(engine):
    with engine.connect() as conn:
        return conn.execute(select(payment_callback_log).order_by(payment_callback_log.c.id)).mappings().all()


def payment_row(engine, payment_id):
    with engine.connect() as conn:
        return conn.execute(select(payment).where(payment.c.payment_id == payment_id)).mappings().one()


def confirmations(engine, payment_id):
    with engine.connect() as conn:
        return conn.execute(
            select(func.count()).where(
                ledger_event.c.payment_id == payment_id, ledger_event.c.event_type == "PaymentConfirmed"
            )
        ).scalar()


def stripe_payment(engine, amount=1000, currency="USD", status="Pending"):
    return insert_payment(engine, provider="stripe", amount=amount, currency=currency, status=status)


# --------------------------------------------------------------------------------------------- notifications


def test_a_valid_notification_is_acknowledged_and_applied_once_and_its_redelivery_is_a_duplicate(engine, client):
    payment_id = stripe_payment(engine, amount=1999)
    pi = payment_intent(payment_id, amount=1999)
    evt = event("payment_intent.succeeded", pi)
    answer = post(client, *signed(evt))
    assert (answer.status_code, answer.get_json()) == (200, {"received": True})
    # Stripe retries the same event (same id) with a fresh signature when it did not hear our 2xx.
    assert post(client, *signed(evt, timestamp=time.time() + 5)).status_code == 200

    assert compensate_callbacks.run_once(runtime_for(engine)) == 2
    p = payment_row(engine, payment_id)
    assert (p["status"], p["provider_transaction_id"]) == ("Succeeded", pi["id"])
    stored = rows(engine)
    assert [r["status"] for r in stored] == [CallbackStatus.PROCESSED, CallbackStatus.PROCESSED]
    assert all(r["provider_event_id"] == evt["id"] and r["source"] == "webhook" for r in stored)
    # The sweep works rows side by side, so either delivery may be the one applied: one is, the other a duplicate.
    assert sorted(r["result"].split(":")[0] for r in stored) == ["applied", "duplicate"]
    assert confirmations(engine, payment_id) == 1


def test_a_zero_decimal_notification_matches_a_yen_payment(engine, client):
    payment_id = stripe_payment(engine, amount=500, currency="JPY")
    post(client, *signed(event("payment_intent.succeeded", payment_intent(payment_id, amount=500, currency="jpy"))))
    compensate_callbacks.run_once(runtime_for(engine))
    assert payment_row(engine, payment_id)["status"] == "Succeeded"


def test_a_success_that_received_less_than_we_charged_is_a_conflict_for_review_never_succeeded(engine, client):
    payment_id = stripe_payment(engine, amount=1000)
    pi = payment_intent(payment_id, amount=1000, amount_received=400)  # captured in part
    post(client, *signed(event("payment_intent.succeeded", pi)))
    compensate_callbacks.run_once(runtime_for(engine))

    assert payment_row(engine, payment_id)["status"] == "Pending"
    assert confirmations(engine, payment_id) == 0
    with engine.connect() as conn:
        reviews = conn.execute(select(manual_review).where(manual_review.c.payment_id == payment_id)).mappings().all()
    assert [r["kind"] for r in reviews] == ["conflicting_report"] and "400 USD" in reviews[0]["reason"]


def test_a_webhook_signed_ahead_of_our_clock_is_applied(engine, client):
    # Our clock 10 minutes behind Stripe's: Stripe's libraries accept it, and so must we, or every webhook is refused.
    payment_id = stripe_payment(engine)
    evt = event("payment_intent.succeeded", payment_intent(payment_id, amount=1000))
    answer = post(client, *signed(evt, timestamp=time.time() + 600))
    assert answer.status_code == 200
    compensate_callbacks.run_once(runtime_for(engine))
    assert payment_row(engine, payment_id)["status"] == "Succeeded"


def _refused(payment_id):
    evt = event("payment_intent.succeeded", payment_intent(payment_id, amount=1000))
    body, headers = signed(evt)
    return [
        ("wrong key", *signed(evt, (STRANGER_SECRET,)), 401, "invalid_signature"),
        ("tampered field", body.replace(b'"amount": 1000', b'"amount": 1'), headers, 401, "invalid_signature"),
        ("stale timestamp", *signed(evt, timestamp=time.time() - 301), 401, "stale_timestamp"),
        ("missing header", body, {"Content-Type": "application/json"}, 401, "invalid_signature"),
        ("malformed body", *signed(b'{"id": "evt_1", "object": "event", '), 400, "malformed_callback"),
        ("not an event", *signed(json.dumps({"object": "list", "data": []}).encode()), 400, "malformed_callback"),
    ]


@pytest.mark.parametrize("case", range(6), ids=lambda i: _refused("pay_x")[i][0])
def test_refused_notifications_get_a_4xx_are_kept_with_status_3_and_change_nothing(engine, client, case):
    payment_id = stripe_payment(engine)
    name, body, headers, status, code = _refused(payment_id)[case]
    answer = post(client, body, headers)
    assert answer.status_code == status and answer.get_json()["error"]["code"] == code
    (row,) = rows(engine)
    assert row["status"] == CallbackStatus.REJECTED and row["result"].startswith(f"rejected: {code}")
    assert bytes(row["callback_data"]) == body, "stored byte for byte"
    compensate_callbacks.run_once(runtime_for(engine))
    assert payment_row(engine, payment_id)["status"] == "Pending"


@pytest.mark.parametrize(
    "signers", [(OLD_SECRET,), (NEW_SECRET,), (OLD_SECRET, NEW_SECRET), (STRANGER_SECRET, NEW_SECRET)]
)
def test_during_a_secret_rotation_the_old_and_the_new_secret_both_verify(engine, client, signers):
    payment_id = stripe_payment(engine)
    assert (
        post(client, *signed(event("payment_intent.succeeded", payment_intent(payment_id)), signers)).status_code == 200
    )
    compensate_callbacks.run_once(runtime_for(engine))
    assert payment_row(engine, payment_id)["status"] == "Succeeded"


def test_once_the_old_secret_is_retired_it_no_longer_verifies(engine):
    settings = stripe_settings(database_url=_db_url(engine), secrets_=(NEW_SECRET,))
    client = create_app(settings, engine=engine).test_client()
    payment_id = stripe_payment(engine)
    assert post(client, *signed(event("payment_intent.succeeded", payment_intent(payment_id)))).status_code == 401


def test_a_genuine_event_that_is_not_ours_is_acknowledged_and_recorded_as_ignored(engine, client):
    for evt in (
        event("customer.created", {"id": "cus_1", "object": "customer"}),
        event("payment_intent.succeeded", payment_intent(None)),
    ):
        assert post(client, *signed(evt)).status_code == 200
    compensate_callbacks.run_once(runtime_for(engine))
    assert [(r["status"], r["result"][:8]) for r in rows(engine)] == [(CallbackStatus.PROCESSED, "ignored:")] * 2
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(processed_event)).scalar() == 0


def test_a_failed_attempt_fails_the_payment_with_the_decline_code(engine, client):
    payment_id = stripe_payment(engine)
    pi = payment_intent(
        payment_id,
        status="requires_payment_method",
        last_payment_error={"type": "card_error", "code": "card_declined", "decline_code": "generic_decline"},
    )
    post(client, *signed(event("payment_intent.payment_failed", pi)))
    compensate_callbacks.run_once(runtime_for(engine))
    p = payment_row(engine, payment_id)
    assert (p["status"], p["error_code"]) == ("Failed", "generic_decline")


def test_refund_events_settle_our_refund_by_metadata_refund_id(engine, client):
    payment_id = stripe_payment(engine, status="Succeeded")
    refund_id = f"re_{uuid.uuid4().hex[:20]}"
    now = utcnow()
    with engine.begin() as conn:
        conn.execute(
            insert(refund).values(
                refund_id=refund_id,
                payment_id=payment_id,
                amount_minor=300,
                currency="USD",
                provider="stripe",
                status="Pending",
                query_attempts=0,
                created_at=now,
                updated_at=now,
            )
        )
    obj = refund_object(refund_id, payment_id, amount=300, status="succeeded")
    post(client, *signed(event("refund.updated", obj)))
    compensate_callbacks.run_once(runtime_for(engine))
    with engine.connect() as conn:
        r = conn.execute(select(refund).where(refund.c.refund_id == refund_id)).mappings().one()
    assert (r["status"], r["provider_refund_id"]) == ("Succeeded", obj["id"])


# --------------------------------------------------------------------------------------------- unverified → query


def test_an_unverified_notification_is_a_hint_that_leads_to_a_query_never_a_state_change(engine, client):
    """An unverified notification triggers a rate-limited query, never a state change.

    The rejected row keeps the payment it names (``order_no``, read unverified
    by ``peek_callback``); the gateway brings that payment's query forward
    (``payments.inbound.hints``) and query_unresolved asks Stripe. The forged body says
    Succeeded; Stripe says the charge was declined: the query's answer is what is applied.
    """
    served = FakeServer(new_fake())
    try:
        rt = runtime_for(engine, served.url)
        stripe = rt.providers["stripe"]
        payment_id = stripe_payment(engine)
        declined = stripe.charge(charge_request(payment_id, pm="pm_card_chargeDeclined"), "k-forged", 5)
        push_query_out(engine, payment_id)
        forged = event("payment_intent.succeeded", payment_intent(payment_id, pi_id=declined.provider_transaction_id))
        assert post(client, *signed(forged, (STRANGER_SECRET,))).status_code == 401

        (row,) = rows(engine)
        assert (row["status"], row["order_no"]) == (CallbackStatus.REJECTED, payment_id)
        compensate_callbacks.run_once(rt)
        assert payment_row(engine, payment_id)["status"] == "Pending", "the forged success changed nothing"

        # The hint brought the payment's query forward; the query job asks Stripe, whose answer is applied.
        assert query_due_now(engine, payment_id)
        assert query_unresolved.run_once(rt) == 1
        p = payment_row(engine, payment_id)
        assert (p["status"], p["error_code"]) == ("Failed", "generic_decline")
        assert p["status_source"].startswith("query:")

        # Rate-limited per payment: the second forgery for another payment within the interval moves nothing.
        other = stripe_payment(engine)
        for expected in (True, False):
            push_query_out(engine, other)
            forged = event("payment_intent.succeeded", payment_intent(other))
            assert post(client, *signed(forged, (STRANGER_SECRET,))).status_code == 401
            assert query_due_now(engine, other) is expected
    finally:
        served.close()


# --------------------------------------------------------------------------------------------- relay, query, catch_up


def new_payment(rt, payment_method="pm_card_visa", amount=1000, currency="USD"):
    key = f"key-{uuid.uuid4().hex}"
    answer = create_payment(
        rt.engine,
        CreatePayment(f"order-{key[-8:]}", amount, currency, "stripe", "tea", payment_method),
        key,
        deadline_seconds=rt.settings.payment_deadline_seconds,
        lock_seconds=60,
    )
    return json.loads(answer.body)["payment_id"]


@pytest.fixture
def platform(engine):
    """The fake Stripe, sending its webhooks to a real gateway on this test's database."""
    fake = new_fake()
    server = FakeServer(fake)
    rt = runtime_for(engine, server.url)
    gateway = Served(create_app(rt.settings, engine=engine))
    fake.config.webhook_url = gateway.url + "/callbacks/stripe"
    fake.faults.hang_seconds = 4.0
    yield fake, rt
    server.close()
    gateway.close()


def test_a_payment_is_charged_by_the_relay_and_its_webhook_is_applied_once(platform):
    fake, rt = platform
    payment_id = new_payment(rt)
    assert relay_outbox.run_once(rt) == 1
    p = payment_row(rt.engine, payment_id)
    assert p["status"] == "Succeeded" and p["provider_transaction_id"] in fake.payment_intents
    (sent,) = [r for r in fake.requests if r["method"] == "POST"]
    assert sent["idempotency_key"] == p["idempotency_key"] and sent["params"]["metadata"]["payment_id"] == payment_id

    assert fake.wait_idle(30)
    compensate_callbacks.run_once(rt)
    assert any(d["type"] == "payment_intent.succeeded" and d["status"] == 200 for d in fake.deliveries)
    assert confirmations(rt.engine, payment_id) == 1
    assert all(r["status"] == CallbackStatus.PROCESSED for r in rows(rt.engine))


def test_an_ambiguous_charge_becomes_unknown_and_the_query_job_resolves_it(platform):
    fake, rt = platform
    payment_id = new_payment(rt)
    fake.fail_next("drop_webhook", count=10)
    fake.fail_next("timeout_after_commit", path="POST /v1/payment_intents")
    relay_outbox.run_once(short(rt))
    assert payment_row(rt.engine, payment_id)["status"] == "Unknown"

    _due(rt, payment_id)
    assert query_unresolved.run_once(rt) == 1
    p = payment_row(rt.engine, payment_id)
    assert p["status"] == "Succeeded" and p["status_source"].startswith("query:")
    assert len(fake.payment_intents) == 1


def test_the_query_job_resolves_an_ambiguous_charge_on_an_account_with_10000_other_payment_intents(platform):
    fake, rt = platform
    payment_id = new_payment(rt)
    fake.fail_next("drop_webhook", count=10)
    fake.fail_next("timeout_after_commit", path="POST /v1/payment_intents")
    relay_outbox.run_once(short(rt))
    assert payment_row(rt.engine, payment_id)["status"] == "Unknown"
    fake.other_traffic(10_000)  # another integration's business, all created within the last hour
    before = len(fake.requests)

    _due(rt, payment_id)
    assert query_unresolved.run_once(rt) == 1
    p = payment_row(rt.engine, payment_id)
    assert p["status"] == "Succeeded" and p["status_source"].startswith("query:")
    assert len(fake.requests) - before == 2, "search, then the PaymentIntent itself"


def test_an_idempotency_error_is_unknown_with_a_review_and_the_query_still_resolves_it(platform):
    fake, rt = platform
    payment_id = new_payment(rt)
    key = payment_row(rt.engine, payment_id)["idempotency_key"]
    # The key was used before for another request (our bug): Stripe answers 400 idempotency_error.
    fake.idempotency[key] = IdempotencyRecord("/v1/payment_intents", {"amount": "1"}, fake.clock.now(), 200, "{}")
    relay_outbox.run_once(rt)
    assert payment_row(rt.engine, payment_id)["status"] == "Unknown"
    with rt.engine.connect() as conn:
        kinds = conn.execute(select(manual_review.c.kind).where(manual_review.c.payment_id == payment_id)).scalars()
        assert list(kinds) == ["provider_answer_needs_review"]
    _due(rt, payment_id)
    query_unresolved.run_once(rt)
    assert payment_row(rt.engine, payment_id)["status"] == "Unknown", "nothing at Stripe carries our number"


def test_a_declined_charge_fails_the_payment_and_cancels_its_payment_intent(platform):
    fake, rt = platform
    payment_id = new_payment(rt, payment_method="pm_card_chargeDeclined")
    relay_outbox.run_once(rt)
    p = payment_row(rt.engine, payment_id)
    assert (p["status"], p["error_code"]) == ("Failed", "generic_decline")
    assert fake.payment_intents[p["provider_transaction_id"]]["status"] == "canceled"
    assert fake.wait_idle(30)
    compensate_callbacks.run_once(rt)
    assert payment_row(rt.engine, payment_id)["status"] == "Failed"
    assert {r["status"] for r in rows(rt.engine)} == {CallbackStatus.PROCESSED}


def test_catch_up_fetches_a_missed_event_through_store_then_process(platform):
    fake, rt = platform
    payment_id = new_payment(rt)
    fake.fail_next("drop_webhook", count=10)
    fake.fail_next("timeout_after_commit", path="POST /v1/payment_intents")
    relay_outbox.run_once(short(rt))
    assert payment_row(rt.engine, payment_id)["status"] == "Unknown"
    assert fake.wait_idle(30) and rows(rt.engine) == [], "no webhook reached us"

    later = fake.clock.now() + 120
    assert catch_up.run_once(rt, now=later) == 1
    p = payment_row(rt.engine, payment_id)
    assert p["status"] == "Succeeded" and p["status_source"].startswith("callback:")
    (row,) = rows(rt.engine)
    assert (row["source"], row["status"], row["headers"], row["remote_addr"]) == (
        "api",
        CallbackStatus.PROCESSED,
        "{}",
        None,
    )
    assert json.loads(bytes(row["callback_data"]))["type"] == "payment_intent.succeeded"
    assert catch_up.run_once(rt, now=later + 5) == 0, "nothing new: the event is applied"
    with rt.engine.connect() as conn:
        cursor = conn.execute(select(provider_cursor.c.value)).scalar()
    assert int(cursor) == max(e["created"] for e in fake.events if e["type"] in catch_up_types())


def test_catch_up_repairs_webhooks_that_were_refused(platform, engine):
    fake, rt = platform
    first, second = new_payment(rt), new_payment(rt)
    fake.config.webhook_secrets = [STRANGER_SECRET]  # a secret paysync does not have: every webhook is refused
    fake.fail_next("timeout_after_commit", count=2, path="POST /v1/payment_intents")
    relay_outbox.run_once(short(rt))
    assert fake.wait_idle(30)
    assert {r["status"] for r in rows(engine)} == {CallbackStatus.REJECTED}
    assert {payment_row(engine, p)["status"] for p in (first, second)} == {"Unknown"}

    assert catch_up.run_once(rt, now=fake.clock.now() + 120) == 2
    assert catch_up.run_once(rt, now=fake.clock.now() + 130) == 0
    assert {payment_row(engine, p)["status"] for p in (first, second)} == {"Succeeded"}
    assert confirmations(engine, first) == confirmations(engine, second) == 1


def test_catch_up_that_cannot_list_keeps_its_cursor_and_does_nothing_without_stripe(platform, engine):
    fake, rt = platform
    fake.fail_next("5xx", path="GET /v1/events")
    assert catch_up.run_once(rt, now=time.time()) == 0
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(provider_cursor)).scalar() == 0
    without = build_runtime(replace(rt.settings, stripe_api_key="", stripe_webhook_secrets=()), engine)
    assert catch_up.run_once(without) == 0


def catch_up_types():
    from payments.providers.stripe.adapter import EVENT_TYPES

    return EVENT_TYPES


def short(rt):
    """The same runtime with a provider timeout shorter than the fake's hold (for the relay of a held charge)."""
    return runtime_for(rt.engine, rt.settings.stripe_api_base, timeout=1.5)


def _due(rt, payment_id):
    with rt.engine.begin() as conn:
        conn.execute(update(payment).where(payment.c.payment_id == payment_id).values(next_query_at=utcnow()))
