"""Pending until paid: a QR-code order (Alipay precreate, WeChat Native) waits for the payer, then expires.

Against MariaDB and the fake platforms: an Alipay trade that does not exist
yet (nobody scanned the code) keeps the payment Pending, never Failed; an
order still unpaid past its expiry is closed at the provider (alipay.trade.close,
WeChat's close), and only what the provider says after the close marks it
Failed; one paid meanwhile is Succeeded. The precreate names an absolute
time_expire, so a re-send cannot move it.
"""

# ruff: noqa: F811 - pytest fixtures imported from tests.alipay_support and tests.wechatpay_support
from __future__ import annotations

import json
import uuid
from dataclasses import replace
from datetime import timedelta

import pytest
from sqlalchemy import select, update

from compensator import query_unresolved, relay_outbox
from payments.infra.db import utcnow
from payments.infra.schema import payment, provider_call
from payments.outbound.protocol import EXPIRY_MARGIN
from payments.providers.alipay.adapter import alipay_time
from payments.providers.base import ChargeRequest, Failed, Succeeded
from payments.runtime import build_runtime
from sandbox.fakes import wechatpay as wxfake
from tests.alipay_support import fake_alipay, keys  # noqa: F401
from tests.outbound_support import new_payment, row
from tests.stack import db_url
from tests.test_alipay_gateway import alipay_settings
from tests.wechatpay_support import FakeServer, fake_config, wx_keys, wx_settings  # noqa: F401

pytestmark = pytest.mark.mariadb


def operations(rt, payment_id):  # noqa: ANN001, ANN201
    with rt.engine.connect() as conn:
        q = select(provider_call.c.operation).where(provider_call.c.payment_id == payment_id)
        return conn.execute(q.order_by(provider_call.c.id)).scalars().all()


def due_now(rt, payment_id, *, created_ago: timedelta | None = None) -> None:  # noqa: ANN001
    values = {"next_query_at": utcnow()}
    if created_ago is not None:
        values["created_at"] = utcnow() - created_ago
    with rt.engine.begin() as conn:
        conn.execute(update(payment).where(payment.c.payment_id == payment_id).values(**values))


@pytest.fixture
def alipay_rt(mariadb, keys, fake_alipay):
    return build_runtime(alipay_settings(mariadb, keys, fake_alipay, alipay_order_expire_seconds=600), mariadb)


def precreated(rt, fake_alipay):  # noqa: ANN001, ANN201
    payment_id = new_payment(rt, provider="alipay")
    relay_outbox.run_once(rt)
    p = row(rt, payment_id)
    assert p["status"] == "Pending" and p["qr_code"] == fake_alipay.fake.trades[payment_id].qr_code
    return payment_id


def test_an_unscanned_alipay_trade_is_not_found_and_the_payment_stays_pending(alipay_rt, fake_alipay):
    payment_id = precreated(alipay_rt, fake_alipay)
    for _ in range(3):  # Alipay makes the trade only when the buyer scans: until then every query is NotFound
        due_now(alipay_rt, payment_id)
        query_unresolved.run_once(alipay_rt)
        relay_outbox.run_once(alipay_rt)  # a re-send of the same out_trade_no, if the query asked for one
        assert row(alipay_rt, payment_id)["status"] == "Pending"
    assert "close" not in operations(alipay_rt, payment_id)
    assert len(fake_alipay.fake.trades) == 1, "one trade however often the precreate went out"
    fake_alipay.control("pay", {"out_trade_no": payment_id})
    due_now(alipay_rt, payment_id)
    query_unresolved.run_once(alipay_rt)
    assert row(alipay_rt, payment_id)["status"] == "Succeeded"


