"""A refund through relay_outbox (and query_unresolved where it needs one) against each real provider's fake platform.

The refund is requested the merchant API's way (``payments.outbound.refunds.create_refund``)
for a payment the fake really charged; the relay sends it with the adapter
(Alipay's out_request_no, WeChat Pay's out_refund_no, Stripe's idempotency
key and metadata), and the answer, or the query of a refund still
processing, moves the refund through the state machine to Succeeded with the
platform's refund id.
"""

# ruff: noqa: F811 - pytest fixtures imported from tests.alipay_support and tests.wechatpay_support
from __future__ import annotations

import json

import pytest
from sqlalchemy import select, update

from compensator import query_unresolved, relay_outbox
from payments.infra.backoff import RetryPolicy
from payments.infra.db import utcnow
from payments.infra.schema import payment, provider_call, refund
from payments.money import ledger
from payments.outbound.refunds import create_refund
from payments.providers.base import ChargeRequest, Succeeded
from payments.providers.stripe.adapter import StripeProvider
from payments.providers.wechatpay.adapter import WechatPayProvider
from payments.runtime import Runtime
from sandbox.fakes import wechatpay as wechat_fake
from tests.alipay_support import fake_alipay, keys, provider_for  # noqa: F401
from tests.stripe_support import API_KEY, OLD_SECRET, FakeServer, charge_request, new_fake
from tests.support import create_payment, make_settings
from tests.wechatpay_support import FakeServer as WechatServer
from tests.wechatpay_support import fake_config, wx_keys, wx_settings  # noqa: F401

pytestmark = pytest.mark.mariadb


def runtime_for(engine, adapter) -> Runtime:
    settings = make_settings(
        database_url=engine.url.render_as_string(hide_password=False),
        provider_timeout_seconds=5,
        query_base_seconds=0.05,
        query_max_seconds=0.2,
        query_pending_after_seconds=0,
        relay_max_seconds=10,
    )
    return Runtime(settings, engine, {adapter.name: adapter}, RetryPolicy(3, 0.01, 0.05))


def refund_through_relay(rt: Runtime, payment_id: str, amount: int, finish=None) -> dict:
    answer = create_refund(
        rt.engine, payment_id, amount, "test", f"rk-{payment_id}", deadline_seconds=3600, lock_seconds=60
    )
    refund_id = json.loads(answer.body)["refund_id"]
    assert relay_outbox.run_once(rt) == 1
    if finish is not None:  # the platform finishes the refund later: the query job finds it
        finish(refund_id)
        with rt.engine.begin() as conn:
            conn.execute(update(refund).where(refund.c.refund_id == refund_id).values(next_query_at=utcnow()))
        assert query_unresolved.run_once(rt) == 1
    with rt.engine.connect() as conn:
        row = conn.execute(select(refund).where(refund.c.refund_id == refund_id)).mappings().one()
        calls = conn.execute(select(provider_call).where(provider_call.c.refund_id == refund_id)).mappings().all()
        # The charge was confirmed behind the ledger's back here (set Succeeded): only the refund is booked.
        assert ledger.payment_balance(conn, payment_id) == {row["currency"]: -amount}
    assert row["status"] == "Succeeded", row
    assert row["provider_refund_id"]
    assert calls[0]["operation"] == "refund"
    return dict(row)


def test_alipay_refund_through_the_relay(mariadb, keys, fake_alipay):
    adapter = provider_for(keys, fake_alipay)
    payment_id = create_payment(mariadb, provider="alipay", amount=1000, currency="CNY")
    request = ChargeRequest(payment_id, 1000, "CNY")
    adapter.charge(request, None, 5)
    fake_alipay.control("pay", {"out_trade_no": payment_id})
    paid = adapter.query(payment_id, 5, request)
    assert isinstance(paid, Succeeded), paid
    with mariadb.begin() as conn:
        conn.execute(
            update(payment)
            .where(payment.c.payment_id == payment_id)
            .values(status="Succeeded", provider_transaction_id=paid.provider_transaction_id)
        )
    row = refund_through_relay(runtime_for(mariadb, adapter), payment_id, 500)
    assert paid.provider_transaction_id in row["provider_refund_id"]


def test_wechatpay_refund_processing_then_found_by_the_query(mariadb, wx_keys):
    platform = wechat_fake.FakeWechatPay(fake_config(wx_keys))
    with WechatServer(platform) as server:
        adapter = WechatPayProvider.from_settings(wx_settings(wx_keys, api_base=server.url))
        payment_id = create_payment(mariadb, provider="wechatpay", amount=1000, currency="CNY")
        adapter.charge(ChargeRequest(payment_id, 1000, "CNY", description="测试商品"), None, 5)
        transaction_id = platform.pay(payment_id, notify=False).transaction_id
        with mariadb.begin() as conn:
            conn.execute(
                update(payment)
                .where(payment.c.payment_id == payment_id)
                .values(status="Succeeded", provider_transaction_id=transaction_id)
            )
        rt = runtime_for(mariadb, adapter)
        row = refund_through_relay(rt, payment_id, 400, finish=lambda rid: platform.finish_refund(rid, "SUCCESS"))
        assert row["status_source"].startswith("query:")


def test_stripe_refund_through_the_relay(mariadb):
    served = FakeServer(new_fake())
    try:
        adapter = StripeProvider(API_KEY, (OLD_SECRET,), served.url)
        payment_id = create_payment(mariadb, provider="stripe", amount=1000, currency="USD")
        paid = adapter.charge(charge_request(payment_id, 1000), f"key-{payment_id}", 5)
        assert isinstance(paid, Succeeded), paid
        with mariadb.begin() as conn:
            conn.execute(
                update(payment)
                .where(payment.c.payment_id == payment_id)
                .values(status="Succeeded", provider_transaction_id=paid.provider_transaction_id)
            )
        row = refund_through_relay(runtime_for(mariadb, adapter), payment_id, 300)
        assert row["provider_refund_id"].startswith("re_")
    finally:
        served.close()
