"""Stripe balance transactions read as settlement lines, on a fixture in the published object layout.

The fixture follows https://docs.stripe.com/api/balance_transactions/object:
signed ``amount`` in the currency's Stripe unit, ``fee``, ``net`` = amount − fee,
``fee_details``, ``type``, ``reporting_category``, ``source`` (an id, or the
expanded object with ``expand[]=data.source``).
"""

from __future__ import annotations

import io
import json
from datetime import datetime

from hypothesis import given, settings
from hypothesis import strategies as st

from payments.providers.settlement import CHARGE as CHARGE_KIND
from payments.providers.settlement import INFO, SUCCEEDED, checked
from payments.providers.settlement import REFUND as REFUND_KIND
from payments.providers.stripe.bill import parse_balance_transactions, read_settlement

CREATED = 1714557600  # 2024-05-01T10:00:00Z


def txn(txn_type: str, amount: int, fee: int, currency: str = "usd", source=None, **extra) -> dict:  # noqa: ANN001
    return {
        "id": f"txn_{txn_type}_{amount}",
        "object": "balance_transaction",
        "amount": amount,
        "available_on": CREATED + 2 * 86400,
        "created": CREATED,
        "currency": currency,
        "description": None,
        "exchange_rate": None,
        "fee": fee,
        "fee_details": [
            {
                "amount": fee,
                "application": None,
                "currency": currency,
                "description": "Stripe processing fees",
                "type": "stripe_fee",
            }
        ]
        if fee
        else [],
        "net": amount - fee,
        "reporting_category": txn_type,
        "source": source,
        "status": "available",
        "type": txn_type,
        **extra,
    }


CHARGE = {"id": "ch_3MmlLr", "object": "charge", "amount": 1000, "payment_intent": "pi_3MmlLr", "metadata": {}}
REFUND = {
    "id": "re_3MmlLr",
    "object": "refund",
    "amount": 300,
    "payment_intent": "pi_3MmlLr",
    "metadata": {"refund_id": "re_ours", "payment_id": "pay_1"},
}

FIXTURE = [
    txn("charge", 1000, 59, source=CHARGE),
    txn("charge", 2000, 88, source="ch_unexpanded"),
    txn(
        "payment",
        500,
        18,
        currency="jpy",
        source={
            "id": "py_1",
            "object": "charge",
            "payment_intent": {"id": "pi_jpy"},
            "metadata": {"payment_id": "pay_jpy"},
        },
    ),
    txn("refund", -300, 0, source=REFUND),
    txn("refund_failure", 300, 0, source=REFUND),
    txn("stripe_fee", -500, 0, source=None, description="Billing - Usage Fee"),
    txn("adjustment", -1000, 1500, source="du_1"),
    txn("payout", -10000, 0, source="po_1"),
    txn("transfer", -100, 0, source="tr_1"),
]


def _stream(objects: list, extra_lines: tuple[bytes, ...] = ()) -> io.BytesIO:
    lines = [json.dumps(o, separators=(",", ":")).encode() for o in objects]
    return io.BytesIO(b"\n".join([*lines, *extra_lines]) + b"\n")


