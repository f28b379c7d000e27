"""Stripe events read as paysync callback events (pure): the mapping, zero-decimal amounts, what is ignored."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from payments.errors import EventIgnored, MalformedCallback
from payments.providers.stripe.adapter import parse_event
from payments.states import PaymentStatus
from tests.stripe_support import event, payment_intent, refund_object


def test_payment_intent_succeeded_is_a_success_for_our_payment():
    pi = payment_intent("pay_1", amount=1999, currency="usd")
    e = parse_event(event("payment_intent.succeeded", pi, event_id="evt_123"))
    assert (e.event_id, e.target, e.report, e.merchant_reference) == (
        "evt_123",
        "payment",
        PaymentStatus.SUCCEEDED,
        "pay_1",
    )
    assert (e.provider_reference, e.amount_minor, e.currency) == (pi["id"], 1999, "USD")


def test_zero_decimal_amounts_are_read_as_they_are_and_isk_is_divided():
    assert (
        parse_event(event("payment_intent.succeeded", payment_intent("pay_1", amount=500, currency="jpy"))).amount_minor
        == 500
    )
    assert (
        parse_event(event("payment_intent.succeeded", payment_intent("pay_1", amount=500, currency="isk"))).amount_minor
        == 5
    )


def test_a_failed_attempt_is_a_failure_with_the_decline_code():
    pi = payment_intent(
        "pay_1",
        status="requires_payment_method",
        last_payment_error={"type": "card_error", "code": "card_declined", "decline_code": "insufficient_funds"},
    )
    e = parse_event(event("payment_intent.payment_failed", pi))
    assert (e.report, e.failure_code) == (PaymentStatus.FAILED, "insufficient_funds")


def test_a_canceled_payment_intent_is_a_failure():
    e = parse_event(
        event("payment_intent.canceled", payment_intent("pay_1", status="canceled", cancellation_reason="abandoned"))
    )
    assert (e.report, e.failure_code) == (PaymentStatus.FAILED, "abandoned")


@pytest.mark.parametrize(
    ("status", "report"),
    [
        ("succeeded", PaymentStatus.SUCCEEDED),
        ("pending", PaymentStatus.PENDING),
        ("failed", PaymentStatus.FAILED),
        ("canceled", PaymentStatus.FAILED),
    ],
)
def test_refund_events_report_the_refunds_status(status, report):
    obj = refund_object("re_ours", "pay_1", status=status, amount=300)
    for event_type in ("refund.created", "refund.updated", "refund.failed"):
        e = parse_event(event(event_type, obj))
        assert (e.target, e.report, e.merchant_reference, e.payment_reference) == ("refund", report, "re_ours", "pay_1")
        assert (e.provider_reference, e.amount_minor) == (obj["id"], 300)


def test_charge_refunded_reads_the_newest_of_our_refunds_when_the_charge_embeds_them():
    older = refund_object("re_a", "pay_1", created=100)
    newer = refund_object("re_b", "pay_1", created=200)
    foreign = refund_object(None, created=300)
    charge = {"id": "ch_1", "object": "charge", "refunds": {"object": "list", "data": [older, newer, foreign]}}
    e = parse_event(event("charge.refunded", charge))
    assert (e.target, e.merchant_reference, e.provider_reference) == ("refund", "re_b", newer["id"])


def test_charge_refunded_without_embedded_refunds_is_acknowledged_and_ignored():
    # Since API version 2022-11-15 a Charge no longer embeds its refunds: the refund.* events carry them.
    with pytest.raises(EventIgnored, match="refund"):
        parse_event(event("charge.refunded", {"id": "ch_1", "object": "charge", "amount_refunded": 300}))


@pytest.mark.parametrize(
    "evt",
    [
        event("payment_intent.succeeded", payment_intent(None)),
        event("refund.updated", refund_object(None)),
        event("charge.succeeded", {"id": "ch_1", "object": "charge"}),
        event("customer.created", {"id": "cus_1", "object": "customer"}),
    ],
    ids=["foreign payment intent", "foreign refund", "charge.succeeded", "customer.created"],
)
def test_genuine_events_that_are_not_ours_are_ignored_not_refused(evt):
    with pytest.raises(EventIgnored):
        parse_event(evt)


@pytest.mark.parametrize(
    "evt",
    [
        [],
        {"object": "list"},
        {**event("payment_intent.succeeded", payment_intent("pay_1")), "id": "ch_1"},
        {**event("payment_intent.succeeded", payment_intent("pay_1")), "created": "yesterday"},
        event("payment_intent.succeeded", payment_intent("pay_1", status="processing")),
        event("payment_intent.succeeded", payment_intent("pay_1", amount=10.5)),
        event("payment_intent.succeeded", payment_intent("pay_1", amount=0)),
        event("payment_intent.succeeded", payment_intent("pay_1", amount=550, currency="isk")),
        event("payment_intent.succeeded", payment_intent("pay_1", currency="dollars")),
        event("payment_intent.succeeded", payment_intent("pay_1", pi_id="ch_abc")),
        event("payment_intent.succeeded", payment_intent("pay_'; DROP")),
        event("payment_intent.succeeded", {"id": "re_1", "object": "refund"}),
        event("refund.updated", refund_object("re_1", status="exploded")),
        {**event("payment_intent.succeeded", payment_intent("pay_1")), "data": {"object": None}},
    ],
)
def test_bodies_that_are_not_stripe_events_of_their_type_are_malformed(evt):
    with pytest.raises(MalformedCallback):
        parse_event(evt)


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=20),
        lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
        max_leaves=30,
    )
)
def test_any_json_value_is_an_event_ignored_or_malformed_and_nothing_else(value):
    json.dumps(value)
    try:
        parse_event(value)
    except (EventIgnored, MalformedCallback):
        pass
