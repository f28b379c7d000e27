"""The real providers' mixes of the chaos run (bench/chaos_providers.py): each row fails on what it is there to catch.

The rows compare paysync's payments with a fake platform's truth; here the
truth and the database are made up, so every row is seen both to hold and to
fail. The full run is ``tests/test_chaos.py`` (its mixes include these).
"""

# ruff: noqa: F811 - pytest fixtures imported from tests.alipay_support and tests.wechatpay_support
from __future__ import annotations

import sys
from collections import Counter

import pytest

from payments.providers.base import ChargeRequest, RefundRequest, Succeeded
from payments.providers.stripe.adapter import StripeProvider
from payments.providers.wechatpay.adapter import WechatPayProvider
from sandbox.fakes import wechatpay as wechat_fake
from tests.alipay_support import fake_alipay, keys, provider_for  # noqa: F401
from tests.stripe_support import API_KEY, OLD_SECRET, charge_request, new_fake
from tests.stripe_support import FakeServer as StripeServer
from tests.support import ROOT
from tests.test_chaos import _db, _failing, _p, _reconciliation
from tests.wechatpay_support import FakeServer as WechatServer
from tests.wechatpay_support import fake_config, wx_keys, wx_settings  # noqa: F401

sys.path.append(str(ROOT / "bench"))

from chaos import build_mixes, parse_args  # noqa: E402
from chaos_providers import AlipayMix, Customer, StripeMix, Truth, WechatPayMix  # noqa: E402
from chaos_refunds import RefundAnswer, RefundDatabase, RefundLoad  # noqa: E402

CREATED = {"k_a": "pay_a", "k_b": "pay_b"}
RECONCILED = "the reconciliation of alipay's day has no unexplained item"
WRONG_TXN = "Succeeded payments whose transaction id is not alipay's"
TRUE = {
    "pay_a": Truth("Succeeded", frozenset({"ch_a"}), 1, raw="TRADE_SUCCESS"),
    "pay_b": Truth("Failed", raw="TRADE_CLOSED"),
}


def mix(cls=AlipayMix, truths=None, reconciliations=None):  # noqa: ANN001, ANN201
    m = cls(faults={})
    m.truths = dict(TRUE if truths is None else truths)
    m.reconciliations = [_reconciliation()] if reconciliations is None else reconciliations
    if isinstance(m, StripeMix):
        m.balance = {}  # read after the reconciliation: nothing held, as the made-up ledger holds nothing
    return m


@pytest.mark.parametrize("cls", [AlipayMix, WechatPayMix, StripeMix])
def test_a_clean_observation_passes_every_row(cls):
    assert _failing(mix(cls).rows(_db(), CREATED)) == set()


@pytest.mark.parametrize(
    ("truths", "payments", "reconciliations", "row"),
    [
        ({**TRUE, "pay_b": Truth("Succeeded", frozenset({"ch_b"}), 1)}, None, None, "status equal to alipay's truth"),
        ({**TRUE, "pay_a": Truth("Failed", raw="PRECREATED")}, None, None, "status equal to alipay's truth"),
        ({k: v for k, v in TRUE.items() if k != "pay_a"}, None, None, "status equal to alipay's truth"),
        (
            {**TRUE, "pay_a": Truth("Succeeded", frozenset({"ch_a", "ch_a2"}), 2)},
            None,
            None,
            "merchant numbers charged more than once at alipay",
        ),
        (
            None,
            {"pay_a": _p("pay_a", "Succeeded", "ch_other")},
            None,
            "Succeeded payments whose transaction id is not alipay's",
        ),
        (
            {**TRUE, "pay_b": Truth("Failed", open_order=True, raw="WAIT_BUYER_PAY")},
            None,
            None,
            "Failed payments whose order alipay would still take money for",
        ),
        (None, None, [_reconciliation(local_only=1)], RECONCILED),
        (
            None,
            None,
            [{"date": "2024-03-01", "error": "x"}],
            "the reconciliation of alipay's day has no unexplained item",
        ),
        (None, None, [], RECONCILED),
    ],
)
def test_each_row_fails_on_what_it_catches(truths, payments, reconciliations, row):
    db = _db()
    if payments:
        db.payments.update(payments)
    assert row in _failing(mix(truths=truths, reconciliations=reconciliations).rows(db, CREATED))


CONVERTED = "Succeeded Stripe payments settled from another currency into USD"
RECEIVABLE = "Stripe receivable in the ledger equal to Stripe's balance, per currency (conversions booked)"


