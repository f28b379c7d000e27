"""The real providers' mixes of the chaos run (bench/chaos_providers.py): each row fails on what it is there to catch.

The rows compare paysync's payments with a fake platform's truth; here the
truth and the database are made up, so every row is seen both to hold and to
fail. The full run is ``tests/test_chaos.py`` (its mixes include these).
"""

from __future__ import annotations

import sys

import pytest

from tests.support import ROOT
from tests.test_chaos import _db, _failing, _p, _reconciliation

sys.path.append(str(ROOT / "bench"))

from chaos import build_mixes, parse_args  # noqa: E402
from chaos_providers import AlipayMix, StripeMix, Truth, WechatPayMix  # noqa: E402

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
