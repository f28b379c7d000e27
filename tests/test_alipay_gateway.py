"""Alipay end to end: POST /callbacks/alipay on the real gateway app, the database, the relay and the fake gateway.

A notify is stored first, verified, answered ``success`` (or ``fail``, kept with status 3), and applied once by
process_callback; a forged one changes nothing but names a payment we can query. A charge goes out through the
relay as a signed precreate, its QR code shows on GET /payments/<id>, and the fake's own signed notify, sent
to a real HTTP server running the gateway, settles it.
"""

# ruff: noqa: F811 - pytest fixtures imported from tests.alipay_support
from __future__ import annotations

import json
import threading
import time
from dataclasses import replace

import pytest
from sqlalchemy import func, select
from werkzeug.serving import make_server

from compensator import query_unresolved, relay_outbox
from gateway import create_app
from payments.inbound.callbacks import CallbackResult, process_callback
from payments.infra.backoff import RetryPolicy
from payments.infra.db import utcnow
from payments.infra.schema import ledger_event, payment, provider_call
from payments.providers.alipay import sign as sig
from payments.providers.base import ChargeRequest
from payments.runtime import build_runtime
from payments.states import CallbackStatus
from tests.alipay_support import (  # noqa: F401
    APP_ID,
    fake_alipay,
    keys,
    notify_fields,
    signed_notify,
)
from tests.outbound_support import push_query_out, query_due_now
from tests.stack import callback_rows, db_url, payment_status
from tests.support import create_payment, make_settings

POLICY = RetryPolicy(max_retries=5, base_seconds=0.01, max_seconds=0.05)


def alipay_settings(engine, keys, fake=None, **overrides):
    return make_settings(
        database_url=db_url(engine),
        alipay_app_id=APP_ID,
        alipay_app_private_key_file=keys.files["app"],
        alipay_public_key_files=(keys.files["alipay.pub"], keys.files["alipay_next.pub"]),
        alipay_gateway_url=fake.gateway if fake else "http://127.0.0.1:9/gateway.do",
        provider_timeout_seconds=1.0,
        query_base_seconds=0.05,
        query_max_seconds=0.2,
        query_pending_after_seconds=0.2,
        # The tests make a payment due themselves: a NotFound right after a send is believed (re-sent) at once.
        query_not_found_grace_seconds=0,
        # The tests look at callback rows as the gateway stored them, then process them themselves.
        callback_process_inline=False,
        # These tests follow the relay's send; POST /payments sending at once is tests/test_charge_inline.py's.
        **{"charge_inline_budget_seconds": 0, **overrides},
    )


def confirmed_count(engine, payment_id):
    with engine.connect() as conn:
        return conn.execute(
            select(func.count())
            .select_from(ledger_event)
            .where(ledger_event.c.payment_id == payment_id, ledger_event.c.event_type == "PaymentConfirmed")
        ).scalar()


def post(client, body):
    return client.post("/callbacks/alipay", data=body, content_type="application/x-www-form-urlencoded")


def test_a_valid_notify_is_answered_success_and_applied_once_however_often_it_comes(engine, keys):
    app = create_app(alipay_settings(engine, keys), engine=engine)
    client = app.test_client()
    payment_id = create_payment(engine, provider="alipay", amount=1000)
    body = signed_notify(notify_fields(payment_id, total_amount="10.00"), keys.alipay)
    for _ in range(3):  # Alipay's retries carry the same notify_id
        answer = post(client, body)
        assert answer.status_code == 200 and answer.get_data() == b"success"
    rows = callback_rows(engine)
    assert [r.status for r in rows] == [CallbackStatus.PENDING] * 3 and rows[0].order_no == payment_id
    providers = app.extensions["paysync"]["providers"]
    outcomes = [process_callback(engine, providers, r.id, POLICY) for r in rows]
    assert outcomes == [CallbackResult.APPLIED, CallbackResult.DUPLICATE, CallbackResult.DUPLICATE]
    assert payment_status(engine, payment_id) == "Succeeded"
    assert confirmed_count(engine, payment_id) == 1
    assert [r.status for r in callback_rows(engine)] == [CallbackStatus.PROCESSED] * 3