def test_the_stripe_rows_fail_without_cross_currency_payments_or_when_a_conversion_is_missing_from_the_ledger():
    m = mix(StripeMix)
    usd_only = _db()
    usd_only.payments["pay_a"] = {**usd_only.payments["pay_a"], "currency": "USD"}
    assert CONVERTED in _failing(m.rows(usd_only, CREATED))

    m.balance = {"USD": 10850}
    converted = _db(receivables={("assets:provider:stripe", "USD"): 10850, ("assets:provider:stripe", "EUR"): 0})
    assert _failing(m.rows(converted, CREATED)) == set()
    unconverted = _db(receivables={("assets:provider:stripe", "EUR"): 10000})
    assert RECEIVABLE in _failing(m.rows(unconverted, CREATED)), "the EUR was never converted"
    m.balance = None
    assert RECEIVABLE in _failing(m.rows(converted, CREATED)), "the fake's balance was not read"


def test_the_customer_of_a_payment_is_the_same_on_every_pass_and_the_run_has_all_kinds():
    m = mix()
    m.seed = 7
    first = [m.customer(f"pay_{n}") for n in range(200)]
    m.customers.clear()
    assert [m.customer(f"pay_{n}") for n in range(200)] == first
    assert {c.action for c in first} == {"pay", "scan", "ignore"}


def test_providers_name_the_mixes_real_providers_first_and_refuse_unknown_ones():
    assert [m.name for m in build_mixes(parse_args([]))] == ["alipay", "wechatpay", "stripe", "sandbox"]
    assert [m.name for m in build_mixes(parse_args(["--providers", "sandbox"]))] == ["sandbox"]
    with pytest.raises(SystemExit):
        build_mixes(parse_args(["--providers", "paypal"]))


# --- each provider's refunds, read from its fake, feed the refund rows; each row fails on its fault -----------


def _mix_on(cls, url: str):  # noqa: ANN001, ANN202
    m = cls(faults={})
    m.port = int(url.rsplit(":", 1)[1])
    return m


def _refund_rows(m, payment_id: str, txn: str, charged: int, refunds: dict[str, tuple[str, int, str]]):  # noqa: ANN001, ANN202
    """The refund rows over what ``m``'s fake holds; ``refunds`` is refund_id -> (our status, our amount, our
    provider_refund_id), as paysync's refund table would hold them."""
    m.observe()
    load = RefundLoad("http://127.0.0.1:1", "t", run_id="r", mix=m.name, seed=1)
    load.answers = [RefundAnswer(f"rk_{r}", payment_id, a, 201, None, r) for r, (_, a, _) in refunds.items()]
    load.candidates = 1
    load._done.set()
    rows = {
        r: {"refund_id": r, "payment_id": payment_id, "status": s, "amount_minor": a, "provider_refund_id": ref}
        for r, (s, a, ref) in refunds.items()
    }
    ledger = {
        r: Counter({"RefundRequested": 1, "RefundConfirmed" if s == "Succeeded" else "RefundFailed": 1})
        for r, (s, _, _) in refunds.items()
    }
    payments = {payment_id: {**_p(payment_id, "Succeeded", txn), "provider": m.provider, "amount_minor": charged}}
    return load.rows(RefundDatabase(rows, ledger), payments, m.refund_truth(), m.name)


STATUS_ROW = "refund status equal to the platform's truth"
BOOKS_ROW = "payments refunded more than they were charged (ours or the platform's books)"


def _each_row_fails(m, payment_id: str, txn: str, refund_id: str, amount: int, ref: str) -> None:  # noqa: ANN001
    """Clean as paysync would hold it; then wrong status, wrong platform id, and the platform's books over."""
    assert _failing(_refund_rows(m, payment_id, txn, 1000, {refund_id: ("Succeeded", amount, ref)})) == set()
    assert STATUS_ROW in _failing(_refund_rows(m, payment_id, txn, 1000, {refund_id: ("Failed", amount, ref)}))
    assert STATUS_ROW in _failing(_refund_rows(m, payment_id, txn, 1000, {refund_id: ("Succeeded", amount, "x")}))
    # Ours books 1 of a 2 charge (fine); the platform refunded ``amount`` of that charge: only its books are over.
    over = _failing(_refund_rows(m, payment_id, txn, 2, {refund_id: ("Succeeded", 1, ref)}))
    assert BOOKS_ROW in over


