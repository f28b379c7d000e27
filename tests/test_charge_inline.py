"""POST /payments to a payer-scans provider sends the charge at once and answers with the QR code.

Against the fake Alipay gateway and the fake WeChat Pay platform: the answer
is Pending with ``qr_code``, and a replay is the same bytes; a slow platform
gets the budget and no more (Created, no qr_code) and the charge still ends
up as one order; a compensator relaying at the same time never sends a second
one; an open breaker or a budget of 0 leaves the row to the relay.
"""

# ruff: noqa: F811 - pytest fixtures imported from tests.alipay_support and tests.wechatpay_support
from __future__ import annotations

import json
import threading
import time
from dataclasses import replace
from datetime import timedelta

import jsonschema_rs
import pytest
from sqlalchemy import func, insert, select

from compensator import relay_outbox
from gateway import create_app
from payments.infra.db import utcnow
from payments.infra.schema import idempotency_request, outbox, payment, provider_breaker, provider_call
from payments.outbound import breaker, idempotency
from payments.outbound.charges import SCOPE, CreatePayment, create_payment
from payments.runtime import build_runtime
from payments.states import BreakerState, OutboxStatus
from sandbox.fakes import wechatpay as wechat_fake
from tests.alipay_support import fake_alipay, keys  # noqa: F401
from tests.stack import db_url
from tests.test_alipay_gateway import alipay_settings
from tests.wechatpay_support import FakeServer as WechatServer
from tests.wechatpay_support import fake_config, wx_keys, wx_settings  # noqa: F401

pytestmark = pytest.mark.mariadb

BUDGET = 1.0
MARGIN = 0.75
"""What the answer may take beyond the budget: the payment's own transaction and the stored answer."""


def post(app, provider="alipay", key=None):
    key = key or f"k-{time.monotonic_ns()}"
    raw = json.dumps({"order_no": f"o-{time.monotonic_ns()}", "amount": 1000, "currency": "CNY", "provider": provider})
    started = time.monotonic()
    answer = app.test_client().post(
        "/payments",
        data=raw,
        headers={"Authorization": f"Bearer {app.config['PAYSYNC'].merchant_api_token[0]}", "Idempotency-Key": key},
        content_type="application/json",
    )
    return answer, time.monotonic() - started, raw, key


def replay(app, raw, key):
    return app.test_client().post(
        "/payments",
        data=raw,
        headers={"Authorization": f"Bearer {app.config['PAYSYNC'].merchant_api_token[0]}", "Idempotency-Key": key},
        content_type="application/json",
    )


def precreates(fake, payment_id):
    return [
        r
        for r in fake.requests
        if r["method"] == "alipay.trade.precreate" and (r.get("biz") or {}).get("out_trade_no") == payment_id
    ]


def calls(engine, payment_id):
    with engine.connect() as conn:
        return conn.execute(
            select(func.count()).select_from(provider_call).where(provider_call.c.payment_id == payment_id)
        ).scalar()


def row(engine, payment_id):
    with engine.connect() as conn:
        return conn.execute(select(payment).where(payment.c.payment_id == payment_id)).mappings().one()


def outbox_status(engine, payment_id):
    with engine.connect() as conn:
        return conn.execute(select(outbox.c.status).where(outbox.c.aggregate_id == payment_id)).scalar()


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def alipay(mariadb, keys, fake_alipay):
    # The call's own timeout is longer than the budget: a slow answer is waited for by the send, not the merchant.
    settings = replace(
        alipay_settings(mariadb, keys, fake_alipay, charge_inline_budget_seconds=BUDGET), provider_timeout_seconds=5.0
    )
    app = create_app(settings, engine=mariadb)
    app.config["PAYSYNC"] = settings
    return app, build_runtime(settings, mariadb)


def test_the_answer_carries_alipays_qr_code_and_a_replay_is_the_same_bytes(mariadb, alipay, fake_alipay):
    app, runtime = alipay
    answer, took, raw, key = post(app)
    assert answer.status_code == 201, answer.get_data(as_text=True)
    body = answer.get_json()
    payment_id = body["payment_id"]
    assert body["status"] == "Pending"
    assert body["qr_code"] == fake_alipay.fake.trades[payment_id].qr_code
    assert took < BUDGET + MARGIN
    # The documented answer: qr_code is a property of the Payment schema, and the body conforms to it.
    schema = app.test_client().get("/openapi.json").get_json()["components"]["schemas"]["Payment"]
    assert set(body) <= set(schema["properties"])
    jsonschema_rs.validate(schema, body)

    again = replay(app, raw, key)
    assert again.status_code == 201 and again.headers["Idempotent-Replayed"] == "true"
    assert again.get_data() == answer.get_data()

    # Sent the relay's way: its provider_call evidence, the row done, nothing left for the relay to send.
    assert calls(mariadb, payment_id) == 1 and outbox_status(mariadb, payment_id) == OutboxStatus.DONE
    assert relay_outbox.run_once(runtime, max_seconds=1) == 0
    assert len(precreates(fake_alipay.fake, payment_id)) == 1
    assert row(mariadb, payment_id)["qr_code"] == body["qr_code"]


