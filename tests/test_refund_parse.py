"""parse_refund and the refund digest (pure): what a refund body may be, and that the digest names the request."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from payments.outbound.idempotency import InvalidRequest
from payments.outbound.refunds import MAX_REASON_LENGTH, digest, parse_refund

reasons = st.none() | st.text(max_size=MAX_REASON_LENGTH)
amounts = st.integers(min_value=1, max_value=2**63 - 1)


@given(amounts, reasons)
def test_any_positive_integer_amount_and_short_reason_is_taken_as_sent(amount, reason):
    body = {"amount": amount} if reason is None else {"reason": reason, "amount": amount}
    assert parse_refund(json.dumps(body).encode()) == (amount, reason)


@given(
    st.one_of(
        st.integers(max_value=0),
        # A float with a fraction, or an integral one not above zero (1000.0 is the amount 1000: accepted).
        st.floats(allow_nan=False, allow_infinity=False).filter(lambda f: not f.is_integer() or f <= 0),
        st.booleans(),
        st.text(),
        st.none(),
        st.lists(st.integers(), max_size=2),
    )
)
def test_an_amount_that_is_not_a_positive_integer_is_refused_as_invalid_amount(amount):
    with pytest.raises(InvalidRequest) as refused:
        parse_refund(json.dumps({"amount": amount}).encode())
    assert (refused.value.code, refused.value.http_status) == ("invalid_amount", 400)


@given(st.text(min_size=MAX_REASON_LENGTH + 1, max_size=MAX_REASON_LENGTH + 20))
def test_a_reason_too_long_is_refused(reason):
    with pytest.raises(InvalidRequest):
        parse_refund(json.dumps({"amount": 1, "reason": reason}).encode())


@given(amounts, reasons, amounts)
def test_the_digest_is_the_request_whatever_else(amount, reason, other):
    assert digest("pay_1", amount, reason) == digest("pay_1", amount, reason)
    assert digest("pay_1", amount, reason) != digest("pay_2", amount, reason), "the payment is part of the request"
    if other != amount:
        assert digest("pay_1", amount, reason) != digest("pay_1", other, reason)