def test_alipay_refunds_read_from_the_fake_fail_their_rows(keys, fake_alipay):  # noqa: F811
    adapter = provider_for(keys, fake_alipay)
    request = ChargeRequest("pay_chaos_ali1", 1000, "CNY")
    adapter.charge(request, None, 5)
    fake_alipay.control("pay", {"out_trade_no": "pay_chaos_ali1"})
    paid = adapter.query("pay_chaos_ali1", 5, request)
    assert isinstance(paid, Succeeded), paid
    txn = paid.provider_transaction_id
    done = adapter.refund(RefundRequest("rf_chaos_ali1", "pay_chaos_ali1", txn, 300, "CNY", 1000), None, 5)
    assert isinstance(done, Succeeded), done
    m = _mix_on(AlipayMix, fake_alipay.url)
    m.observe()
    assert m.refund_truth() == {
        "rf_chaos_ali1": [{"id": done.provider_transaction_id, "status": "succeeded", "amount": 300, "charge": txn}]
    }
    assert m.quiet()
    _each_row_fails(m, "pay_chaos_ali1", txn, "rf_chaos_ali1", 300, done.provider_transaction_id)


def test_wechatpay_refunds_read_from_the_fake_fail_their_rows(wx_keys):  # noqa: F811
    platform = wechat_fake.FakeWechatPay(fake_config(wx_keys), wechat_fake.Faults(refund_seconds=3600))
    with WechatServer(platform) as server:
        adapter = WechatPayProvider.from_settings(wx_settings(wx_keys, api_base=server.url))
        adapter.charge(ChargeRequest("pay_chaos_wx1", 1000, "CNY", description="测试商品"), None, 5)
        txn = platform.pay("pay_chaos_wx1", notify=False).transaction_id
        asked = adapter.refund(RefundRequest("rf_chaos_wx1", "pay_chaos_wx1", txn, 400, "CNY", 1000), None, 5)
        m = _mix_on(WechatPayMix, server.url)
        # Still PROCESSING at WeChat: the mix is not quiet, and a refund we call Succeeded differs from it.
        assert not m.quiet()
        ref = asked.provider_transaction_id
        assert STATUS_ROW in _failing(
            _refund_rows(m, "pay_chaos_wx1", txn, 1000, {"rf_chaos_wx1": ("Succeeded", 400, ref)})
        )
        platform.finish_refund("rf_chaos_wx1", "SUCCESS")
        assert m.quiet()
        m.observe()
        assert m.refund_truth() == {"rf_chaos_wx1": [{"id": ref, "status": "succeeded", "amount": 400, "charge": txn}]}
        _each_row_fails(m, "pay_chaos_wx1", txn, "rf_chaos_wx1", 400, ref)
        platform.refunds["rf_chaos_wx1"].status = "ABNORMAL"
        assert STATUS_ROW in _failing(
            _refund_rows(m, "pay_chaos_wx1", txn, 1000, {"rf_chaos_wx1": ("Succeeded", 400, ref)})
        )


def test_stripe_refunds_read_from_the_fake_fail_their_rows():
    platform = new_fake()
    platform.refunds_pending = True
    served = StripeServer(platform)
    try:
        adapter = StripeProvider(API_KEY, (OLD_SECRET,), served.url)
        paid = adapter.charge(charge_request("pay_chaos_st1", 1000), "key-pay_chaos_st1", 5)
        assert isinstance(paid, Succeeded), paid
        txn = paid.provider_transaction_id
        asked = adapter.refund(RefundRequest("rf_chaos_st1", "pay_chaos_st1", txn, 300, "USD"), "rk-st1", 5)
        ref = asked.provider_transaction_id
        m = _mix_on(StripeMix, served.url)
        assert not m.quiet()
        assert STATUS_ROW in _failing(
            _refund_rows(m, "pay_chaos_st1", txn, 1000, {"rf_chaos_st1": ("Succeeded", 300, ref)})
        )
        # The bank (the mix's customer thread) sends the refund back: Failed at Stripe, so ours must be Failed.
        m.seed = 1
        m.customers[ref] = Customer("ignore", 0.0)
        m.play_customers()
        m.play_customers()
        assert m.quiet()
        m.observe()
        assert m.refund_truth() == {"rf_chaos_st1": [{"id": ref, "status": "failed", "amount": 300, "charge": txn}]}
        assert _failing(_refund_rows(m, "pay_chaos_st1", txn, 1000, {"rf_chaos_st1": ("Failed", 300, ref)})) == set()
        assert STATUS_ROW in _failing(
            _refund_rows(m, "pay_chaos_st1", txn, 1000, {"rf_chaos_st1": ("Succeeded", 300, ref)})
        )
        again = adapter.refund(RefundRequest("rf_chaos_st2", "pay_chaos_st1", txn, 300, "USD"), "rk-st2", 5)
        m.customers[again.provider_transaction_id] = Customer("pay", 0.0)
        m.play_customers()
        m.play_customers()
        _each_row_fails(m, "pay_chaos_st1", txn, "rf_chaos_st2", 300, again.provider_transaction_id)
    finally:
        served.close()