def test_the_answer_carries_wechats_code_url_and_a_replay_is_the_same_bytes(mariadb, wx_keys):
    platform = wechat_fake.FakeWechatPay(fake_config(wx_keys))
    with WechatServer(platform) as server:
        settings = wx_settings(
            wx_keys, api_base=server.url, database_url=db_url(mariadb), charge_inline_budget_seconds=BUDGET
        )
        app = create_app(settings, engine=mariadb)
        app.config["PAYSYNC"] = settings
        answer, took, raw, key = post(app, provider="wechatpay")
        assert answer.status_code == 201, answer.get_data(as_text=True)
        body = answer.get_json()
        payment_id = body["payment_id"]
        assert body["status"] == "Pending" and body["qr_code"] == platform.orders[payment_id].code_url
        assert body["qr_code"].startswith("weixin://wxpay/bizpayurl?pr=")
        assert took < BUDGET + MARGIN
        assert replay(app, raw, key).get_data() == answer.get_data()
        assert relay_outbox.run_once(build_runtime(settings, mariadb), max_seconds=1) == 0
        assert platform.order_requests[payment_id] == 1 and calls(mariadb, payment_id) == 1


def test_a_hanging_platform_gets_the_budget_and_the_charge_still_makes_one_trade(mariadb, alipay, fake_alipay):
    app, runtime = alipay
    # The trade is made at once, its answer held past the budget (but inside the call's own timeout).
    fake_alipay.control("faults", {"script": [{"fault": "timeout_after_commit"}], "hang_seconds": 2.5})
    answer, took, raw, key = post(app)
    assert took < BUDGET + MARGIN, took
    body = answer.get_json()
    payment_id = body["payment_id"]
    assert answer.status_code == 201 and body["status"] == "Created" and "qr_code" not in body

    # The send holds the row's lease: a compensator meanwhile sends nothing.
    assert relay_outbox.run_once(runtime, max_seconds=0.5) == 0
    assert wait_for(lambda: row(mariadb, payment_id)["qr_code"] is not None)
    assert row(mariadb, payment_id)["qr_code"] == fake_alipay.fake.trades[payment_id].qr_code
    assert row(mariadb, payment_id)["status"] == "Pending"
    assert outbox_status(mariadb, payment_id) == OutboxStatus.DONE
    assert relay_outbox.run_once(runtime, max_seconds=0.5) == 0
    assert len(precreates(fake_alipay.fake, payment_id)) == 1 and calls(mariadb, payment_id) == 1
    # The replay is what was sent: Created, not what the payment became after.
    assert replay(app, raw, key).get_data() == answer.get_data()


def test_a_compensator_relaying_at_the_same_time_never_sends_a_second_order(mariadb, alipay, fake_alipay):
    app, runtime = alipay
    stop = threading.Event()
    relayed: list[int] = []

    def compensator() -> None:
        while not stop.is_set():
            relayed.append(relay_outbox.run_once(runtime, max_seconds=0.2))

    worker = threading.Thread(target=compensator, daemon=True)
    worker.start()
    try:
        answers = [post(app)[0] for _ in range(8)]
    finally:
        stop.set()
        worker.join(10)
    ids = [a.get_json()["payment_id"] for a in answers]
    assert all(a.status_code == 201 for a in answers)
    assert relay_outbox.run_once(runtime, max_seconds=1) == 0
    for answer, payment_id in zip(answers, ids, strict=True):
        assert len(precreates(fake_alipay.fake, payment_id)) == 1, payment_id
        assert calls(mariadb, payment_id) == 1
        assert row(mariadb, payment_id)["status"] == "Pending"
        body = answer.get_json()
        if body["status"] == "Pending":  # sent inline; else the compensator claimed it first
            assert body["qr_code"] == row(mariadb, payment_id)["qr_code"]
        else:
            assert body["status"] == "Created" and "qr_code" not in body


