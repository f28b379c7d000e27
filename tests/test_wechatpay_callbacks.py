"""POST /callbacks/wechatpay through the real gateway: accepted once, refused with status 3 and WeChat's FAIL answer.

Notifications are built to the published format (encrypted resource, signed
``TIMESTAMP\\nNONCE\\nBODY\\n``) with the fake platform's implementation and
keys generated here. Each case runs on SQLite and MariaDB; the end-to-end
test at the bottom lets the fake platform itself place, pay and notify an
order through a served gateway on MariaDB.
"""

# ruff: noqa: F811 - pytest fixtures imported from tests.wechatpay_support
from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import dataclass

import pytest
import requests
from sqlalchemy import insert, select

from compensator import compensate_callbacks, query_unresolved, relay_outbox
from gateway import create_app
from payments.inbound.callbacks import CallbackResult, process_callback
from payments.infra.backoff import RetryPolicy
from payments.infra.db import utcnow
from payments.infra.schema import ledger_event, payment, refund
from payments.providers import build_providers
from payments.providers.base import ChargeRequest
from payments.runtime import build_runtime
from payments.states import CallbackStatus
from sandbox.fakes import wechatpay as fake
from tests.outbound_support import push_query_out, query_due_now
from tests.stack import callback_rows, db_url
from tests.support import create_payment, wait_until
from tests.wechatpay_support import (
    FakeServer,
    fake_config,
    notification,
    refund_resource,
    serve,
    transaction,
    wx_keys,  # noqa: F401 - fixture
    wx_settings,
)

POLICY = RetryPolicy(max_retries=3, base_seconds=0.01, max_seconds=0.05)


def gateway(engine, keys, **kw):  # noqa: ANN001, ANN003, ANN201
    kw.setdefault("callback_process_inline", False)  # the tests process the stored rows themselves
    settings = wx_settings(keys, database_url=db_url(engine), **kw)
    return create_app(settings, engine=engine).test_client(), build_providers(settings)


def status_of(engine, payment_id: str) -> str:  # noqa: ANN001
    with engine.connect() as conn:
        return conn.execute(select(payment.c.status).where(payment.c.payment_id == payment_id)).scalar_one()


def pending_wechat_payment(engine, amount: int = 1000) -> str:  # noqa: ANN001
    return create_payment(engine, payment_id=f"pay_{uuid.uuid4().hex[:26]}", amount=amount, provider="wechatpay")


def test_a_valid_notification_is_answered_204_and_applied_once(engine, wx_keys):
    client, providers = gateway(engine, wx_keys)
    payment_id = pending_wechat_payment(engine)
    body, headers = notification(wx_keys, transaction(payment_id))
    answer = client.post("/callbacks/wechatpay", data=body, headers=headers)
    assert answer.status_code == 204 and answer.get_data() == b""
    (row,) = callback_rows(engine)
    assert row.status == CallbackStatus.PENDING and row.order_no == payment_id  # indexed from the decrypted resource
    stored = json.loads(row.headers)
    assert {"Wechatpay-Signature", "Wechatpay-Serial", "Wechatpay-Timestamp", "Wechatpay-Nonce"} <= set(stored)
    assert process_callback(engine, providers, row.id, POLICY) == CallbackResult.APPLIED
    assert process_callback(engine, providers, row.id, POLICY) == CallbackResult.SKIPPED
    with engine.connect() as conn:
        found = conn.execute(select(payment).where(payment.c.payment_id == payment_id)).mappings().one()
        confirmed = conn.execute(
            select(ledger_event).where(
                ledger_event.c.payment_id == payment_id, ledger_event.c.event_type == "PaymentConfirmed"
            )
        ).all()
    assert found["status"] == "Succeeded" and found["provider_transaction_id"] == "4200000001202405011234567890"
    assert len(confirmed) == 1


