"""Refunds on MariaDB: POST /payments/<id>/refunds, its limit under concurrency, relay and query with the sandbox.

The API half drives the Flask app (validation, auth, Idempotency-Key
semantics, the refundable amount, one transaction); the concurrency test
races real threads on real row locks; the rest sends refunds to the real
sandbox platform through relay_outbox and resolves the ones whose outcome was
lost through query_unresolved, with faults switched on.
"""

# ruff: noqa: F811 - pytest fixtures imported from tests.sandbox_process and tests.outbound_support
from __future__ import annotations

import json
import threading
from dataclasses import replace

import pytest
from sqlalchemy import func, select, update

from compensator import query_unresolved, relay_outbox
from gateway import create_app
from payments.inbound.callbacks import CallbackResult, process_callback, store_callback
from payments.infra.db import utcnow
from payments.infra.schema import (
    idempotency_request,
    ledger_event,
    manual_review,
    outbox,
    payment,
    provider_call,
    refund,
)
from payments.money import ledger
from payments.outbound.charges import CreatePayment, create_payment
from payments.outbound.idempotency import InvalidRequest
from payments.outbound.refunds import create_refund, digest
from payments.providers.base import RefundRequest, Succeeded
from tests.outbound_support import new_payment, row, runtime  # noqa: F401
from tests.support import make_settings, sandbox_event, signed

TOKEN = "test-merchant-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

pytestmark = pytest.mark.mariadb


class NoPublisher:
    state = "disabled"
    enabled = False

    def publish(self, log_id, body):
        return False


@pytest.fixture
def client(mariadb):
    settings = make_settings(
        database_url=mariadb.url.render_as_string(hide_password=False),
        merchant_api_token=(TOKEN,),
        callback_process_inline=False,
    )
    return create_app(settings, engine=mariadb, publisher=NoPublisher()).test_client()


def succeeded_payment(engine, amount=1000, status="Succeeded"):
    """A payment made through POST /payments' code, then marked as the provider confirmed it."""
    key = f"pay-key-{utcnow().timestamp()}-{threading.get_ident()}-{amount}"
    answer = create_payment(engine, CreatePayment(f"o-{key}", amount, "CNY", "sandbox", None), key,
                            deadline_seconds=3600, lock_seconds=60)  # fmt: skip
    payment_id = json.loads(answer.body)["payment_id"]
    with engine.begin() as conn:
        conn.execute(
            update(payment)
            .where(payment.c.payment_id == payment_id)
            .values(status=status, provider_transaction_id=f"ch_{payment_id}")
        )
    return payment_id


def post_refund(client, payment_id, data, key="rk-1", headers=None):
    h = dict(AUTH)
    if key is not None:
        h["Idempotency-Key"] = key
    h.update(headers or {})
    raw = data if isinstance(data, (bytes, str)) else json.dumps(data)
    return client.post(f"/payments/{payment_id}/refunds", data=raw, headers=h, content_type="application/json")


def counts(engine):
    with engine.connect() as conn:
        return tuple(
            conn.execute(select(func.count()).select_from(t)).scalar()
            for t in (refund, outbox, ledger_event, idempotency_request)
        )


def test_a_refund_is_created_with_its_outbox_row_and_ledger_event_in_one_go(client, mariadb):
    payment_id = succeeded_payment(mariadb)
    before = counts(mariadb)
    response = post_refund(client, payment_id, {"amount": 300, "reason": "damaged"})
    assert response.status_code == 201, response.get_json()
    created = response.get_json()
    assert created["refund_id"].startswith("re_")
    assert (created["status"], created["amount"], created["currency"], created["reason"]) == (
        "Created",
        300,
        "CNY",
        "damaged",
    )
    assert counts(mariadb) == tuple(n + 1 for n in before)
    with mariadb.connect() as conn:
        r = conn.execute(select(refund)).mappings().one()
        assert r["idempotency_key"] == f"refund-{r['refund_id']}", "the provider key is ours, fixed for life"
        assert r["deadline_at"] > r["created_at"]
        (command,) = conn.execute(select(outbox).where(outbox.c.event_type == "RefundRequested")).mappings()
        assert json.loads(command["payload"])["refund_id"] == r["refund_id"]
        (event,) = conn.execute(select(ledger_event).where(ledger_event.c.refund_id == r["refund_id"])).mappings()
        assert (event["event_type"], event["amount_minor"], event["payment_id"]) == ("RefundRequested", 300, payment_id)

    shown = client.get(f"/payments/{payment_id}", headers=AUTH).get_json()
    assert [x["refund_id"] for x in shown["refunds"]] == [created["refund_id"]]
    assert (shown["amount_refunded"], shown["amount_refundable"]) == (0, 700), "in flight holds the money back"
    one = client.get(f"/payments/{payment_id}/refunds/{created['refund_id']}", headers=AUTH)
    assert one.status_code == 200
    assert one.get_json()["ledger"][0]["event_type"] == "RefundRequested"
    assert client.get(f"/payments/{payment_id}/refunds/re_nope", headers=AUTH).status_code == 404
    other = succeeded_payment(mariadb)
    assert client.get(f"/payments/{other}/refunds/{created['refund_id']}", headers=AUTH).status_code == 404