def test_an_open_breaker_answers_created_and_leaves_the_row_to_the_relay(mariadb, alipay, fake_alipay):
    app, runtime = alipay
    now = utcnow()
    with mariadb.begin() as conn:
        conn.execute(
            insert(provider_breaker).values(
                provider="alipay",
                state=BreakerState.OPEN,
                consecutive_failures=5,
                open_count=1,
                opened_at=now,
                retry_at=now + timedelta(seconds=60),
                updated_at=now,
            )
        )
    breaker._forget(mariadb, "alipay")
    try:
        answer, took, _, _ = post(app)
        body = answer.get_json()
        assert body["status"] == "Created" and "qr_code" not in body and took < BUDGET + MARGIN
        assert precreates(fake_alipay.fake, body["payment_id"]) == []
        assert outbox_status(mariadb, body["payment_id"]) == OutboxStatus.PENDING
    finally:
        with mariadb.begin() as conn:
            conn.execute(provider_breaker.delete())
        breaker._forget(mariadb, "alipay")


def test_a_budget_of_zero_leaves_the_charge_to_the_relay(mariadb, keys, fake_alipay):
    settings = alipay_settings(mariadb, keys, fake_alipay, charge_inline_budget_seconds=0)
    app = create_app(settings, engine=mariadb)
    app.config["PAYSYNC"] = settings
    body = post(app)[0].get_json()
    assert body["status"] == "Created" and "qr_code" not in body
    assert precreates(fake_alipay.fake, body["payment_id"]) == []
    assert relay_outbox.run_once(build_runtime(settings, mariadb), max_seconds=1) == 1
    assert len(precreates(fake_alipay.fake, body["payment_id"])) == 1


def test_a_request_that_dies_after_committing_its_payment_is_taken_over_not_done_again(mariadb):
    request = CreatePayment("o-1", 1000, "CNY", "alipay", None)

    def dies(event_id: str) -> bool:
        raise SystemExit("the worker died mid-send")

    with pytest.raises(SystemExit):
        create_payment(mariadb, request, "k-die", deadline_seconds=3600, lock_seconds=60, send_now=dies)
    with mariadb.connect() as conn:
        assert conn.execute(select(func.count()).select_from(payment)).scalar() == 1
        claim = conn.execute(select(idempotency_request).where(idempotency_request.c.scope == SCOPE)).one()
    assert claim.status == "started" and claim.response_body is not None

    # In flight: 409. Past the lock: the committed payment's own answer, and no second payment.
    with pytest.raises(idempotency.IdempotencyConflict) as busy:
        create_payment(mariadb, request, "k-die", deadline_seconds=3600, lock_seconds=60)
    assert busy.value.http_status == 409
    later = utcnow() + timedelta(seconds=61)
    taken = create_payment(mariadb, request, "k-die", deadline_seconds=3600, lock_seconds=60, now=later)
    assert taken.replayed and taken.body == claim.response_body
    assert json.loads(taken.body)["status"] == "Created"
    with mariadb.connect() as conn:
        assert conn.execute(select(func.count()).select_from(payment)).scalar() == 1
        assert conn.execute(select(idempotency_request.c.status)).scalar() == "done"


def test_a_full_send_pool_answers_created_and_the_relay_sends_the_charge_once(mariadb, alipay, fake_alipay):
    app, runtime = alipay
    pool = app.extensions["paysync"]["send_pool"]
    release = threading.Event()
    # Every worker and every queue place taken (WEB_THREADS of each): the next send has no room.
    held = [pool.submit(release.wait) for _ in range(2 * runtime.settings.web_threads)]
    try:
        assert all(f is not None for f in held) and pool.submit(release.wait) is None
        before = threading.active_count()
        answer, took, _, _ = post(app)
        assert threading.active_count() == before, "no thread of its own was started for the request"
    finally:
        release.set()
    body = answer.get_json()
    payment_id = body["payment_id"]
    assert answer.status_code == 201 and body["status"] == "Created" and took < BUDGET
    assert precreates(fake_alipay.fake, payment_id) == [] and outbox_status(mariadb, payment_id) == OutboxStatus.PENDING

    assert relay_outbox.run_once(runtime, max_seconds=2) == 1  # nothing was lost: the relay finds the row due
    assert row(mariadb, payment_id)["status"] == "Pending" and len(precreates(fake_alipay.fake, payment_id)) == 1