def test_each_bad_notify_is_stored_refused_with_fail_and_changes_nothing(engine, keys):
    client = create_app(alipay_settings(engine, keys), engine=engine).test_client()
    payment_id = create_payment(engine, provider="alipay", amount=1000)
    now = time.time()
    good = notify_fields(payment_id)
    cases = {
        "wrong key": (signed_notify(good, keys.stranger), "invalid_signature"),
        "tampered field": (
            signed_notify(good, keys.alipay).replace(b"trade_status=TRADE_SUCCESS", b"trade_status=TRADE_CLOSED"),
            "invalid_signature",
        ),
        "stale notify_time": (
            signed_notify(notify_fields(payment_id, notify_time=sig.format_beijing(now - 30 * 3600)), keys.alipay),
            "stale_timestamp",
        ),
        "missing sign": (signed_notify(good, keys.alipay).split(b"&sign=")[0], "invalid_signature"),
        "malformed body": (b"notify_id=%ZZ%&&", "malformed_callback"),
    }
    for name, (body, code) in cases.items():
        answer = post(client, body)
        assert answer.get_data() == b"fail" and answer.status_code in (400, 401), name
        row = callback_rows(engine)[-1]
        assert bytes(row.callback_data) == body and row.status == CallbackStatus.REJECTED, name
        assert row.result.startswith(f"rejected: {code}"), (name, row.result)
    assert payment_status(engine, payment_id) == "Pending"
    assert confirmed_count(engine, payment_id) == 0


def test_old_and_new_alipay_keys_are_both_accepted_during_a_rotation(engine, keys):
    client = create_app(alipay_settings(engine, keys), engine=engine).test_client()
    for key in (keys.alipay, keys.alipay_next):
        payment_id = create_payment(engine, provider="alipay", amount=1000)
        assert post(client, signed_notify(notify_fields(payment_id), key)).get_data() == b"success"
    assert post(client, signed_notify(notify_fields("pay_x"), keys.stranger)).get_data() == b"fail"


def test_alipay_has_no_route_when_it_is_not_configured(engine):
    client = create_app(make_settings(database_url=db_url(engine)), engine=engine).test_client()
    assert client.post("/callbacks/alipay", data=b"x=1").status_code == 404


@pytest.mark.mariadb
def test_an_unverified_notify_changes_nothing_and_the_query_it_triggers_finds_the_truth(mariadb, keys, fake_alipay):
    settings = alipay_settings(mariadb, keys, fake_alipay)
    runtime = build_runtime(settings, mariadb)
    app = create_app(settings, engine=mariadb)
    payment_id = create_payment(mariadb, provider="alipay", amount=1000)
    provider = runtime.providers["alipay"]
    provider.charge(ChargeRequest(payment_id, 1000, "CNY"), None, 5)
    fake_alipay.control("pay", {"out_trade_no": payment_id})  # paid at Alipay; its notify went nowhere
    push_query_out(mariadb, payment_id)

    # A notify signed with a key we do not trust (a forgery, or Alipay mid-rotation): refused, no state change.
    forged = signed_notify(notify_fields(payment_id), keys.stranger)
    assert post(app.test_client(), forged).get_data() == b"fail"
    row = callback_rows(mariadb)[-1]
    assert row.status == CallbackStatus.REJECTED and payment_status(mariadb, payment_id) == "Pending"

    # The hint: the unverified row names the payment (peek_callback → order_no), whose query is now due;
    # the query by that number is what changes the state.
    assert row.order_no == payment_id and query_due_now(mariadb, payment_id)
    assert query_unresolved.run_once(runtime) == 1
    with mariadb.connect() as conn:
        source = conn.execute(select(payment.c.status_source).where(payment.c.payment_id == payment_id)).scalar()
    assert payment_status(mariadb, payment_id) == "Succeeded" and source.startswith("query:")

    # Rate-limited per payment: a flood of forgeries for it brings no further query forward.
    other = create_payment(mariadb, provider="alipay", amount=1000)
    push_query_out(mariadb, other)
    for _ in range(2):
        post(app.test_client(), signed_notify(notify_fields(other), keys.stranger))
    assert query_due_now(mariadb, other)
    push_query_out(mariadb, other)
    post(app.test_client(), signed_notify(notify_fields(other), keys.stranger))
    assert not query_due_now(mariadb, other)


@pytest.fixture
def live_gateway(mariadb, keys, fake_alipay):
    """The gateway app on a real HTTP port (so the fake can deliver notifies), with its runtime."""
    box: dict = {}
    settings = alipay_settings(mariadb, keys, fake_alipay)
    server = make_server("127.0.0.1", 0, _Lazy(box), threaded=True)
    settings = replace(settings, alipay_notify_url=f"http://127.0.0.1:{server.server_port}/callbacks/alipay")
    box["app"] = create_app(settings, engine=mariadb)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield build_runtime(settings, mariadb), box["app"]
    server.shutdown()
    thread.join(5)