def test_an_unscanned_alipay_trade_the_precreate_was_answered_for_is_never_sent_again(alipay_rt, fake_alipay):
    # The backoff after a NotFound outlasts the test, so only due_now makes the payment due: with the fixture's
    # 25-50 ms, a run that took longer than that between a query and its next claim rightly queried again.
    settings = replace(alipay_rt.settings, query_base_seconds=3600, query_max_seconds=3600)
    alipay_rt = replace(alipay_rt, settings=settings)
    payment_id = precreated(alipay_rt, fake_alipay)
    grace = timedelta(seconds=alipay_rt.settings.query_not_found_grace_seconds)
    for n in range(1, 4):  # each time well past the grace since the precreate: still no re-send
        with alipay_rt.engine.begin() as conn:
            conn.execute(
                update(provider_call)
                .where(provider_call.c.payment_id == payment_id, provider_call.c.operation == "charge")
                .values(started_at=utcnow() - grace * 2, finished_at=utcnow() - grace * 2)
            )
        due_now(alipay_rt, payment_id)
        query_unresolved.run_once(alipay_rt)
        relay_outbox.run_once(alipay_rt)
        assert operations(alipay_rt, payment_id).count("query") == n
    assert operations(alipay_rt, payment_id).count("charge") == 1, "Alipay has the order: the QR code is its answer"
    precreates = [r for r in fake_alipay.fake.requests if r.get("method") == "alipay.trade.precreate"]
    assert len(precreates) == 1
    assert row(alipay_rt, payment_id)["status"] == "Pending"


def test_an_unscanned_alipay_trade_is_queried_again_when_it_may_be_closed_not_a_backoff_later(alipay_rt, fake_alipay):
    # An hour of backoff, an order closable 10 minutes from now (600 s expiry + the 30 s margin): the next query
    # comes at the moment the order may be closed, which settles it, not an hour later. The fixture's 1 s call
    # timeout is not under test: in a loaded make test a query ran past it and left the payment Unknown.
    settings = replace(alipay_rt.settings, query_base_seconds=3600, query_max_seconds=3600, provider_timeout_seconds=30)
    alipay_rt = replace(alipay_rt, settings=settings)
    payment_id = precreated(alipay_rt, fake_alipay)
    due_now(alipay_rt, payment_id)
    query_unresolved.run_once(alipay_rt)
    p = row(alipay_rt, payment_id)
    assert p["status"] == "Pending" and operations(alipay_rt, payment_id).count("query") == 1
    closable = p["created_at"] + timedelta(seconds=600) + EXPIRY_MARGIN
    assert p["next_query_at"] == closable


def test_the_precreate_names_an_absolute_expiry_fixed_by_the_payments_creation(alipay_rt, fake_alipay):
    payment_id = precreated(alipay_rt, fake_alipay)
    created = row(alipay_rt, payment_id)["created_at"]
    (sent,) = [r for r in fake_alipay.fake.requests if r.get("method") == "alipay.trade.precreate"]
    biz = json.loads(sent["params"]["biz_content"])
    assert biz["time_expire"] == alipay_time(created + timedelta(seconds=600)) and "timeout_express" not in biz


def test_an_unscanned_alipay_trade_past_its_expiry_is_closed_then_failed_and_cannot_be_paid(alipay_rt, fake_alipay):
    payment_id = precreated(alipay_rt, fake_alipay)
    due_now(alipay_rt, payment_id, created_ago=timedelta(seconds=700))
    query_unresolved.run_once(alipay_rt)
    p = row(alipay_rt, payment_id)
    assert (p["status"], p["error_code"]) == ("Failed", "expired_unpaid")
    assert operations(alipay_rt, payment_id)[-2:] == ["query", "close"]
    assert fake_alipay.fake.trades[payment_id].closed_unscanned, "closed at Alipay before it was marked Failed"
    assert "error" in fake_alipay.control("pay", {"out_trade_no": payment_id}), "the code takes no payment now"