def test_partial_refunds_add_up_to_the_amount_and_not_one_minor_unit_more(client, mariadb):
    payment_id = succeeded_payment(mariadb, amount=1000)
    assert post_refund(client, payment_id, {"amount": 400}, key="a").status_code == 201
    assert post_refund(client, payment_id, {"amount": 599}, key="b").status_code == 201
    over = post_refund(client, payment_id, {"amount": 2}, key="c")
    assert over.status_code == 422
    assert over.get_json()["error"]["code"] == "amount_exceeds_refundable"
    assert "1 of 1000" in over.get_json()["error"]["message"]
    assert post_refund(client, payment_id, {"amount": 1}, key="d").status_code == 201
    before = counts(mariadb)
    assert post_refund(client, payment_id, {"amount": 1}, key="e").status_code == 422
    assert counts(mariadb) == before, "a refusal writes nothing and frees the key"


def test_a_failed_refund_gives_its_amount_back_to_the_refundable(client, mariadb):
    payment_id = succeeded_payment(mariadb, amount=1000)
    first = post_refund(client, payment_id, {"amount": 1000}, key="a").get_json()
    assert post_refund(client, payment_id, {"amount": 1}, key="b").status_code == 422
    with mariadb.begin() as conn:
        conn.execute(update(refund).where(refund.c.refund_id == first["refund_id"]).values(status="Failed"))
    assert post_refund(client, payment_id, {"amount": 1000}, key="b").status_code == 201, "the key was not burnt"


@pytest.mark.parametrize("status", ["Created", "Pending", "Unknown", "Failed"])
def test_only_a_succeeded_payment_can_be_refunded(client, mariadb, status):
    payment_id = succeeded_payment(mariadb, status=status)
    before = counts(mariadb)
    response = post_refund(client, payment_id, {"amount": 1})
    assert response.status_code == 409
    assert response.get_json()["error"]["code"] == "payment_not_succeeded"
    assert status in response.get_json()["error"]["message"]
    assert counts(mariadb) == before


def test_an_unknown_payment_is_404_and_writes_nothing(client, mariadb):
    before = counts(mariadb)
    response = post_refund(client, "pay_nope", {"amount": 1})
    assert (response.status_code, response.get_json()["error"]["code"]) == (404, "not_found")
    assert post_refund(client, "p" * 300, {"amount": 1}).status_code == 404
    assert counts(mariadb) == before


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b"not json", "invalid_json"),
        ([1], "invalid_json"),
        ({}, "invalid_amount"),
        ({"amount": 0}, "invalid_amount"),
        ({"amount": -5}, "invalid_amount"),
        ({"amount": 10.5}, "invalid_amount"),
        ({"amount": "10"}, "invalid_amount"),
        ({"amount": True}, "invalid_amount"),
        (b'{"amount": NaN}', "invalid_request"),
        ({"amount": 1, "reason": 7}, "invalid_request"),
        ({"amount": 1, "reason": "x" * 501}, "invalid_request"),
        ({"amount": 1, "currency": "CNY"}, "invalid_request"),
    ],
)
def test_a_bad_body_is_a_clear_400_and_writes_nothing(client, mariadb, data, code):
    payment_id = succeeded_payment(mariadb)
    before = counts(mariadb)
    response = post_refund(client, payment_id, data)
    assert response.status_code == 400, response.get_json()
    assert response.get_json()["error"]["code"] == code
    assert counts(mariadb) == before


def test_key_token_and_content_type_are_required(client, mariadb):
    payment_id = succeeded_payment(mariadb)
    assert post_refund(client, payment_id, {"amount": 1}, key=None).get_json()["error"]["code"] == (
        "idempotency_key_missing"
    )
    no_auth = client.post(f"/payments/{payment_id}/refunds", json={"amount": 1}, headers={"Idempotency-Key": "k"})
    assert no_auth.status_code == 401
    text = client.post(
        f"/payments/{payment_id}/refunds",
        data="amount=1",
        headers={**AUTH, "Idempotency-Key": "k"},
        content_type="text/plain",
    )
    assert text.status_code == 415