class _Lazy:
    """A WSGI app that is built after the server picks its port."""

    def __init__(self, box: dict) -> None:
        self.box = box

    def __call__(self, environ, start_response):  # noqa: ANN001, ANN204
        return self.box["app"](environ, start_response)


def new_payment(app, amount=1000):
    answer = app.test_client().post(
        "/payments",
        data=json.dumps(
            {"order_no": f"o-{time.monotonic_ns()}", "amount": amount, "currency": "CNY", "provider": "alipay"}
        ),
        headers={"Authorization": "Bearer dev-merchant-token", "Idempotency-Key": f"k-{time.monotonic_ns()}"},
        content_type="application/json",
    )
    assert answer.status_code == 201, answer.get_data(as_text=True)
    return answer.get_json()["payment_id"]


def show(app, payment_id):
    return (
        app.test_client()
        .get(f"/payments/{payment_id}", headers={"Authorization": "Bearer dev-merchant-token"})
        .get_json()
    )


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.mariadb
def test_a_payment_goes_out_as_a_precreate_shows_its_qr_code_and_the_fakes_notify_settles_it(live_gateway, fake_alipay):
    runtime, app = live_gateway
    payment_id = new_payment(app)
    assert relay_outbox.run_once(runtime) == 1
    shown = show(app, payment_id)
    assert shown["status"] == "Pending" and shown["qr_code"] == fake_alipay.fake.trades[payment_id].qr_code
    request = [r for r in fake_alipay.fake.requests if r["method"] == "alipay.trade.precreate"][0]
    assert request["verified"] and request["params"]["notify_url"].endswith("/callbacks/alipay")

    fake_alipay.control("pay", {"out_trade_no": payment_id})
    assert wait_for(lambda: fake_alipay.control("notifications")[-1]["attempts"]), "the fake delivered its notify"
    assert fake_alipay.control("notifications")[-1]["attempts"][0]["answer"] == "success"
    (row,) = callback_rows(runtime.engine)
    assert process_callback(runtime.engine, runtime.providers, row.id, POLICY) == CallbackResult.APPLIED
    assert show(app, payment_id)["status"] == "Succeeded"
    assert show(app, payment_id)["provider_transaction_id"] == fake_alipay.fake.trades[payment_id].trade_no


@pytest.mark.mariadb
@pytest.mark.parametrize("fault", ["system_error", "timeout_after_commit", "acq_system_error"])
def test_an_ambiguous_precreate_leaves_the_payment_unknown_and_the_query_job_recovers_it(
    live_gateway, fake_alipay, fault
):
    runtime, app = live_gateway
    fake_alipay.control("faults", {"script": [{"fault": fault}], "hang_seconds": 2.0})
    payment_id = new_payment(app)
    relay_outbox.run_once(runtime)
    assert show(app, payment_id)["status"] == "Unknown", "an ambiguous answer is never Failed"

    # Query: Alipay has no trade until the buyer scans, so NotFound; the same out_trade_no is sent again.
    with runtime.engine.begin() as conn:
        conn.execute(payment.update().where(payment.c.payment_id == payment_id).values(next_query_at=utcnow()))
    wait_for(lambda: query_unresolved.run_once(runtime) >= 1, timeout=5)
    assert wait_for(lambda: relay_outbox.run_once(runtime) >= 1 or show(app, payment_id)["qr_code"], timeout=5)
    shown = show(app, payment_id)
    assert shown["status"] == "Unknown" and shown["qr_code"] == fake_alipay.fake.trades[payment_id].qr_code
    assert len(fake_alipay.fake.trades) == 1, "one trade however often it was sent"

    fake_alipay.control("pay", {"out_trade_no": payment_id})
    with runtime.engine.begin() as conn:
        conn.execute(payment.update().where(payment.c.payment_id == payment_id).values(next_query_at=utcnow()))
    assert wait_for(lambda: query_unresolved.run_once(runtime) >= 1 and show(app, payment_id)["status"] == "Succeeded")
    with runtime.engine.connect() as conn:
        operations = (
            conn.execute(select(provider_call.c.operation).where(provider_call.c.payment_id == payment_id))
            .scalars()
            .all()
        )
    assert operations.count("charge") == 2 and "query" in operations