def test_a_redelivered_notification_is_stored_acknowledged_and_deduplicated(engine, wx_keys):
    client, providers = gateway(engine, wx_keys)
    payment_id = pending_wechat_payment(engine)
    event_id = str(uuid.uuid4())
    first = notification(wx_keys, transaction(payment_id), event_id=event_id)
    again = notification(wx_keys, transaction(payment_id), event_id=event_id)  # WeChat's retry: same id, new signature
    for body, headers in (first, again, first):
        assert client.post("/callbacks/wechatpay", data=body, headers=headers).status_code == 204
    rows = callback_rows(engine)
    outcomes = [process_callback(engine, providers, row.id, POLICY) for row in rows]
    assert outcomes == [CallbackResult.APPLIED, CallbackResult.DUPLICATE, CallbackResult.DUPLICATE]
    assert status_of(engine, payment_id) == "Succeeded"
    with engine.connect() as conn:
        events = conn.execute(select(ledger_event.c.event_type).where(ledger_event.c.payment_id == payment_id)).all()
    assert [e.event_type for e in events].count("PaymentConfirmed") == 1


@dataclass(frozen=True)
class Refused:
    name: str
    body: bytes
    headers: dict
    http_status: int
    code: str


def refused_cases(keys, payment_id: str) -> list[Refused]:  # noqa: ANN001
    good = transaction(payment_id)
    cases = []

    def add(name: str, body: bytes, headers: dict, status: int, code: str) -> None:
        cases.append(Refused(name, body, headers, status, code))

    body, headers = notification(keys, good, signer=keys.stranger)
    add("wrong key", body, {**headers, "Wechatpay-Serial": keys.cert_key.key_id}, 401, "invalid_signature")
    add("unknown serial", *notification(keys, good, signer=keys.stranger), 401, "unknown_serial")
    body, headers = notification(keys, good)
    add(
        "tampered field",
        body.replace(b"TRANSACTION.SUCCESS", b"TRANSACTION.SUCCEED"),
        headers,
        401,
        "invalid_signature",
    )
    add("stale timestamp", *notification(keys, good, timestamp=time.time() - 360), 401, "stale_timestamp")
    add("future timestamp", *notification(keys, good, timestamp=time.time() + 360), 401, "stale_timestamp")
    for missing in ("Wechatpay-Signature", "Wechatpay-Serial", "Wechatpay-Timestamp", "Wechatpay-Nonce"):
        body, headers = notification(keys, good)
        del headers[missing]
        add(f"missing {missing}", body, headers, 401, "missing_header")
    body, headers = notification(keys, good)
    probe = {**headers, "Wechatpay-Signature": "WECHATPAY/SIGNTEST/" + headers["Wechatpay-Signature"][19:]}
    add("SIGNTEST probe", body, probe, 401, "probe_signature")
    malformed = b'{"id": "EV-1", "event_type": '
    headers = fake.signature_headers(keys.cert_key.key_id, keys.cert_key.private_key, malformed, time.time())
    add("malformed body", malformed, headers, 400, "malformed_callback")
    no_resource = json.dumps({"id": "EV-2", "event_type": "TRANSACTION.SUCCESS"}).encode()
    headers = fake.signature_headers(keys.cert_key.key_id, keys.cert_key.private_key, no_resource, time.time())
    add("no resource", no_resource, headers, 400, "malformed_callback")
    add(
        "another APIv3 key",
        *notification(keys, good, apiv3_key="0123456789abcdef0123456789abcdef"),
        401,
        "undecryptable_resource",
    )
    add("another merchant", *notification(keys, transaction(payment_id, mchid="1230000109")), 400, "wrong_merchant")
    add(
        "float amount",
        *notification(keys, {**good, "amount": {"total": 10.0, "currency": "CNY"}}),
        400,
        "malformed_callback",
    )
    return cases


def test_each_refused_notification_is_kept_with_status_3_and_answered_fail(engine, wx_keys):
    client, providers = gateway(engine, wx_keys)
    payment_id = pending_wechat_payment(engine)
    cases = refused_cases(wx_keys, payment_id)
    for case in cases:
        answer = client.post("/callbacks/wechatpay", data=case.body, headers=case.headers)
        assert answer.status_code == case.http_status, (case.name, answer.get_data(as_text=True))
        reply = answer.get_json()
        assert reply["code"] == "FAIL" and reply["message"].startswith(case.code), (case.name, reply)
        row = callback_rows(engine)[-1]
        assert bytes(row.callback_data) == case.body and row.status == CallbackStatus.REJECTED, case.name
        assert row.result.startswith(f"rejected: {case.code}"), (case.name, row.result)
        # Kept, never retried: processing the row again changes nothing.
        assert process_callback(engine, providers, row.id, POLICY) == CallbackResult.SKIPPED
    assert len(callback_rows(engine)) == len(cases)
    assert status_of(engine, payment_id) == "Pending"


