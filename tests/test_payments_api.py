"""POST /payments and GET /payments/<id> on MariaDB: validation, auth, Idempotency-Key semantics, one transaction."""

from __future__ import annotations

import json
import threading
from datetime import timedelta

import pytest
from sqlalchemy import func, select, update

from gateway import create_app
from payments.infra.db import utcnow
from payments.infra.schema import idempotency_request, ledger_event, outbox, payment
from tests.support import make_settings

TOKEN = "test-merchant-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class NoPublisher:
    """The gateway's callback publisher is not used by the merchant API."""

    state = "disabled"
    enabled = False

    def publish(self, log_id, body):
        return False


@pytest.fixture
def app(mariadb):
    settings = make_settings(
        database_url=mariadb.url.render_as_string(hide_password=False),
        merchant_api_token=(TOKEN,),
        merchant_max_amount=1_000_000,
        callback_process_inline=False,  # the callback tests process stored rows themselves
    )
    return create_app(settings, engine=mariadb, publisher=NoPublisher())


@pytest.fixture
def client(app):
    return app.test_client()


def body(**overrides):
    data = {"order_no": "order-1", "amount": 1999, "currency": "CNY", "provider": "sandbox", "description": "tea"}
    data.update(overrides)
    return {k: v for k, v in data.items() if v is not ...}


def post(client, data, key="key-1", headers=None):
    h = dict(AUTH)
    if key is not None:
        h["Idempotency-Key"] = key
    h.update(headers or {})
    raw = data if isinstance(data, (bytes, str)) else json.dumps(data)
    return client.post("/payments", data=raw, headers=h, content_type="application/json")


def counts(engine):
    with engine.connect() as conn:
        return tuple(
            conn.execute(select(func.count()).select_from(t)).scalar()
            for t in (payment, outbox, ledger_event, idempotency_request)
        )


@pytest.mark.mariadb
def test_a_payment_is_created_with_its_outbox_row_and_ledger_event_in_one_go(client, mariadb):
    response = post(client, body())
    assert response.status_code == 201
    created = response.get_json()
    assert created["payment_id"].startswith("pay_")
    assert (created["status"], created["amount"], created["currency"]) == ("Created", 1999, "CNY")
    with mariadb.connect() as conn:
        row = conn.execute(select(payment)).mappings().one()
        assert row["idempotency_key"] == "key-1" and len(row["request_digest"]) == 64
        assert row["deadline_at"] > row["created_at"]
        box = conn.execute(select(outbox)).mappings().one()
        assert (box["event_type"], box["aggregate_id"]) == ("ChargeRequested", created["payment_id"])
        events = conn.execute(select(ledger_event.c.event_type, ledger_event.c.payment_id)).all()
        assert events == [("PaymentRequested", created["payment_id"])]


@pytest.mark.mariadb
def test_the_same_key_and_body_replays_the_first_answer(client, mariadb):
    first = post(client, body())
    again = post(client, json.dumps(dict(reversed(list(body().items())))))  # key order does not matter
    assert again.status_code == 201
    assert again.data == first.data
    assert again.headers["Idempotent-Replayed"] == "true"
    assert counts(mariadb)[:3] == (1, 1, 1)


@pytest.mark.mariadb
def test_the_same_key_with_another_body_is_refused_with_422(client, mariadb):
    post(client, body())
    response = post(client, body(amount=2000))
    assert response.status_code == 422
    assert response.get_json()["error"]["code"] == "idempotency_key_reuse"
    assert counts(mariadb)[:3] == (1, 1, 1)


@pytest.mark.mariadb
def test_the_same_key_while_the_first_request_is_in_flight_gets_409(client, mariadb):
    # A first request that claimed the key and has not committed its payment yet looks exactly like this row.
    from payments.outbound.charges import CreatePayment

    request = CreatePayment("order-1", 1999, "CNY", "sandbox", "tea")
    now = utcnow()
    with mariadb.begin() as conn:
        conn.execute(
            idempotency_request.insert().values(
                scope="payments",
                idempotency_key="key-1",
                request_digest=request.digest(),
                status="started",
                locked_at=now,
                created_at=now,
                updated_at=now,
            )
        )
    response = post(client, body())
    assert response.status_code == 409
    assert response.get_json()["error"]["code"] == "request_in_progress"
    assert counts(mariadb)[:3] == (0, 0, 0)

    # Once the first request's lock is older than the lock timeout (it died), a retry takes over.
    with mariadb.begin() as conn:
        conn.execute(update(idempotency_request).values(locked_at=now - timedelta(seconds=3600)))
    assert post(client, body()).status_code == 201
    assert counts(mariadb)[:3] == (1, 1, 1)