def test_the_same_key_replays_the_first_answer_another_body_is_422_in_flight_is_409(client, mariadb):
    payment_id = succeeded_payment(mariadb)
    first = post_refund(client, payment_id, {"amount": 100, "reason": "r"}, key="same")
    again = post_refund(client, payment_id, {"reason": "r", "amount": 100}, key="same")
    assert first.status_code == again.status_code == 201
    assert again.data == first.data and again.headers["Idempotent-Replayed"] == "true"
    with mariadb.connect() as conn:
        assert conn.execute(select(func.count()).select_from(refund)).scalar() == 1

    other = post_refund(client, payment_id, {"amount": 101, "reason": "r"}, key="same")
    assert (other.status_code, other.get_json()["error"]["code"]) == (422, "idempotency_key_reuse")
    elsewhere = post_refund(client, succeeded_payment(mariadb), {"amount": 100, "reason": "r"}, key="same")
    assert elsewhere.status_code == 422, "the key is the merchant's, whatever payment it names"

    # A payment key and a refund key live apart: the same string may name one of each.
    pay = client.post(
        "/payments",
        json={"order_no": "o", "amount": 5, "currency": "CNY", "provider": "sandbox"},
        headers={**AUTH, "Idempotency-Key": "same"},
    )
    assert pay.status_code == 201

    now = utcnow()
    with mariadb.begin() as conn:
        conn.execute(
            idempotency_request.insert().values(
                scope="refunds",
                idempotency_key="busy",
                request_digest=digest(payment_id, 5, None),
                status="started",
                locked_at=now,
                created_at=now,
                updated_at=now,
            )
        )
    busy = post_refund(client, payment_id, {"amount": 5}, key="busy")
    assert (busy.status_code, busy.get_json()["error"]["code"]) == (409, "request_in_progress")