def test_header_names_are_case_insensitive(engine, wx_keys):
    client, _ = gateway(engine, wx_keys)
    payment_id = pending_wechat_payment(engine)
    body, headers = notification(wx_keys, transaction(payment_id))
    lowered = {k.lower(): v for k, v in headers.items()}
    assert client.post("/callbacks/wechatpay", data=body, headers=lowered).status_code == 204


def test_both_platform_keys_are_accepted_during_the_overlap_and_the_old_one_is_refused_after(engine, wx_keys):
    client, providers = gateway(engine, wx_keys)  # certificate serial and PUB_KEY_ID both listed
    old, new = pending_wechat_payment(engine), pending_wechat_payment(engine)
    for payment_id, signer in ((old, wx_keys.cert_key), (new, wx_keys.pub_key)):
        body, headers = notification(
            wx_keys, transaction(payment_id, transaction_id=f"42{uuid.uuid4().int % 10**26}"), signer=signer
        )
        assert client.post("/callbacks/wechatpay", data=body, headers=headers).status_code == 204
    for row in callback_rows(engine):
        assert process_callback(engine, providers, row.id, POLICY) == CallbackResult.APPLIED
    after, _ = gateway(engine, wx_keys, platform=(wx_keys.pub_key,))  # the certificate is retired
    late = pending_wechat_payment(engine)
    body, headers = notification(wx_keys, transaction(late), signer=wx_keys.cert_key)
    answer = after.post("/callbacks/wechatpay", data=body, headers=headers)
    assert answer.status_code == 401 and answer.get_json()["message"].startswith("unknown_serial")
    assert status_of(engine, late) == "Pending"


def test_a_refund_notification_settles_the_refund(engine, wx_keys):
    client, providers = gateway(engine, wx_keys)
    payment_id = create_payment(
        engine, payment_id=f"pay_{uuid.uuid4().hex[:26]}", provider="wechatpay", status="Succeeded"
    )
    refund_id = f"re_{uuid.uuid4().hex[:26]}"
    now = utcnow()
    with engine.begin() as conn:
        conn.execute(
            insert(refund).values(
                refund_id=refund_id,
                payment_id=payment_id,
                amount_minor=400,
                currency="CNY",
                provider="wechatpay",
                status="Pending",
                created_at=now,
                updated_at=now,
            )
        )
    body, headers = notification(wx_keys, refund_resource(refund_id, payment_id), event_type="REFUND.SUCCESS")
    assert client.post("/callbacks/wechatpay", data=body, headers=headers).status_code == 204
    (row,) = callback_rows(engine)
    assert row.order_no == refund_id
    assert process_callback(engine, providers, row.id, POLICY) == CallbackResult.APPLIED
    with engine.connect() as conn:
        found = conn.execute(select(refund).where(refund.c.refund_id == refund_id)).mappings().one()
    assert found["status"] == "Succeeded" and found["provider_refund_id"] == "50000000382019052709732678859"