@pytest.mark.mariadb
def test_twenty_concurrent_identical_requests_make_one_payment(app, mariadb):
    barrier = threading.Barrier(20)
    answers = []
    lock = threading.Lock()

    def one():
        client = app.test_client()
        barrier.wait()
        response = post(client, body(), key="concurrent-key")
        with lock:
            answers.append((response.status_code, response.data))

    threads = [threading.Thread(target=one) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(answers) == 20
    assert {status for status, _ in answers} <= {201, 409}
    created = {data for status, data in answers if status == 201}
    assert len(created) == 1, "every 201 is the same first answer"
    assert counts(mariadb) == (1, 1, 1, 1)
    # After the dust settles, a retry gets that payment.
    assert post(app.test_client(), body(), key="concurrent-key").data == created.pop()


@pytest.mark.mariadb
@pytest.mark.parametrize(
    ("data", "code"),
    [
        (body(amount=19.99), "invalid_amount"),
        (body(amount=1999.5), "invalid_amount"),
        (body(amount=0), "invalid_amount"),
        (body(amount=-5), "invalid_amount"),
        (body(amount=True), "invalid_amount"),
        (body(amount="1999"), "invalid_amount"),
        (body(amount=None), "invalid_amount"),
        (body(amount=1_000_001), "amount_too_large"),
        (body(amount=10**30), "amount_too_large"),
        (body(currency="cny"), "invalid_currency"),
        (body(currency="XXX"), "invalid_currency"),
        (body(currency=840), "invalid_currency"),
        (body(provider="paypal"), "unknown_provider"),
        (body(order_no=""), "invalid_request"),
        (body(order_no="x" * 65), "invalid_request"),
        # Blank in both regex dialects (the OpenAPI pattern's and Python's): U+001C and U+FEFF differ between them.
        (body(order_no=" \t\x1c\u3000"), "invalid_request"),
        (body(order_no="\ufeff"), "invalid_request"),
        (body(description=5), "invalid_request"),
        (body(extra="field"), "invalid_request"),
        (body(order_no=...), "invalid_request"),
        ("{not json", "invalid_json"),
        ("[1, 2]", "invalid_json"),
        ('{"order_no": "o", "amount": NaN, "currency": "CNY", "provider": "sandbox"}', "invalid_request"),
    ],
)
def test_bad_input_is_a_400_and_writes_nothing(client, mariadb, data, code):
    response = post(client, data)
    assert response.status_code == 400
    assert response.get_json()["error"]["code"] == code
    assert counts(mariadb) == (0, 0, 0, 0)


@pytest.mark.mariadb
def test_a_missing_idempotency_key_is_a_400(client, mariadb):
    response = post(client, body(), key=None)
    assert response.status_code == 400
    assert response.get_json()["error"]["code"] == "idempotency_key_missing"
    assert counts(mariadb) == (0, 0, 0, 0)


@pytest.mark.mariadb
@pytest.mark.parametrize("header", [None, "Bearer wrong-token", f"Basic {TOKEN}", TOKEN, "Bearer "])
def test_a_bad_token_is_a_401_and_writes_nothing(client, mariadb, header):
    headers = {"Idempotency-Key": "k"}
    if header is not None:
        headers["Authorization"] = header
    response = client.post("/payments", data=json.dumps(body()), headers=headers, content_type="application/json")
    assert response.status_code == 401
    assert response.get_json()["error"]["code"] == "unauthorized"
    assert client.get("/payments/pay_x", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert counts(mariadb) == (0, 0, 0, 0)


@pytest.mark.mariadb
def test_get_shows_status_ledger_and_sources(client):
    created = post(client, body()).get_json()
    response = client.get(f"/payments/{created['payment_id']}", headers=AUTH)
    assert response.status_code == 200
    shown = response.get_json()
    assert shown["status"] == "Created" and shown["provider_transaction_id"] is None
    assert [e["event_type"] for e in shown["ledger"]] == ["PaymentRequested"]
    assert shown["provider_calls"] == [] and shown["callbacks"] == []
    assert client.get("/payments/pay_nope", headers=AUTH).status_code == 404


@pytest.mark.mariadb
def test_get_lists_only_verified_callbacks_and_rejected_ones_apart_with_their_reason(app, client, mariadb):
    from payments.inbound.callbacks import process_callback, store_callback
    from payments.infra.backoff import RetryPolicy
    from tests.support import create_payment, sandbox_event, signed

    payment_id = create_payment(mariadb, amount=1999)
    other_id = create_payment(mariadb)

    def deliver(event, **sign) -> None:
        data, headers = signed(event, **sign)
        answer = client.post("/callbacks/sandbox", data=data, headers=headers)
        assert answer.status_code in (200, 401), answer.get_data(as_text=True)

    def store(data: bytes, headers: dict) -> int:  # as the gateway stores, with the unverified index
        index = app.extensions["paysync"]["providers"]["sandbox"].peek_callback(data)
        return store_callback(mariadb, provider="sandbox", body=data, headers=headers, remote_addr="x", index=index)

    # A forgery that claims our payment succeeded: stored, rejected, and not shown as what it claims.
    deliver(sandbox_event(payment_id, amount=1999, event_type="charge.failed"), secret="whsec_forged_" + "f" * 20)
    # A genuine success, processed; and a forgery about another payment, which is not ours to show.
    deliver(sandbox_event(payment_id, amount=1999))
    deliver(sandbox_event(other_id), secret="whsec_forged_" + "f" * 20)
    # Stored but not processed yet: a genuine one is listed as verified, a forged one (its rejection not yet
    # recorded) as rejected, by verifying the stored row now.
    late_body, late_headers = signed(sandbox_event(payment_id, amount=1999))
    late = store(late_body, late_headers)
    forged_body, forged_headers = signed(sandbox_event(payment_id, amount=1999), secret="whsec_forged_" + "f" * 20)
    unmarked = store(forged_body, forged_headers)
    with mariadb.connect() as conn:
        genuine = conn.exec_driver_sql("SELECT id FROM payment_callback_log WHERE status = 0 ORDER BY id").scalars()
        genuine = [i for i in genuine if i not in (late, unmarked)][0]
    process_callback(mariadb, app.extensions["paysync"]["providers"], genuine, RetryPolicy())

    shown = client.get(f"/payments/{payment_id}", headers=AUTH).get_json()
    assert shown["status"] == "Succeeded"
    assert [c["source"] for c in shown["callbacks"]] == [f"callback:{genuine}", f"callback:{late}"]
    assert all(c["event_type"] == "charge.succeeded" for c in shown["callbacks"])
    rejected = shown["rejected_callbacks"]
    assert len(rejected) == 2 and rejected[1]["source"] == f"callback:{unmarked}"
    assert all(r["reason"].startswith("invalid_signature") for r in rejected)
    assert all(set(r) == {"source", "reason", "received_at"} for r in rejected)  # nothing of what they claim
    assert "charge.failed" not in json.dumps(shown)
    assert client.get(f"/payments/{other_id}", headers=AUTH).get_json()["rejected_callbacks"][0]["reason"]


@pytest.mark.mariadb
def test_get_stays_small_when_thousands_of_unverified_rows_name_the_payment(app, client, mariadb):
    from sqlalchemy import insert

    from payments.inbound.callbacks import process_callback
    from payments.infra.backoff import RetryPolicy
    from payments.infra.schema import payment_callback_log
    from payments.outbound.charges import CALLBACKS_SHOWN
    from tests.support import create_payment, sandbox_event, signed

    payment_id = create_payment(mariadb, amount=1999)
    genuine_body, genuine_headers = signed(sandbox_event(payment_id, amount=1999))
    assert client.post("/callbacks/sandbox", data=genuine_body, headers=genuine_headers).status_code == 200
    with mariadb.connect() as conn:
        genuine = conn.execute(select(payment_callback_log.c.id)).scalar_one()
    process_callback(mariadb, app.extensions["paysync"]["providers"], genuine, RetryPolicy())
    # An attacker's flood naming the payment, after the genuine delivery: 4,700 refused at the gateway, and
    # 300 still unprocessed (stored but not yet verified, as when the reject could not be recorded).
    forged = sandbox_event(payment_id, amount=1999, padding="x" * 1500)
    forged_body, forged_headers = signed(forged, secret="whsec_forged_" + "f" * 20)
    now = utcnow()

    def row(status: int) -> dict:
        return {
            "provider": "sandbox",
            "callback_data": forged_body,
            "headers": json.dumps(forged_headers),
            "remote_addr": "198.51.100.7",
            "source": "webhook",
            "order_no": payment_id,
            "event_type": "charge.succeeded",
            "status": status,
            "result": "rejected: invalid_signature: no signature matches the body" if status == 3 else None,
            "retry_count": 0,
            "next_retry_at": now,
            "create_time": now,
            "update_time": now,
        }

    with mariadb.begin() as conn:
        conn.execute(insert(payment_callback_log), [row(3) for _ in range(4_700)] + [row(0) for _ in range(300)])

    answer = client.get(f"/payments/{payment_id}", headers=AUTH)
    assert answer.status_code == 200
    assert len(answer.get_data()) < 64 * 1024
    shown = answer.get_json()
    # The genuine one, not pushed out of sight by the flood.
    assert [c["source"] for c in shown["callbacks"]] == [f"callback:{genuine}"]
    assert shown["callbacks_total"] == 1
    assert len(shown["rejected_callbacks"]) == CALLBACKS_SHOWN
    assert shown["rejected_callbacks_total"] == 5_000
    assert "padding" not in answer.get_data(as_text=True)
