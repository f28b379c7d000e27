"""Amounts between paysync minor units and Stripe's ``amount``: zero-, two- and three-decimal, and the odd ones."""

from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from payments.outbound.charges import ISO_4217
from payments.providers.stripe.money import (
    STRIPE_ZERO_DECIMAL,
    AmountError,
    from_stripe,
    iso_currency,
    major_to_minor,
    stripe_currency,
    to_stripe,
)


@pytest.mark.parametrize(
    ("minor", "currency", "stripe"),
    [
        (1000, "USD", 1000),  # USD 10.00
        (500, "JPY", 500),  # ¥500: zero-decimal, no ×100
        (50000, "KRW", 50000),
        (1500, "CLP", 1500),
        (5, "ISK", 500),  # ISK is zero-decimal in ISO, two-decimal (multiples of 100) at Stripe
        (50000, "MGA", 500),  # MGA has two ISO decimals, none at Stripe
        (5120, "KWD", 5120),  # three decimals, last digit 0
        (1099, "HUF", 1099),
        (1099, "TWD", 1099),
    ],
)
def test_amounts_convert_exactly_both_ways(minor, currency, stripe):
    assert to_stripe(minor, currency) == stripe
    assert from_stripe(stripe, currency.lower()) == minor


@pytest.mark.parametrize(
    ("minor", "currency"),
    [(5124, "KWD"), (50001, "MGA"), (1000, "IQD"), (10.0, "USD"), (True, "USD"), (100, "usd1"), (100, "")],
)
def test_what_stripe_cannot_take_exactly_is_refused_never_rounded(minor, currency):
    with pytest.raises(AmountError):
        to_stripe(minor, currency)


def test_a_stripe_amount_that_is_not_whole_minor_units_is_refused():
    with pytest.raises(AmountError):
        from_stripe(550, "isk")


def test_stripe_wants_lower_case_codes_and_paysync_writes_upper_case():
    assert stripe_currency("JPY") == "jpy"
    assert iso_currency("jpy") == "JPY"
    with pytest.raises(AmountError):
        iso_currency(None)


def test_major_units_at_the_edge_become_minor_units_by_the_iso_exponent():
    assert major_to_minor("10.50", "USD") == 1050
    assert major_to_minor(Decimal("500"), "JPY") == 500
    assert major_to_minor("1.250", "KWD") == 1250
    with pytest.raises(AmountError):
        major_to_minor("10.5", "JPY")
    with pytest.raises(AmountError):
        major_to_minor("NaN", "USD")


@given(minor=st.integers(min_value=1, max_value=10**12), currency=st.sampled_from(sorted(ISO_4217)))
def test_every_accepted_amount_round_trips(minor, currency):
    try:
        amount = to_stripe(minor, currency)
    except AmountError:
        return  # refused outright, as documented (three-decimal tails, MGA fractions, ISO-only three-decimals)
    assert from_stripe(amount, currency) == minor
    if currency in STRIPE_ZERO_DECIMAL and currency != "MGA":
        assert amount == minor