def test_each_type_becomes_the_settlement_line_it_is():
    lines = list(parse_balance_transactions(_stream(FIXTURE)))
    assert [(x.kind, x.status) for x in lines] == [
        ("charge", "succeeded"),
        ("charge", "succeeded"),
        ("charge", "succeeded"),
        ("refund", "succeeded"),
        ("refund", "failed"),
        ("fee", None),
        ("adjustment", None),
        ("payout", None),
        ("other", None),
    ]
    charge, unexpanded, jpy, refund, refund_failure, fee, adjustment, payout, _ = lines
    assert (charge.provider_reference, charge.amount_minor, charge.fee_minor, charge.net_minor) == (
        "pi_3MmlLr",
        1000,
        59,
        941,
    )
    assert charge.currency == "USD" and charge.occurred_at == datetime(2024, 5, 1, 10, 0, 0)
    assert charge.transaction_id == "txn_charge_1000" and charge.line_no == 1
    assert unexpanded.provider_reference == "ch_unexpanded" and unexpanded.merchant_reference is None
    assert (jpy.provider_reference, jpy.merchant_reference, jpy.amount_minor, jpy.currency) == (
        "pi_jpy",
        "pay_jpy",
        500,
        "JPY",
    )
    assert (refund.provider_reference, refund.merchant_reference, refund.amount_minor) == ("re_3MmlLr", "re_ours", 300)
    assert refund_failure.amount_minor == 300
    assert (fee.fee_minor, fee.amount_minor) == (500, 500)
    assert (adjustment.amount_minor, adjustment.fee_minor, adjustment.net_minor) == (1000, 1500, -2500)
    assert payout.amount_minor == 10000


def test_the_raw_text_and_line_number_of_every_line_are_kept():
    stream = _stream(FIXTURE[:2])
    text = stream.getvalue().decode().splitlines()
    lines = list(parse_balance_transactions(stream))
    assert [(x.line_no, x.raw) for x in lines] == [(1, text[0]), (2, text[1])]


def test_unreadable_lines_are_invalid_with_a_reason_and_the_rest_is_read():
    bad = [
        b"{not json",
        json.dumps({"object": "charge", "id": "ch_1"}).encode(),
        json.dumps(txn("charge", 1000, 59) | {"net": 1}).encode(),
        json.dumps(txn("charge", -1000, 0)).encode(),
        json.dumps(txn("refund", 300, 0)).encode(),
        json.dumps(txn("charge", 550, 0, currency="isk")).encode(),
        json.dumps(txn("charge", 1000, 0) | {"amount": 10.5}).encode(),
        json.dumps(txn("charge", 1000, 0) | {"created": None}).encode(),
        b"",
    ]
    lines = list(parse_balance_transactions(_stream(FIXTURE[:1], tuple(bad))))
    assert lines[0].kind == "charge"
    assert [x.kind for x in lines[1:]] == ["invalid"] * 8 + ["info"]
    assert all(x.error for x in lines[1:-1])
    assert "net" in lines[3].error


def test_it_streams_chunks_that_cut_lines_anywhere():
    data = _stream(FIXTURE).getvalue()
    chunks = [data[i : i + 7] for i in range(0, len(data), 7)]
    whole = list(parse_balance_transactions(io.BytesIO(data)))
    assert list(parse_balance_transactions(iter(chunks))) == whole


def test_settlement_lines_are_the_balance_lines_with_adjustments_and_payouts_as_info():
    stream = _stream(FIXTURE)
    lines = list(read_settlement(stream))
    balance = list(parse_balance_transactions(_stream(FIXTURE)))
    assert [x.line_no for x in lines] == [x.line_no for x in balance]
    charge = lines[0]
    assert (charge.kind, charge.status, charge.provider_reference, charge.merchant_reference) == (
        CHARGE_KIND,
        SUCCEEDED,
        "pi_3MmlLr",
        None,
    )
    assert (charge.amount_minor, charge.fee_minor, charge.currency) == (1000, 59, "USD")
    assert charge.occurred_at == datetime(2024, 5, 1, 10, 0, 0)
    for ours, theirs in zip(lines, balance, strict=True):
        assert checked(ours) == ours, theirs  # every mapped line holds together
        mapped = (ours.kind, ours.amount_minor, ours.fee_minor)
        if theirs.kind in ("adjustment", "payout", "other"):
            assert ours.kind == INFO
        else:
            assert mapped == (theirs.kind, theirs.amount_minor, theirs.fee_minor)
    refund = next(x for x in lines if x.kind == REFUND_KIND)
    assert (refund.provider_reference, refund.merchant_reference) == ("re_3MmlLr", "re_ours")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=200), max_size=20))