def test_two_concurrent_refunds_that_together_exceed_the_amount_exactly_one_is_refused(mariadb):
    for attempt in range(8):
        payment_id = succeeded_payment(mariadb, amount=1000)
        barrier = threading.Barrier(2)
        outcomes: list[object] = []

        def one(n, payment_id=payment_id, barrier=barrier, outcomes=outcomes, attempt=attempt):
            barrier.wait()
            try:
                outcomes.append(
                    create_refund(
                        mariadb, payment_id, 600, None, f"race-{attempt}-{n}", deadline_seconds=3600, lock_seconds=60
                    ).status
                )
            except InvalidRequest as exc:
                outcomes.append((exc.http_status, exc.code))

        threads = [threading.Thread(target=one, args=(n,)) for n in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(outcomes, key=str) == sorted([201, (422, "amount_exceeds_refundable")], key=str), outcomes
        with mariadb.connect() as conn:
            total = conn.execute(
                select(func.sum(refund.c.amount_minor)).where(refund.c.payment_id == payment_id)
            ).scalar()
        assert total == 600


def test_many_concurrent_small_refunds_never_exceed_the_amount(mariadb):
    payment_id = succeeded_payment(mariadb, amount=1000)
    barrier = threading.Barrier(8)
    granted = []

    def one(n):
        barrier.wait()
        for i in range(5):
            try:
                create_refund(mariadb, payment_id, 70, None, f"small-{n}-{i}", deadline_seconds=3600, lock_seconds=60)
                granted.append(70)
            except InvalidRequest as exc:
                assert exc.code == "amount_exceeds_refundable"

    threads = [threading.Thread(target=one, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(granted) == 980, "fourteen refunds of 70 fit in 1000, and no more"


# --- through the relay, against the sandbox platform --------------------------------------------------------------


def charged(rt, amount=1000):
    """A payment the sandbox really charged: created, relayed, Succeeded."""
    payment_id = new_payment(rt, amount=amount)
    relay_outbox.run_once(rt)
    assert row(rt, payment_id)["status"] == "Succeeded"
    return payment_id


def request_refund(rt, payment_id, amount, key=None):
    answer = create_refund(
        rt.engine,
        payment_id,
        amount,
        "test",
        key or f"rk-{payment_id}-{amount}-{utcnow().timestamp()}",
        deadline_seconds=rt.settings.refund_deadline_seconds,
        lock_seconds=60,
    )
    return json.loads(answer.body)["refund_id"]


def refund_row(rt, refund_id):
    with rt.engine.connect() as conn:
        return conn.execute(select(refund).where(refund.c.refund_id == refund_id)).mappings().one()


def refund_calls(rt, refund_id):
    with rt.engine.connect() as conn:
        q = select(provider_call).where(provider_call.c.refund_id == refund_id).order_by(provider_call.c.id)
        return conn.execute(q).mappings().all()


def refund_events(rt, refund_id):
    with rt.engine.connect() as conn:
        return list(
            conn.execute(
                select(outbox.c.event_type)
                .where(outbox.c.aggregate_id == refund_id, outbox.c.event_type != "RefundRequested")
                .order_by(outbox.c.id)
            ).scalars()
        )


def sandbox_refunds(sandbox, refund_id):
    return [r for r in sandbox.truth()["refunds"] if r["merchant_refund_id"] == refund_id]


def test_a_refund_end_to_end_with_the_sandbox_books_a_new_fact_and_leaves_the_charge_alone(runtime, sandbox):
    payment_id = charged(runtime, amount=1000)
    with runtime.engine.connect() as conn:
        charge_events = [e["event_type"] for e in ledger.history(conn, payment_id)]
    first = request_refund(runtime, payment_id, 300)
    second = request_refund(runtime, payment_id, 200)
    assert relay_outbox.run_once(runtime) == 2

    for refund_id, amount in ((first, 300), (second, 200)):
        r = refund_row(runtime, refund_id)
        (call,) = refund_calls(runtime, refund_id)
        (made,) = sandbox_refunds(sandbox, refund_id)
        assert r["status"] == "Succeeded" and r["status_source"] == f"call:{call['id']}"
        assert r["provider_refund_id"] == made["id"] and made["amount"] == amount
        assert made["charge"] == row(runtime, payment_id)["provider_transaction_id"]
        assert (call["operation"], call["idempotency_key"]) == ("refund", r["idempotency_key"])
        assert refund_events(runtime, refund_id) == ["RefundSucceeded"]

    with runtime.engine.connect() as conn:
        history = ledger.history(conn, payment_id)
        assert [e["event_type"] for e in history][: len(charge_events)] == charge_events, "the charge is untouched"
        assert [e["event_type"] for e in history].count("RefundConfirmed") == 2
        assert ledger.payment_balance(conn, payment_id) == {"CNY": 500}
        assert ledger.unbalanced_events(conn) == []
    assert relay_outbox.run_once(runtime) == 0


def test_a_refund_the_provider_declines_fails_and_frees_its_amount(runtime, sandbox):
    payment_id = charged(runtime)
    # Someone refunded most of the charge in the platform's dashboard, behind paysync's back.
    txn = row(runtime, payment_id)["provider_transaction_id"]
    behind = RefundRequest("re_dashboard", payment_id, txn, 900, "CNY")
    assert isinstance(runtime.providers["sandbox"].refund(behind, "dashboard-key", 5), Succeeded)
    refund_id = request_refund(runtime, payment_id, 1000)
    relay_outbox.run_once(runtime)
    r = refund_row(runtime, refund_id)
    assert (r["status"], r["error_code"]) == ("Failed", "amount_exceeds_refundable")
    assert refund_events(runtime, refund_id) == ["RefundFailed"]
    with runtime.engine.connect() as conn:
        assert ledger.payment_balance(conn, payment_id) == {"CNY": 1000}, "a failed refund books no money"
    assert request_refund(runtime, payment_id, 100), "the failed refund's amount is refundable again"


def test_a_refund_timing_out_at_the_provider_is_unknown_until_the_query_finds_it(runtime, sandbox):
    payment_id = charged(runtime)
    sandbox.faults(timeout_after_commit_rate=1.0, hang_seconds=1.0)
    refund_id = request_refund(runtime, payment_id, 400)
    relay_outbox.run_once(runtime)
    r = refund_row(runtime, refund_id)
    assert r["status"] == "Unknown", "a timeout is never Failed"
    assert r["next_query_at"] is not None
    assert refund_events(runtime, refund_id) == ["RefundUnknown"]
    assert len(sandbox_refunds(sandbox, refund_id)) == 1, "the platform did make it"

    sandbox.faults()
    with runtime.engine.begin() as conn:
        conn.execute(update(refund).where(refund.c.refund_id == refund_id).values(next_query_at=utcnow()))
    assert query_unresolved.run_once(runtime) == 1
    r = refund_row(runtime, refund_id)
    query_call = refund_calls(runtime, refund_id)[-1]
    assert query_call["operation"] == "query"
    assert (r["status"], r["status_source"]) == ("Succeeded", f"query:{query_call['id']}")
    assert r["provider_refund_id"] == sandbox_refunds(sandbox, refund_id)[0]["id"]
    assert refund_events(runtime, refund_id) == ["RefundUnknown", "RefundSucceeded"]
    assert len(sandbox_refunds(sandbox, refund_id)) == 1, "found, not made twice"


def test_a_refund_the_provider_never_saw_is_sent_again_under_the_same_key(runtime, sandbox):
    # No grace for a NotFound; the next query far enough away that one run_once queries once.
    settings = replace(runtime.settings, query_not_found_grace_seconds=0, query_base_seconds=30, query_max_seconds=60)
    runtime = replace(runtime, settings=settings)
    payment_id = charged(runtime)
    sandbox.faults(error_5xx_rate=1.0)
    refund_id = request_refund(runtime, payment_id, 250)
    relay_outbox.run_once(runtime)
    assert refund_row(runtime, refund_id)["status"] == "Unknown"
    assert sandbox_refunds(sandbox, refund_id) == []

    sandbox.faults()
    with runtime.engine.begin() as conn:
        conn.execute(update(refund).where(refund.c.refund_id == refund_id).values(next_query_at=utcnow()))
    assert query_unresolved.run_once(runtime) == 1  # NotFound: queued to be sent again
    relay_outbox.run_once(runtime)
    r = refund_row(runtime, refund_id)
    assert r["status"] == "Succeeded"
    keys = {c["idempotency_key"] for c in refund_calls(runtime, refund_id) if c["operation"] == "refund"}
    assert keys == {r["idempotency_key"]}
    assert len(sandbox_refunds(sandbox, refund_id)) == 1


def test_a_refund_still_unresolved_at_its_deadline_goes_to_a_person_once(runtime, sandbox):
    payment_id = charged(runtime)
    sandbox.faults(timeout_after_commit_rate=1.0, hang_seconds=1.0)
    refund_id = request_refund(runtime, payment_id, 100)
    relay_outbox.run_once(runtime)
    assert refund_row(runtime, refund_id)["status"] == "Unknown"
    with runtime.engine.begin() as conn:
        conn.execute(
            update(refund).where(refund.c.refund_id == refund_id).values(next_query_at=utcnow(), deadline_at=utcnow())
        )
    assert query_unresolved.run_once(runtime) == 1
    with runtime.engine.connect() as conn:
        (review,) = conn.execute(select(manual_review)).mappings()
    assert (review["kind"], review["subject"], review["refund_id"]) == (
        "unresolved_refund",
        f"refund:{refund_id}",
        refund_id,
    )
    assert refund_row(runtime, refund_id)["next_query_at"] is None
    assert query_unresolved.run_once(runtime) == 0, "not queried in a loop"


def test_a_refund_webhook_applies_through_the_state_machine_once(runtime, sandbox):
    payment_id = charged(runtime)
    sandbox.faults(processing_rate=1.0, processing_seconds=3600)
    refund_id = request_refund(runtime, payment_id, 300)
    relay_outbox.run_once(runtime)
    r = refund_row(runtime, refund_id)
    assert r["status"] == "Pending" and r["provider_refund_id"]
    assert r["next_query_at"] is not None, "a processing refund is looked up later if no webhook comes"

    def deliver(event_type, event_id):
        event = sandbox_event(
            payment_id,
            event_type=event_type,
            amount=300,
            event_id=event_id,
            provider_transaction_id=r["provider_refund_id"],
            merchant_refund_id=refund_id,
        )
        body, headers = signed(event)
        log_id = store_callback(runtime.engine, provider="sandbox", body=body, headers=headers, remote_addr=None)
        return log_id, process_callback(runtime.engine, runtime.providers, log_id, runtime.callback_policy)

    log_id, result = deliver("refund.succeeded", "evt_refund_1")
    assert result == CallbackResult.APPLIED
    r = refund_row(runtime, refund_id)
    assert (r["status"], r["status_source"], r["next_query_at"]) == ("Succeeded", f"callback:{log_id}", None)
    assert refund_events(runtime, refund_id) == ["RefundSucceeded"]
    assert deliver("refund.succeeded", "evt_refund_1")[1] == CallbackResult.DUPLICATE
    assert deliver("refund.failed", "evt_refund_2")[1] == CallbackResult.CONFLICT, "a terminal refund is never left"
    assert refund_row(runtime, refund_id)["status"] == "Succeeded"
    with runtime.engine.connect() as conn:
        (review,) = conn.execute(select(manual_review)).mappings()
        assert review["subject"] == f"refund:{refund_id}"
        assert [e["event_type"] for e in ledger.history(conn, payment_id)].count("RefundConfirmed") == 1
