"""``python -m compensator reconcile --provider alipay|wechatpay|stripe`` end to end against each fake platform.

Each day holds a charge we confirmed, a refund of it we confirmed, and a
charge the platform settled whose notification we never got (local Pending).
The real command runs in its own process, configured only by environment
variables: the adapter downloads the day's file from the fake (Alipay's
trade-bill zip, WeChat Pay's hash-checked bill, Stripe's balance
transactions), the provider's PARSERS entry maps it onto settlement lines,
and the run matches the charge and the refund, resolves the Pending payment
through the state machine, books the day's fees, and leaves nothing
unexplained.
"""

# ruff: noqa: F811 - pytest fixtures imported from tests.alipay_support and tests.wechatpay_support
from __future__ import annotations

import json
import subprocess
import sys
import uuid
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import insert, select

from payments.infra.db import utcnow
from payments.infra.schema import RECON_MATCHED, RECON_RESOLVED, payment, refund, settlement_line
from payments.infra.settings import PROVIDERS, Settings, env_name
from payments.lifecycle.transitions import apply_decision
from payments.money import ledger
from payments.providers.base import ChargeRequest, RefundRequest, Succeeded
from payments.providers.stripe.adapter import StripeProvider
from payments.providers.wechatpay.adapter import WechatPayProvider
from payments.providers.wechatpay.bill import BEIJING
from payments.states import PaymentStatus, decide
from sandbox.fakes import wechatpay as wechat_fake
from tests.alipay_support import APP_ID, fake_alipay, keys, provider_for  # noqa: F401
from tests.stripe_support import API_KEY, OLD_SECRET, FakeServer, charge_request, new_fake
from tests.support import ROOT, create_payment, env_for
from tests.test_reconcile import assert_balanced, status_of
from tests.wechatpay_support import FakeServer as WechatServer
from tests.wechatpay_support import fake_config, wx_keys, wx_settings  # noqa: F401


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


def confirm(engine, kind: str, key: str, reference: str) -> None:
    """What the provider's answer would have done: the state machine to Succeeded, the provider's id stored."""
    table, column = (payment, payment.c.payment_id) if kind == "payment" else (refund, refund.c.refund_id)
    with engine.begin() as conn:
        current = conn.execute(select(table).where(column == key)).mappings().one()
        decision = decide(PaymentStatus(current["status"]), PaymentStatus.SUCCEEDED)
        apply_decision(conn, kind, current, decision, source="call:1", now=utcnow(), provider_reference=reference)


def create_refund(engine, payment_id: str, amount: int, currency: str, provider: str) -> str:
    refund_id = new_id("re")
    now = utcnow()
    with engine.begin() as conn:
        conn.execute(
            insert(refund).values(
                refund_id=refund_id,
                payment_id=payment_id,
                amount_minor=amount,
                currency=currency,
                provider=provider,
                status="Pending",
                idempotency_key=f"key-{refund_id}",
                created_at=now,
                updated_at=now,
            )
        )
    return refund_id


def provider_env(settings: Settings, provider: str, *extra: str) -> dict[str, str]:
    """The environment variables that configure ``provider`` as ``settings`` does."""
    env = {}
    for name in (*PROVIDERS[provider].settings, *extra):
        value: Any = getattr(settings, name)
        if isinstance(value, tuple):
            value = ",".join("=".join(item) if isinstance(item, tuple) else item for item in value)
        env[env_name(name)] = str(value)
    return env