@pytest.mark.mariadb
def test_an_unverified_notification_changes_nothing_but_names_the_payment_a_query_then_settles(mariadb, wx_keys):
    """Invariant 11: the refused row names our payment (from the resource), its query is brought forward, it decides."""
    platform = fake.FakeWechatPay(fake_config(wx_keys))
    with FakeServer(platform) as server:
        settings = wx_settings(
            wx_keys, database_url=db_url(mariadb), api_base=server.url, callback_process_inline=False
        )
        client, runtime = create_app(settings, engine=mariadb).test_client(), build_runtime(settings, mariadb)
        adapter = runtime.providers["wechatpay"]
        payment_id = pending_wechat_payment(mariadb)
        adapter.charge(ChargeRequest(payment_id, 1000, "CNY"), None, 5)
        paid = platform.pay(payment_id, notify=False)
        push_query_out(mariadb, payment_id)
        # WeChat has moved to a key we were not given yet: the genuine notification fails verification.
        body, headers = notification(
            wx_keys, transaction(payment_id, transaction_id=paid.transaction_id), signer=wx_keys.stranger
        )
        assert client.post("/callbacks/wechatpay", data=body, headers=headers).status_code == 401
        (row,) = callback_rows(mariadb)
        assert row.status == CallbackStatus.REJECTED and status_of(mariadb, payment_id) == "Pending"
        assert row.order_no == payment_id and row.provider_event_id  # the hint the query acts on
        assert query_due_now(mariadb, payment_id)
        assert query_unresolved.run_once(runtime) == 1
        assert status_of(mariadb, payment_id) == "Succeeded"
        with mariadb.connect() as conn:
            p = conn.execute(select(payment).where(payment.c.payment_id == payment_id)).mappings().one()
        assert p["provider_transaction_id"] == paid.transaction_id and p["status_source"].startswith("query:")

        # Rate-limited per payment: more forgeries for another payment bring its query forward once.
        other = pending_wechat_payment(mariadb)
        push_query_out(mariadb, other)
        for expected in (True, False):
            body, headers = notification(wx_keys, transaction(other), signer=wx_keys.stranger)
            assert client.post("/callbacks/wechatpay", data=body, headers=headers).status_code == 401
            assert query_due_now(mariadb, other) is expected
            push_query_out(mariadb, other)


@pytest.mark.mariadb
def test_the_fake_platform_orders_pays_and_notifies_through_a_served_gateway(mariadb, wx_keys, tmp_path):
    """POST /payments → relay → Native order with code_url → payer pays → signed notification → Succeeded, once."""
    platform = fake.FakeWechatPay(fake_config(wx_keys))
    platform.set_faults(fake.Faults(probe_notifications=True, duplicate_notification_rate=1.0))
    with FakeServer(platform) as server:
        holder: dict = {}
        web = serve(lambda environ, start: holder["app"](environ, start))
        notify_url = f"http://127.0.0.1:{web.server_port}/callbacks/wechatpay"
        settings = wx_settings(wx_keys, api_base=server.url, notify_url=notify_url, database_url=db_url(mariadb))
        app = create_app(settings, engine=mariadb)
        holder["app"] = app.wsgi_app
        threading.Thread(target=web.serve_forever, daemon=True).start()
        try:
            base = f"http://127.0.0.1:{web.server_port}"
            auth = {"Authorization": f"Bearer {settings.merchant_api_token[0]}"}
            created = requests.post(
                f"{base}/payments",
                json={
                    "order_no": "o-1",
                    "amount": 1000,
                    "currency": "CNY",
                    "provider": "wechatpay",
                    "description": "会员",
                },
                headers={**auth, "Idempotency-Key": uuid.uuid4().hex},
                timeout=10,
            )
            assert created.status_code == 201, created.text
            payment_id = created.json()["payment_id"]
            runtime = build_runtime(settings, engine=mariadb)
            relay_outbox.run_once(runtime, max_seconds=5)
            shown = requests.get(f"{base}/payments/{payment_id}", headers=auth, timeout=10).json()
            assert shown["status"] == "Pending" and shown["qr_code"].startswith("weixin://wxpay/bizpayurl?pr=")
            platform.pay(payment_id)
            wait_until(
                lambda: platform.deliveries and platform.deliveries[0].done, timeout=20, message="delivery answered"
            )
            compensate_callbacks.run_once(runtime, max_seconds=5)
        finally:
            web.shutdown()
            web.server_close()
    rows = callback_rows(mariadb)
    # The SIGNTEST probe refused, the notification and its duplicate stored; applied once.
    assert sorted(r.status for r in rows) == [
        CallbackStatus.PROCESSED,
        CallbackStatus.PROCESSED,
        CallbackStatus.REJECTED,
    ]
    assert platform.deliveries[0].answers == [204, 204]
    assert status_of(mariadb, payment_id) == "Succeeded"
    assert all(entry["ok"] for entry in platform.auth_log)


def test_without_wechatpay_settings_there_is_no_route_and_no_provider(engine):
    from tests.support import make_settings

    settings = make_settings(database_url=db_url(engine))
    assert "wechatpay" not in build_providers(settings)
    client = create_app(settings, engine=engine).test_client()
    assert client.post("/callbacks/wechatpay", data=b"{}").status_code == 404
    assert callback_rows(engine) == []