def test_arbitrary_bytes_never_raise_and_every_line_comes_out(chunks):
    data = b"".join(chunks)
    lines = list(parse_balance_transactions(iter(chunks)))
    expected = data.split(b"\n")
    if expected and expected[-1] == b"":
        expected.pop()
    assert len(lines) == len(expected)
    for line in lines:
        assert line.kind in ("charge", "refund", "fee", "adjustment", "payout", "other", "info", "invalid")
        assert line.amount_minor is None or line.amount_minor >= 0


def test_the_refund_line_of_a_refund_the_bank_sent_back_is_failed_like_its_refund_failure():
    """Found by the chaos run: a failed refund's two lines (refund, then refund_failure) read succeeded and
    failed, so the reconciliation called our Failed refund a status mismatch. The expanded Refund says failed."""
    sent_back = {**REFUND, "status": "failed"}
    lines = list(parse_balance_transactions(_stream([txn("refund", -300, 0, source=sent_back),
                                                     txn("refund_failure", 300, 0, source=sent_back)])))  # fmt: skip
    assert [(x.kind, x.status, x.merchant_reference) for x in lines] == [("refund", "failed", "re_ours")] * 2
    pending = list(
        parse_balance_transactions(_stream([txn("refund", -300, 0, source={**REFUND, "status": "pending"})]))
    )
    assert [x.status for x in pending] == ["succeeded"]


EUR_CHARGE = {
    "id": "ch_eur",
    "object": "charge",
    "amount": 10000,
    "amount_captured": 10000,
    "currency": "eur",
    "payment_intent": "pi_eur",
    "metadata": {},
}
JPY_REFUND = {**REFUND, "id": "re_jpy", "amount": 5000, "currency": "jpy", "status": "succeeded"}


def test_a_line_settled_in_another_currency_carries_the_charges_own_money_and_keeps_the_settlement_beside_it():
    objects = [
        txn("charge", 10850, 345, source=EUR_CHARGE, exchange_rate=1.085),
        txn("refund", -3350, 0, source=JPY_REFUND, exchange_rate=0.0067),
    ]
    charge, refund = (checked(line) for line in read_settlement(_stream(objects)))
    assert (charge.kind, charge.amount_minor, charge.currency, charge.provider_reference) == (
        CHARGE_KIND,
        10000,
        "EUR",
        "pi_eur",
    )
    assert (charge.settlement_amount_minor, charge.settlement_currency, charge.exchange_rate) == (10850, "USD", "1.085")
    assert (charge.fee_minor, charge.fee_currency) == (345, "USD"), "the fee stays in the balance's currency"
    assert (refund.kind, refund.amount_minor, refund.currency, refund.merchant_reference) == (
        REFUND_KIND,
        5000,
        "JPY",
        "re_ours",
    )
    assert (refund.settlement_amount_minor, refund.settlement_currency, refund.exchange_rate) == (3350, "USD", "0.0067")


def test_a_converted_line_without_its_source_or_rate_is_invalid_with_the_reason_never_matched_on_the_wrong_money():
    lines = list(
        parse_balance_transactions(
            _stream(
                [
                    txn("charge", 10850, 345, source="ch_eur", exchange_rate=1.085),
                    txn("charge", 10850, 345, source=EUR_CHARGE),
                    txn("charge", 10850, 345, source=EUR_CHARGE, exchange_rate=-1),
                    txn("charge", 10850, 345, source={**EUR_CHARGE, "amount_captured": 10.5}, exchange_rate=1.085),
                ]
            )
        )
    )
    assert [x.kind for x in lines] == ["invalid"] * 4
    assert "not expanded" in lines[0].error and "exchange_rate" in lines[1].error


def test_a_same_currency_line_is_read_as_before():
    (line,) = read_settlement(_stream([txn("charge", 1000, 59, source={**CHARGE, "currency": "usd"})]))
    assert (line.amount_minor, line.currency, line.settlement_currency, line.exchange_rate) == (1000, "USD", None, None)