def reconcile_command(engine, provider: str, day: str, env: dict[str, str]) -> dict[str, Any]:
    settings_env = {"DATABASE_URL": engine.url.render_as_string(hide_password=False), **env}
    done = subprocess.run(
        [sys.executable, "-m", "compensator", "reconcile", "--provider", provider, "--date", day, "--format", "json"],
        cwd=ROOT,
        env=env_for(settings_env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def assert_reconciled(engine, report: dict[str, Any], dropped: str) -> None:
    """The charge and the refund matched, the dropped notification resolved, the fees booked, nothing unexplained."""
    assert report["status"] == "completed", report
    assert report["categories"][RECON_MATCHED]["count"] == 2, report["categories"]
    assert report["categories"][RECON_RESOLVED]["count"] == 1, report["categories"]
    assert report["unexplained"] == 0 and report["adjustments"] == 0 and report["reviews"] == 0
    assert report["fees"] and report["fees_booked"] == report["fees"]
    status, source = status_of(engine, dropped)
    assert status == PaymentStatus.SUCCEEDED and source.startswith("reconciliation:")
    assert_balanced(engine)


def test_alipay_trade_bill(engine, keys, fake_alipay):
    adapter = provider_for(keys, fake_alipay)

    def paid(amount: int) -> tuple[str, str]:
        payment_id = create_payment(engine, provider="alipay", amount=amount, currency="CNY")
        request = ChargeRequest(payment_id, amount, "CNY")
        adapter.charge(request, None, 5)
        fake_alipay.control("pay", {"out_trade_no": payment_id})
        answer = adapter.query(payment_id, 5, request)
        assert isinstance(answer, Succeeded), answer
        return payment_id, answer.provider_transaction_id

    ours, trade_no = paid(1000)
    confirm(engine, "payment", ours, trade_no)
    refund_id = create_refund(engine, ours, 500, "CNY", "alipay")
    refunded = adapter.refund(RefundRequest(refund_id, ours, trade_no, 500, "CNY"), None, 5)
    assert isinstance(refunded, Succeeded), refunded
    confirm(engine, "refund", refund_id, refunded.provider_transaction_id)
    dropped, _ = paid(2000)  # paid at Alipay; its notify never reached us

    day = datetime.now(BEIJING).date().isoformat()  # Alipay bills Beijing days
    settings_env = {
        env_name("alipay_app_id"): APP_ID,
        env_name("alipay_app_private_key_file"): keys.files["app"],
        env_name("alipay_public_key_files"): keys.files["alipay.pub"],
        env_name("alipay_gateway_url"): fake_alipay.gateway,
    }
    assert_reconciled(engine, reconcile_command(engine, "alipay", day, settings_env), dropped)


def test_wechatpay_trade_bill(engine, wx_keys):
    platform = wechat_fake.FakeWechatPay(fake_config(wx_keys))
    with WechatServer(platform) as server:
        settings = wx_settings(wx_keys, api_base=server.url)
        adapter = WechatPayProvider.from_settings(settings)

        def paid(amount: int) -> tuple[str, str]:
            payment_id = create_payment(engine, provider="wechatpay", amount=amount, currency="CNY")
            adapter.charge(ChargeRequest(payment_id, amount, "CNY", description="测试商品"), None, 5)
            return payment_id, platform.pay(payment_id, notify=False).transaction_id

        ours, transaction_id = paid(1000)
        confirm(engine, "payment", ours, transaction_id)
        refund_id = create_refund(engine, ours, 400, "CNY", "wechatpay")
        request = RefundRequest(refund_id, ours, transaction_id, 400, "CNY", payment_amount_minor=1000)
        adapter.refund(request, None, 5)
        platform.finish_refund(refund_id, "SUCCESS")
        answer = adapter.query_refund(refund_id, 5, request)
        assert isinstance(answer, Succeeded), answer
        confirm(engine, "refund", refund_id, answer.provider_transaction_id)
        dropped, _ = paid(3000)

        day = datetime.now(wechat_fake.BEIJING).date().isoformat()  # WeChat Pay bills Beijing days
        env = provider_env(settings, "wechatpay", "wechatpay_api_base")
        assert_reconciled(engine, reconcile_command(engine, "wechatpay", day, env), dropped)


def test_stripe_balance_transactions(engine):
    served = FakeServer(new_fake())
    try:
        adapter = StripeProvider(API_KEY, (OLD_SECRET,), served.url)

        def paid(amount: int) -> tuple[str, str]:
            payment_id = create_payment(engine, provider="stripe", amount=amount, currency="USD")
            answer = adapter.charge(charge_request(payment_id, amount), f"key-{payment_id}", 5)
            assert isinstance(answer, Succeeded), answer
            return payment_id, answer.provider_transaction_id

        ours, intent = paid(1000)
        confirm(engine, "payment", ours, intent)
        refund_id = create_refund(engine, ours, 300, "USD", "stripe")
        refunded = adapter.refund(RefundRequest(refund_id, ours, intent, 300, "USD"), f"key-{refund_id}", 5)
        assert isinstance(refunded, Succeeded), refunded
        confirm(engine, "refund", refund_id, refunded.provider_transaction_id)
        # Stripe's charge line names the PaymentIntent, not our number (a Charge does not carry the intent's
        # metadata): the dropped one is a charge whose answer stored the intent, its webhook never came.
        dropped, dropped_intent = paid(2500)
        with engine.begin() as conn:
            conn.execute(
                payment.update().where(payment.c.payment_id == dropped).values(provider_transaction_id=dropped_intent)
            )

        day = datetime.fromtimestamp(served.platform.clock.now(), UTC).date().isoformat()
        env = {
            env_name("stripe_api_key"): API_KEY,
            env_name("stripe_webhook_secrets"): OLD_SECRET,
            env_name("stripe_api_base"): served.url,
        }
        assert_reconciled(engine, reconcile_command(engine, "stripe", day, env), dropped)
    finally:
        served.close()


def test_a_day_reconciled_again_adds_nothing(engine):
    """The same Stripe day twice: the second run finds the same file and posts, resolves and escalates nothing."""
    served = FakeServer(new_fake())
    try:
        adapter = StripeProvider(API_KEY, (OLD_SECRET,), served.url)
        payment_id = create_payment(engine, provider="stripe", amount=700, currency="USD")
        answer = adapter.charge(charge_request(payment_id, 700), f"key-{payment_id}", 5)
        assert isinstance(answer, Succeeded)
        confirm(engine, "payment", payment_id, answer.provider_transaction_id)
        day = datetime.fromtimestamp(served.platform.clock.now(), UTC).date().isoformat()
        env = {
            env_name("stripe_api_key"): API_KEY,
            env_name("stripe_webhook_secrets"): OLD_SECRET,
            env_name("stripe_api_base"): served.url,
        }
        first = reconcile_command(engine, "stripe", day, env)
        assert first["categories"][RECON_MATCHED]["count"] == 1 and first["fees_booked"]
        again = reconcile_command(engine, "stripe", day, env)
        assert again["file"]["seen_before"] and again["file"]["new_lines"] == 0
        assert again["categories"][RECON_MATCHED]["count"] == 1 and again["fees_booked"] == {}
        assert again["resolved"] == again["adjustments"] == again["reviews"] == 0
    finally:
        served.close()


def test_stripe_charges_and_refunds_in_eur_and_jpy_settled_in_usd_reconcile_with_nothing_unexplained(engine):
    """An account settling in USD: each line is matched on the charge's own money, the conversion booked apart."""
    served = FakeServer(new_fake(settlement_currency="usd"))
    try:
        adapter = StripeProvider(API_KEY, (OLD_SECRET,), served.url)

        def paid(amount: int, currency: str) -> tuple[str, str]:
            payment_id = create_payment(engine, provider="stripe", amount=amount, currency=currency)
            answer = adapter.charge(charge_request(payment_id, amount, currency), f"key-{payment_id}", 5)
            assert isinstance(answer, Succeeded), answer
            return payment_id, answer.provider_transaction_id

        eur, eur_intent = paid(10000, "EUR")
        confirm(engine, "payment", eur, eur_intent)
        jpy, jpy_intent = paid(5000, "JPY")
        confirm(engine, "payment", jpy, jpy_intent)
        refund_id = create_refund(engine, eur, 3000, "EUR", "stripe")
        refunded = adapter.refund(RefundRequest(refund_id, eur, eur_intent, 3000, "EUR"), f"key-{refund_id}", 5)
        assert isinstance(refunded, Succeeded), refunded
        confirm(engine, "refund", refund_id, refunded.provider_transaction_id)
        dropped, dropped_intent = paid(1200, "JPY")  # settled, its notification never came
        with engine.begin() as conn:
            conn.execute(
                payment.update().where(payment.c.payment_id == dropped).values(provider_transaction_id=dropped_intent)
            )
        txns = served.platform.balance_transactions
        assert {t["currency"] for t in txns} == {"usd"} and all(t["exchange_rate"] for t in txns)

        day = datetime.fromtimestamp(served.platform.clock.now(), UTC).date().isoformat()
        env = {
            env_name("stripe_api_key"): API_KEY,
            env_name("stripe_webhook_secrets"): OLD_SECRET,
            env_name("stripe_api_base"): served.url,
        }
        report = reconcile_command(engine, "stripe", day, env)

        assert report["unexplained"] == 0 and report["adjustments"] == 0 and report["reviews"] == 0, report
        assert report["categories"][RECON_MATCHED]["count"] == 3, report["categories"]
        assert report["categories"][RECON_RESOLVED]["count"] == 1, report["categories"]
        assert set(report["fees"]) == {"USD"} and report["fees_booked"] == report["fees"]
        settled = sum(t["amount"] for t in txns)
        assert report["fx_converted"] == {"EUR": -7000, "JPY": -6200, "USD": settled}
        with engine.connect() as conn:
            held = {c: v for (account, c), v in ledger.balances(conn).items() if account == "assets:provider:stripe"}
            lines = conn.execute(
                select(
                    settlement_line.c.currency, settlement_line.c.settlement_currency, settlement_line.c.exchange_rate
                )
            ).all()
        # What Stripe holds for us is the USD balance: every transaction's net; nothing is left in EUR or JPY.
        assert held == {"EUR": 0, "JPY": 0, "USD": sum(t["net"] for t in txns)}
        assert sorted(lines) == [("EUR", "USD", "1.085"), ("EUR", "USD", "1.085"), ("JPY", "USD", "0.0067")] + [
            ("JPY", "USD", "0.0067")
        ]
        assert status_of(engine, dropped)[0] == PaymentStatus.SUCCEEDED
        assert_balanced(engine)

        again = reconcile_command(engine, "stripe", day, env)
        assert again["unexplained"] == 0 and again["fx_converted"] == {} and again["fees_booked"] == {}
    finally:
        served.close()