def test_a_scanned_but_unpaid_alipay_trade_past_its_expiry_is_closed_at_alipay_then_failed(alipay_rt, fake_alipay):
    payment_id = precreated(alipay_rt, fake_alipay)
    fake_alipay.control("scan", {"out_trade_no": payment_id})
    due_now(alipay_rt, payment_id)
    query_unresolved.run_once(alipay_rt)
    assert row(alipay_rt, payment_id)["status"] == "Pending", "WAIT_BUYER_PAY before the expiry: still Pending"
    due_now(alipay_rt, payment_id, created_ago=timedelta(seconds=700))
    query_unresolved.run_once(alipay_rt)
    p = row(alipay_rt, payment_id)
    assert (p["status"], p["error_code"]) == ("Failed", "TRADE_CLOSED")
    assert fake_alipay.fake.trades[payment_id].status == "TRADE_CLOSED"


def test_the_fake_refuses_a_payment_past_the_time_expire(alipay_rt, fake_alipay):
    payment_id = precreated(alipay_rt, fake_alipay)
    fake_alipay.fake.trades[payment_id].time_expire = alipay_time(utcnow() - timedelta(seconds=1))
    assert "error" in fake_alipay.control("pay", {"out_trade_no": payment_id})


def test_an_alipay_trade_paid_while_it_was_being_closed_is_succeeded(keys, fake_alipay):
    from tests.alipay_support import provider_for

    adapter = provider_for(keys, fake_alipay)
    payment_id = f"pay_{uuid.uuid4().hex[:20]}"
    adapter.charge(ChargeRequest(payment_id, 1000, "CNY", created_at=utcnow()), None, 5)
    fake_alipay.control("pay", {"out_trade_no": payment_id})  # paid just before our close went out
    outcome = adapter.expire(payment_id, 5, ChargeRequest(payment_id, 1000, "CNY"))
    assert isinstance(outcome, Succeeded)


# --------------------------------------------------------------------------------------------- WeChat Pay


def test_an_unpaid_wechat_order_past_its_expiry_is_closed_at_wechat_then_failed(mariadb, wx_keys):
    platform = wxfake.FakeWechatPay(fake_config(wx_keys))
    with FakeServer(platform) as server:
        settings = wx_settings(
            wx_keys,
            api_base=server.url,
            database_url=db_url(mariadb),
            wechatpay_order_expire_seconds=600,
            provider_timeout_seconds=2.0,
            query_pending_after_seconds=0.2,
        )
        rt = build_runtime(settings, mariadb)
        payment_id = new_payment(rt, provider="wechatpay")
        relay_outbox.run_once(rt)
        assert row(rt, payment_id)["status"] == "Pending" and row(rt, payment_id)["qr_code"]
        due_now(rt, payment_id)
        query_unresolved.run_once(rt)
        assert row(rt, payment_id)["status"] == "Pending", "NOTPAY before the expiry: still Pending"

        due_now(rt, payment_id, created_ago=timedelta(seconds=700))
        query_unresolved.run_once(rt)
        p = row(rt, payment_id)
        assert (p["status"], p["error_code"]) == ("Failed", "CLOSED")
        assert platform.orders[payment_id].trade_state == "CLOSED"
        assert operations(rt, payment_id)[-2:] == ["query", "close"]
        with pytest.raises(ValueError):
            platform.pay(payment_id)


def test_a_wechat_order_paid_before_the_close_is_succeeded_not_failed(wx_keys):
    platform = wxfake.FakeWechatPay(fake_config(wx_keys))
    with FakeServer(platform) as server:
        from payments.providers import build_providers

        adapter = build_providers(wx_settings(wx_keys, api_base=server.url))["wechatpay"]
        payment_id = f"pay_{uuid.uuid4().hex[:26]}"
        adapter.charge(ChargeRequest(payment_id, 1000, "CNY", created_at=utcnow()), None, 5)
        platform.pay(payment_id, notify=False)
        outcome = adapter.expire(payment_id, 5, ChargeRequest(payment_id, 1000, "CNY"))
        assert isinstance(outcome, Succeeded) and not isinstance(outcome, Failed)
